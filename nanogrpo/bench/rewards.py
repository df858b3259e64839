"""``nanogrpo bench rewards``: the built-in rewards against hand labels, beside the seed's rules and
math_verify alone; their speed.

Reads two labelled sets (JSONL: ``completion``, ``reference``, ``question``, ``category``, human
label ``correct``, and ``format`` in the first; ``finish_reason: "length"`` on a completion the token
limit cut off): GSM8K-style answers (``--data``, default ``tests/data/graded_completions.jsonl``) and
competition-math LaTeX answers (``--latex``, default ``tests/data/graded_latex.jsonl``). For each it
prints, per category, how often nanogrpo's ``correctness`` (and ``format``), the seed's rules and
math_verify alone (:func:`math_verify_alone`, what TRL's and open-r1's accuracy rewards do) agree with
the labels, and names the categories where nanogrpo falls short of the labels or of either peer
(``categories_below_labels``, ``_below_seed``, ``_below_math_verify``: the test suite wants them
empty); then (unless ``--agreement-only``) the time of one
``correctness`` call over each set (median and p99 of all calls over ``--repeats`` passes, in
this process, after a warm-up, each call with math_verify's caches emptied, the reference's kept,
as within a group; the p99 over rows of each row's median and the p99 of each call's CPU time,
which a busy machine's preemptions do not reach; and these for the rows that never reach
math_verify, counted), and the slowest of the :func:`pathological` 100,000-character completions, against
a number reference and against a LaTeX one.

    python -m nanogrpo.bench.rewards [--data FILE] [--latex FILE] [--repeats 20] [--markdown]
                                     [--agreement-only]

The seed's rules, reproduced below as :func:`seed_correctness` and :func:`seed_format`, are
those of its vLLM variant, which the issue that introduced this bench quotes: the last number
of the whole text (``\\d+\\.\\d+|\\d+/\\d+|\\d+``) verified with math_verify against the reference,
and ``^<think>.*?</think>[\\n ]*<answer>.*?</answer>$`` plus exactly one of each of the four tags.
(``grpo.py`` itself has the same correctness and the pattern without ``[\\n ]*`` or the count.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nanogrpo.grading import verify
from nanogrpo.grading.grade import reference
from nanogrpo.rewards.builtin import correctness, format_reward, warm_up

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "graded_completions.jsonl"
LATEX_DATA = DEFAULT_DATA.with_name("graded_latex.jsonl")
LATEX_REFERENCE = "\\frac{\\sqrt{3}}{2}"
"""The LaTeX reference the adversarial completions are also graded against."""


# ----------------------------------------------------------------------------- the seed's rules (reference)

_SEED_NUMBER_RE = re.compile(r"\d+\.\d+|\d+/\d+|\d+")
_SEED_FORMAT_RE = re.compile(r"^<think>.*?</think>[\n ]*<answer>.*?</answer>$", re.DOTALL | re.VERBOSE)


def seed_correctness(completion: str, reference: str) -> bool:
    """THE SEED'S RULE, for comparison only: the last number anywhere in the text, math-verified."""
    from math_verify import ExprExtractionConfig, parse, verify

    nums = _SEED_NUMBER_RE.findall(completion)
    if not nums:
        return False
    ans = parse(nums[-1], extraction_config=[ExprExtractionConfig()])  # math_verify's own timeouts
    gold = parse(reference, extraction_config=[ExprExtractionConfig()])
    return bool(verify(ans, gold))


def seed_format(completion: str) -> bool:
    """THE SEED'S RULE, for comparison only: its pattern plus exactly one of each tag."""
    think = completion.count("<think>") + completion.count("</think>")
    answer = completion.count("<answer>") + completion.count("</answer>")
    return bool(_SEED_FORMAT_RE.match(completion)) and think == 2 and answer == 2


def math_verify_alone(completion: str, ref: str) -> bool:
    """FOR COMPARISON: math_verify over the whole completion, as TRL's and open-r1's accuracy rewards use
    it (its default extraction: the last delimited LaTeX, a box, "answer is", else a number), against
    the reference given to it as LaTeX (``$…$``)."""
    from math_verify import parse
    from math_verify import verify as mv_verify

    gold = parse(f"${ref}$")
    return bool(gold) and bool(mv_verify(gold, parse(completion)))


# ----------------------------------------------------------------------------- agreement


def load_set(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def sample_of(row: dict[str, Any]) -> dict[str, Any]:
    """The sample dict a reward sees for ``row``: its question, reference and, for a completion the token
    limit cut off, ``finish_reason`` (``"length"``; a row without one ended by itself: ``"stop"``)."""
    return {"question": row["question"], "answer": row["reference"],
            "finish_reason": row.get("finish_reason", "stop")}


Judges = dict[str, Callable[[dict[str, Any]], bool]]

JUDGES: Judges = {
    "correct": lambda r: correctness(r["completion"], sample_of(r)) > 0,
    "seed_correct": lambda r: seed_correctness(r["completion"], r["reference"]),
    "mv_correct": lambda r: math_verify_alone(r["completion"], r["reference"]),
    "format": lambda r: format_reward(r["completion"], sample_of(r)) > 0,
    "seed_format": lambda r: seed_format(r["completion"]),
}
"""Each judge's verdict on a row; ``correct``/``format`` judges are scored against the label of that name."""
LATEX_JUDGES: Judges = {k: JUDGES[k] for k in ("correct", "seed_correct", "mv_correct")}


def agreement(rows: list[dict[str, Any]], judges: Judges = JUDGES,
              by: str = "category") -> dict[str, dict[str, Any]]:
    """``{category: {"n": count, judge: agreeing count, ...}}`` plus an ``"all"`` entry (``by``: the row
    field to group by, e.g. ``style``)."""
    table: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        for cat in (r[by], "all"):
            table[cat]["n"] += 1
            for name, judge in judges.items():
                label = r["correct"] if "correct" in name else r["format"]
                table[cat][name] += int(judge(r) == label)
    return {k: dict(v) for k, v in table.items()}


def shortfalls(table: dict[str, dict[str, Any]], judges: Judges) -> dict[str, list[str]]:
    """The categories where nanogrpo's ``correctness`` (and ``format``) agree with fewer labels than all
    (``below_labels``), or with fewer than the seed's rule or math_verify alone (``below_seed``,
    ``below_math_verify``): each list empty is the acceptance bar."""
    cats = sorted(k for k in table if k != "all")
    out = {"below_labels": [c for c in cats if any(table[c][k] < table[c]["n"] for k in ("correct", "format")
                                                    if k in judges)]}
    for key, peer in (("below_seed", "seed_correct"), ("below_math_verify", "mv_correct")):
        if peer in judges:
            out[key] = [c for c in cats if table[c]["correct"] < table[c][peer]]
    return out


def disagreements(rows: list[dict[str, Any]], judge: str = "correct") -> list[dict[str, Any]]:
    """Rows where nanogrpo's ``judge`` (``correct`` or ``format``) disagrees with the label."""
    return [r for r in rows if JUDGES[judge](r) != r[judge]]


COLUMNS = {"correct": "correctness: nanogrpo", "seed_correct": "seed's rule",
           "mv_correct": "math_verify alone",
           "format": "format: nanogrpo", "seed_format": "seed"}


def markdown(table: dict[str, dict[str, Any]], judges: Judges = JUDGES, by: str = "category") -> str:
    def pct(row: dict[str, Any], key: str) -> str:
        return f"{100 * row[key] / row['n']:.0f}%" if 100 * row[key] % row["n"] == 0 or row["n"] < 100 \
            else f"{100 * row[key] / row['n']:.1f}%"

    lines = [f"| {by} | n | " + " | ".join(COLUMNS[k] for k in judges) + " |",
             "|---|---|" + "---|" * len(judges)]
    for cat in sorted(k for k in table if k != "all") + ["all"]:
        row = table[cat]
        name = f"**{cat}**" if cat == "all" else cat
        lines.append(f"| {name} | {row['n']} | " + " | ".join(pct(row, k) for k in judges) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- speed


def _cold(ref: str) -> None:
    """Empty math_verify's caches, then parse ``ref`` again: what a group's first completion finds."""
    verify.clear_caches()
    with contextlib.suppress(verify.TimedOut):  # (then the timed call parses it again)
        verify.parse_latex(reference(ref).latex)


def timed_calls(rows: list[dict[str, Any]], repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of each ``correctness`` call, every row ``repeats`` times, each with math_verify's caches
    emptied but its reference's parse kept (:func:`_cold`): wall time, and this thread's CPU time (what
    the call itself costs, without the time other jobs on a shared machine take from it)."""
    samples = [sample_of(r) for r in rows]
    wall, cpu = [], []
    for _ in range(repeats):
        for r, s in zip(rows, samples):
            _cold(s["answer"])
            t0, c0 = time.perf_counter(), time.thread_time()
            correctness(r["completion"], s)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
    return wall, cpu


def call_times(rows: list[dict[str, Any]], repeats: int) -> list[float]:
    """Wall seconds of each ``correctness`` call (:func:`timed_calls`)."""
    return timed_calls(rows, repeats)[0]


def pathological(n: int = 100_000) -> Iterator[tuple[str, str]]:
    """``(name, completion)``: adversarial completions of ``n`` characters (digits, nested and
    unclosed tags, runs of spaces, commas, signs, fractions, boxes, announcements...)."""
    def rep(s: str) -> str:
        return (s * (n // len(s) + 1))[:n]

    def wrap(s: str) -> str:
        return "<answer>" + s[:n - 17] + "</answer>"

    yield from [
        ("digits", "7" * n), ("digits in an answer", wrap("9" * n)), ("nested <answer>", rep("<answer>")),
        ("nested blocks", rep("<answer><answer></answer>")), ("unclosed <think>", rep("<think>")),
        ("tag pairs", rep("<think>a</think><answer>1</answer>")), ("spaces", " " * n),
        ("a number, then spaces", "5" + " " * (n - 1)), ("spaces in an answer", wrap("5" + " " * n)),
        ("commas", rep(",")), ("digit, comma", rep("1,")), ("thousands", "1" + rep(",000")),
        ("space thousands", "1" + rep(" 000")), ("digit, space", rep("1 ")), ("thin spaces", rep("1\u2009")),
        ("dollars", rep("$")), ("minus signs", rep("-")), ("unicode minus", rep("\u2212")),
        ("-1-1", rep("-1")),
        ("1/1/", rep("1/")), ("fractions", rep("\\frac{1}{2}")), ("\\frac{", rep("\\frac{")),
        ("vulgar fractions", rep("½")), ("mixed numbers", rep("1 1/2 ")), ("\\boxed{", rep("\\boxed{")),
        ("boxes", rep("\\boxed{1}")), ("one deep box", "\\boxed{" + rep("{")),
        ("answer is", rep("the answer is ")), ("answer is, then spaces", "the answer is" + " " * n),
        ("answer:", rep("answer:")), ("####", rep("#")),
        ("number words", rep("one ")), ("hyphenated words", rep("forty-two-")), ("and a", rep("and a ")),
        ("not 5", rep("not 5 ")), ("5 or", rep("5 or ")), ("1 = 1", rep("1 = ")), ("is 5", rep("is 5 ")),
        ("1. 1.", rep("1. ")), ("newlines", "\n" * n), ("new turns", rep("\nQuestion: 5")),
        ("percent", rep("5%")),
        ("cents", rep("5 and 50 cents ")), ("\\times 10^", rep("1 \\times 10^")), ("1e", rep("1e")),
        ("1e99", rep("1e99 ")), ("degrees, spaces", "5 °" + " " * n), ("1+1+...", wrap(rep("1+"))),
        ("\\text{", rep("\\text{")), ("so", rep("so ")),
        # LaTeX: delimiters, boxes, headers, lists, matrices, wrappers
        ("$1$ pairs", rep("$1$ ")), ("$$x$$", rep("$$x$$")), ("\\(", rep("\\(")), ("\\[x\\]", rep("\\[x\\]")),
        ("open braces", rep("{")), ("\\left(", rep("\\left(")),
        ("Final Answer headers", rep("\n**Final Answer**\n")), ("boxes in $", rep("$\\boxed{1}$ and ")),
        ("deep boxes", "\\boxed{" * (n // 14) + "1" + "}" * (n // 14)),
        ("text or", rep("1 \\text{ or } ")), ("x = 1,", rep("x = 1, ")), ("\\sqrt{2}+", rep("\\sqrt{2}+")),
        ("LaTeX in an answer", wrap(rep("\\frac{\\sqrt{3}}{2}, "))), ("$x$ and", rep("$x$ and ")),
        ("brackets in an answer", wrap(rep("[("))), ("delimiter mix", rep("\\boxed{$\\(\\[{")),
        ("after </think>", "</think>" + rep("$(1,2)$ or ")), ("answer is $", rep("The answer is $")),
        ("box of commas", "\\boxed{" + rep("1,")[:n - 8] + "}"), ("\\overline", rep("0.\\overline{3}")),
    ]


def pathological_times(repeats: int = 3, ref: str = "5") -> list[tuple[str, float]]:
    """``(name, seconds)``: the fastest of ``repeats`` ``correctness`` + ``format`` calls on each, against
    reference ``ref``, each call with math_verify's caches emptied (:func:`_cold`)."""
    sample = {"question": "What is 2 + 3?", "answer": ref}
    out = []
    for name, text in pathological():
        best = float("inf")
        for _ in range(repeats):
            _cold(ref)
            t0 = time.perf_counter()
            correctness(text, sample)
            format_reward(text, sample)
            best = min(best, time.perf_counter() - t0)
        out.append((name, best))
    return out


def reaches_math_verify(rows: list[dict[str, Any]]) -> list[bool]:
    """Whether grading each row calls math_verify at all (beyond its reference's parse): MEASUREMENT
    ONLY, by wrapping ``math_verify.parse`` and ``math_verify.verify`` for the duration."""
    import math_verify

    real, calls = {"parse": math_verify.parse, "verify": math_verify.verify}, [0]

    def counting(name: str):
        def call(*args, **kwargs):
            calls[0] += 1
            return real[name](*args, **kwargs)
        return call

    out = []
    try:
        for r in rows:
            _cold(r["reference"])
            calls[0] = 0
            math_verify.parse, math_verify.verify = counting("parse"), counting("verify")
            correctness(r["completion"], sample_of(r))
            math_verify.parse, math_verify.verify = real["parse"], real["verify"]
            out.append(calls[0] > 0)
    finally:
        math_verify.parse, math_verify.verify = real["parse"], real["verify"]
    return out


def _p99(times: list[float]) -> float:
    times = sorted(times)
    return round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 4) if times else float("nan")


def _speed(rows: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    raw, cpu = timed_calls(rows, repeats)
    per_row = [statistics.median(raw[i::len(rows)]) for i in range(len(rows))]
    mv = reaches_math_verify(rows)
    plain = [t for i, t in enumerate(raw) if not mv[i % len(rows)]]
    return {"median_ms": round(1000 * statistics.median(raw), 4), "p99_ms": _p99(raw),
            "max_ms": round(1000 * max(raw), 3), "row_median_p99_ms": _p99(per_row), "cpu_p99_ms": _p99(cpu),
            "without_math_verify_cpu_p99_ms": _p99([t for i, t in enumerate(cpu) if not mv[i % len(rows)]]),
            "rows_reaching_math_verify": sum(mv), "without_math_verify_p99_ms": _p99(plain),
            "without_math_verify_row_median_p99_ms": _p99([t for t, m in zip(per_row, mv) if not m])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanogrpo bench rewards", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="GSM8K-style labelled JSONL (default: %(default)s)")
    p.add_argument("--latex", type=Path, default=LATEX_DATA,
                   help="competition-math labelled JSONL (default: %(default)s); 'none' to skip")
    p.add_argument("--repeats", type=int, default=20,
                   help="passes over the GSM8K-style set for the call times (a tenth: the LaTeX set)")
    p.add_argument("--markdown", action="store_true", help="also print the per-category tables as markdown")
    p.add_argument("--show", action="store_true", help="print the rows where nanogrpo disagrees with a label")
    p.add_argument("--agreement-only", action="store_true",
                   help="the agreement tables and their shortfalls only, no timing (the test suite's run)")
    a = p.parse_args(argv)
    latex = None if str(a.latex) == "none" else a.latex
    for path in (a.data, latex):
        if path is not None and not path.is_file():
            print(f"nanogrpo bench rewards: no labelled set at {path}; pass --data / --latex FILE",
                  file=sys.stderr)
            return 2
    rows = load_set(a.data)
    latex_rows = load_set(latex) if latex is not None else []
    warm_up()
    table = agreement(rows)
    latex_table = agreement(latex_rows, LATEX_JUDGES) if latex_rows else None
    if a.markdown:
        print(markdown(table))
        if latex_table is not None:
            print()
            print(markdown(latex_table, LATEX_JUDGES))
            print()
            print(markdown(agreement(latex_rows, LATEX_JUDGES, by="style"), LATEX_JUDGES, by="style"))
    if a.show:
        for judge in ("correct", "format"):
            for r in disagreements(rows, judge):
                print(f"{judge} label={r[judge]}: {r['id']} {r['category']}: {r['completion']!r}",
                      file=sys.stderr)
        for r in disagreements(latex_rows):
            print(f"correct label={r['correct']}: {r['id']} {r['category']}: {r['completion']!r}",
                  file=sys.stderr)
    total = table["all"]
    out: dict[str, Any] = {
        "bench": "rewards", "data": str(a.data), "n": total["n"],
        "correctness_agreement": round(total["correct"] / total["n"], 4),
        "seed_correctness_agreement": round(total["seed_correct"] / total["n"], 4),
        "math_verify_alone_agreement": round(total["mv_correct"] / total["n"], 4),
        "format_agreement": round(total["format"] / total["n"], 4),
        "seed_format_agreement": round(total["seed_format"] / total["n"], 4),
        **{f"categories_{k}": v for k, v in shortfalls(table, JUDGES).items()},
    }
    if latex_table is not None:
        lt = latex_table["all"]
        out.update({
            "latex_data": str(latex), "latex_n": lt["n"],
            "latex_correctness_agreement": round(lt["correct"] / lt["n"], 4),
            "latex_seed_correctness_agreement": round(lt["seed_correct"] / lt["n"], 4),
            "latex_math_verify_alone_agreement": round(lt["mv_correct"] / lt["n"], 4),
            **{f"latex_categories_{k}": v for k, v in shortfalls(latex_table, LATEX_JUDGES).items()},
        })
    if not a.agreement_only:
        out.update(_timings(rows, latex_rows, a.repeats))
    out["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(out))
    return 0


def _timings(rows: list[dict[str, Any]], latex_rows: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The speed half of the bench (module docstring)."""
    speed = _speed(rows, repeats)
    patho = pathological_times()
    worst = max(patho, key=lambda x: x[1])
    out = {**{f"correctness_{k}": v for k, v in speed.items()},
           "pathological_100k_worst_ms": round(1000 * worst[1], 2), "pathological_100k_worst": worst[0]}
    if latex_rows:
        lspeed = _speed(latex_rows, max(1, repeats // 10))
        lpatho = max(pathological_times(ref=LATEX_REFERENCE), key=lambda x: x[1])
        out.update({
            **{f"latex_correctness_{k}": v for k, v in lspeed.items()},
            "pathological_100k_latex_reference_worst_ms": round(1000 * lpatho[1], 2),
            "pathological_100k_latex_reference_worst": lpatho[0],
        })
    return out


if __name__ == "__main__":
    sys.exit(main())
