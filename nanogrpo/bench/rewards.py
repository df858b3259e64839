"""``nanogrpo bench rewards``: the built-in rewards against hand labels, beside the seed's rules; their speed.

Reads a labelled set (JSONL: ``completion``, ``reference``, ``question``, ``category``, human
labels ``correct`` and ``format``; default ``tests/data/graded_completions.jsonl``) and prints,
per category, how often nanogrpo's ``correctness`` / ``format`` and the seed's rules agree with
the labels; then the time of one ``correctness`` call over the set (median and p99 of all calls
over ``--repeats`` passes, in this process, after a warm-up; and the p99 over rows of each row's
median, which a busy machine's preemptions do not reach), and the slowest of the
:func:`pathological` 100,000-character completions.

    python -m nanogrpo.bench.rewards [--data FILE] [--repeats 20] [--markdown]

The seed's rules, reproduced below as :func:`seed_correctness` and :func:`seed_format`, are
those of its vLLM variant, which the issue that introduced this bench quotes: the last number
of the whole text (``\\d+\\.\\d+|\\d+/\\d+|\\d+``) verified with math_verify against the reference,
and ``^<think>.*?</think>[\\n ]*<answer>.*?</answer>$`` plus exactly one of each of the four tags.
(``grpo.py`` itself has the same correctness and the pattern without ``[\\n ]*`` or the count.)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nanogrpo.rewards.builtin import correctness, format_reward, warm_up

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "graded_completions.jsonl"


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


# ----------------------------------------------------------------------------- agreement


def load_set(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def sample_of(row: dict[str, Any]) -> dict[str, Any]:
    return {"question": row["question"], "answer": row["reference"]}


Judges = dict[str, Callable[[dict[str, Any]], bool]]

JUDGES: Judges = {
    "correct": lambda r: correctness(r["completion"], sample_of(r)) > 0,
    "seed_correct": lambda r: seed_correctness(r["completion"], r["reference"]),
    "format": lambda r: format_reward(r["completion"], sample_of(r)) > 0,
    "seed_format": lambda r: seed_format(r["completion"]),
}
"""Each judge's verdict on a row; ``correct``/``format`` judges are scored against the label of that name."""


def agreement(rows: list[dict[str, Any]], judges: Judges = JUDGES) -> dict[str, dict[str, Any]]:
    """``{category: {"n": count, judge: agreeing count, ...}}`` plus an ``"all"`` entry."""
    table: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        for cat in (r["category"], "all"):
            table[cat]["n"] += 1
            for name, judge in judges.items():
                label = r["correct"] if "correct" in name else r["format"]
                table[cat][name] += int(judge(r) == label)
    return {k: dict(v) for k, v in table.items()}


def disagreements(rows: list[dict[str, Any]], judge: str = "correct") -> list[dict[str, Any]]:
    """Rows where nanogrpo's ``judge`` (``correct`` or ``format``) disagrees with the label."""
    return [r for r in rows if JUDGES[judge](r) != r[judge]]


def markdown(table: dict[str, dict[str, Any]]) -> str:
    def pct(row: dict[str, Any], key: str) -> str:
        return f"{100 * row[key] / row['n']:.0f}%"

    lines = ["| category | n | correctness: nanogrpo | seed | format: nanogrpo | seed |",
             "|---|---|---|---|---|---|"]
    for cat in sorted(k for k in table if k != "all") + ["all"]:
        row = table[cat]
        name = f"**{cat}**" if cat == "all" else cat
        lines.append(f"| {name} | {row['n']} | {pct(row, 'correct')} | {pct(row, 'seed_correct')} | "
                     f"{pct(row, 'format')} | {pct(row, 'seed_format')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- speed


def call_times(rows: list[dict[str, Any]], repeats: int) -> list[float]:
    """Seconds of each ``correctness`` call, every row ``repeats`` times."""
    samples = [sample_of(r) for r in rows]
    times = []
    for _ in range(repeats):
        for r, s in zip(rows, samples):
            t0 = time.perf_counter()
            correctness(r["completion"], s)
            times.append(time.perf_counter() - t0)
    return times


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
    ]


def pathological_times(repeats: int = 3) -> list[tuple[str, float]]:
    """``(name, seconds)``: the fastest of ``repeats`` ``correctness`` + ``format`` calls on each."""
    sample = {"question": "What is 2 + 3?", "answer": "5"}
    out = []
    for name, text in pathological():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            correctness(text, sample)
            format_reward(text, sample)
            best = min(best, time.perf_counter() - t0)
        out.append((name, best))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanogrpo bench rewards", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled JSONL (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="passes over the set for the call times")
    p.add_argument("--markdown", action="store_true", help="also print the per-category table as markdown")
    p.add_argument("--show", action="store_true", help="print the rows where nanogrpo disagrees with a label")
    a = p.parse_args(argv)
    if not a.data.is_file():
        print(f"nanogrpo bench rewards: no labelled set at {a.data}; pass --data FILE", file=sys.stderr)
        return 2
    rows = load_set(a.data)
    warm_up()
    table = agreement(rows)
    if a.markdown:
        print(markdown(table))
    if a.show:
        for judge in ("correct", "format"):
            for r in disagreements(rows, judge):
                print(f"{judge} label={r[judge]}: {r['id']} {r['category']}: {r['completion']!r}",
                      file=sys.stderr)
    raw = call_times(rows, a.repeats)
    times = sorted(raw)
    per_row = sorted(statistics.median(raw[i::len(rows)]) for i in range(len(rows)))
    patho = pathological_times()
    worst = max(patho, key=lambda x: x[1])
    total = table["all"]
    print(json.dumps({
        "bench": "rewards", "data": str(a.data), "n": total["n"],
        "correctness_agreement": round(total["correct"] / total["n"], 4),
        "seed_correctness_agreement": round(total["seed_correct"] / total["n"], 4),
        "format_agreement": round(total["format"] / total["n"], 4),
        "seed_format_agreement": round(total["seed_format"] / total["n"], 4),
        "correctness_median_ms": round(1000 * statistics.median(times), 4),
        "correctness_p99_ms": round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 4),
        "correctness_max_ms": round(1000 * times[-1], 3),
        "correctness_row_median_p99_ms": round(1000 * per_row[min(len(rows) - 1, int(0.99 * len(rows)))], 4),
        "pathological_100k_worst_ms": round(1000 * worst[1], 2), "pathological_100k_worst": worst[0],
        "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
