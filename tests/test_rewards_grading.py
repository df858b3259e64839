"""The built-in rewards grade as a careful human grader does: a hand-labelled set, number formats,
what must not be accepted, the format rule, bounded time on adversarial input, and truncation.

``tests/data/graded_completions.jsonl`` holds completions written by hand the way Qwen2.5/Qwen3,
Llama, Mistral, Gemma, Phi, R1-distilled and base models write them, each with a human label
(``correct``, ``format``), the reference and a category. ``python -m nanogrpo.bench.rewards
--markdown`` prints the agreement table of the README, beside the seed's rules.
"""

from __future__ import annotations

import statistics
import time
from fractions import Fraction

import pytest

from nanogrpo.bench.rewards import (
    DEFAULT_DATA,
    JUDGES,
    agreement,
    disagreements,
    load_set,
    pathological,
    seed_correctness,
    seed_format,
    timed_calls,
)
from nanogrpo.config import RewardsConfig
from nanogrpo.grading.extract import read_answer
from nanogrpo.grading.numbers import find_number_words, read_number
from nanogrpo.rewards import RewardRunner, correctness, format_reward, resolve
from nanogrpo.rewards.builtin import answers_match, format_strict, well_formed
from nanogrpo.rollout.collect import completion_samples

ROWS = load_set(DEFAULT_DATA)

# Every category the issue names, and the format variants it lists.
REQUIRED_CATEGORIES = {
    "thousands", "negative", "mixed_number", "vulgar_fraction", "latex_fraction", "scale_words", "scientific",
    "dollars_cents", "number_words", "percent", "decimal_integer", "leading_result", "equals_result",
    "is_result", "boxed_in_answer", "no_tags_boxed", "no_tags_announced", "no_tags_last_number",
    "several_candidates", "negated", "range", "wrong_value",
    "format_qwen_newlines", "format_crlf", "format_tabs", "format_nested", "format_draft_in_think",
    "format_second_answer", "format_text_outside", "format_unclosed", "format_truncated",
    # issue 27: units however written, signs, scale words, compound quantities, cut off without an answer
    "unit_power", "unit_rate", "unit_degree", "sign_written", "scale_asked", "compound_unit",
    "truncated_no_answer",
}


# ----------------------------------------------------------------------------- the labelled set


def test_labelled_set_is_what_it_claims() -> None:
    assert len(ROWS) >= 150
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    assert len({r["completion"] for r in ROWS}) == len(ROWS), "a completion appears twice"
    for r in ROWS:
        assert isinstance(r["correct"], bool) and isinstance(r["format"], bool), r["id"]
        assert r["question"] and r["reference"] and r["category"] and r["style"], r["id"]
    cats = {r["category"] for r in ROWS}
    assert REQUIRED_CATEGORIES <= cats, REQUIRED_CATEGORIES - cats
    # both verdicts occur, and plenty of each
    assert 0.2 < sum(r["correct"] for r in ROWS) / len(ROWS) < 0.9
    assert 0.2 < sum(r["format"] for r in ROWS) / len(ROWS) < 0.9


def _report(rows: list[dict], judge: str) -> str:
    return "\n".join(f"{r['id']} {r['category']} label={r[judge]}: {r['completion']!r}"
                     for r in disagreements(rows, judge))


def test_agreement_with_the_labels_per_category() -> None:
    """Every row of every category: a change to the LaTeX path that costs this set one case fails here."""
    table = agreement(ROWS, {k: JUDGES[k] for k in ("correct", "format")})
    total = table["all"]
    assert total["format"] == total["n"], _report(ROWS, "format")
    assert total["correct"] == total["n"], _report(ROWS, "correct")
    for cat, row in table.items():
        assert row["format"] == row["n"], f"format, {cat}:\n" + _report(ROWS, "format")
        assert row["correct"] == row["n"], f"correctness, {cat}:\n" + _report(ROWS, "correct")
    cut = [r for r in ROWS if r.get("finish_reason") == "length"]
    assert len(cut) >= 10 and {r["correct"] for r in cut} == {True, False}
    assert all(r["finish_reason"] == "length" for r in ROWS if "finish_reason" in r)


@pytest.mark.slow
def test_bench_rewards_checks_both_sets_and_the_seeds_rule(capsys) -> None:
    """``nanogrpo bench rewards`` on the shipped sets: every category of the GSM8K-style and the LaTeX set
    at 100% agreement with the labels, and never below the seed's rule or math_verify alone."""
    import json

    from nanogrpo import bench

    assert bench.main(["rewards", "--agreement-only"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["n"] == len(ROWS) and row["latex_n"] >= 580
    assert row["correctness_agreement"] == 1.0 and row["format_agreement"] == 1.0
    assert row["latex_correctness_agreement"] == 1.0
    for key in ("categories_below_labels", "categories_below_seed", "categories_below_math_verify",
                "latex_categories_below_labels", "latex_categories_below_seed",
                "latex_categories_below_math_verify"):
        assert row[key] == [], (key, row[key])
    assert "correctness_median_ms" not in row  # --agreement-only: no timing


def test_seed_rules_reference() -> None:
    """The seed's rules, reproduced in nanogrpo.bench.rewards for the README's table, behave as the seed."""
    assert seed_format("<think>a</think>\n <answer>1</answer>")
    assert seed_format("<think>a</think><answer>1</answer>\n")
    assert not seed_format("<think>a</think>\t<answer>1</answer>")  # tabs are not in [\n ]*
    assert not seed_format("\n<think>a</think><answer>1</answer>")  # nothing before <think>
    assert not seed_format("<think>a</think><answer><answer>1</answer>")  # tag count
    assert seed_correctness("<answer>42 (6 x 7)</answer>", "7") and not seed_correctness("-5", "-5")


@pytest.mark.slow
def test_project_rules_grade_the_set_better_than_the_seeds() -> None:
    table = agreement(ROWS)["all"]  # the seed's rules call math_verify on every row: seconds
    assert table["correct"] > table["seed_correct"] + 0.2 * table["n"]
    assert table["format"] > table["seed_format"]


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_correctness_is_fast_on_the_set() -> None:
    correctness("<answer>1</answer>", {"answer": "1"})
    times = timed_calls(ROWS, 3)[1]  # CPU time: on a shared machine the wall clock counts others' work too
    # The acceptance figure (median <= 0.1 ms, p99 <= 5 ms) is measured by `nanogrpo bench rewards`; a shared
    # test machine gets a 5x margin on the median (a regex that backtracks or a math_verify call costs ms).
    assert statistics.median(times) < 0.5e-3, f"median {1000 * statistics.median(times):.3f} ms of CPU a call"


@pytest.mark.parametrize("name, text", list(pathological()), ids=[n for n, _ in pathological()])
def test_adversarial_completion_takes_bounded_time(name: str, text: str) -> None:
    sample = {"question": "What is 2 + 3?", "answer": "5"}
    t0 = time.process_time()
    c, f = correctness(text, sample), format_reward(text, sample)
    best = time.process_time() - t0
    assert c in (1.0, -1.0) and f in (1.25, -1.0)
    # target 50 ms for 100k characters (bench); 10x margin here. Quadratic patterns took seconds to minutes.
    # CPU time, not wall time: on a shared machine other processes stretch the wall clock (7 ms of CPU
    # measured 35 ms of wall clock here at a load of 3), not the work this call does.
    assert best < 0.5, f"{name}: {best * 1000:.0f} ms of CPU"


# ----------------------------------------------------------------------------- how numbers are written


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234), ("1 234", 1234), ("1\u2009234", 1234), ("1\u202f234", 1234), ("1\u00a0234", 1234),
    ("1{,}234", 1234), (r"1\,234", 1234), ("$1,234.50", Fraction(2469, 2)), ("−5", -5), ("–5", -5),
    ("negative 5", -5), ("minus 5", -5), ("5 below zero", -5), ("-$25", -25), (r"\$-25", -25),
    ("1 1/2", Fraction(3, 2)), ("1½", Fraction(3, 2)), ("1 ½", Fraction(3, 2)),
    (r"1\frac{1}{2}", Fraction(3, 2)),
    ("1 and 1/2", Fraction(3, 2)), ("2 and a half", Fraction(5, 2)), ("¾", Fraction(3, 4)),
    (r"\frac34", Fraction(3, 4)),
    (r"\dfrac{3}{4}", Fraction(3, 4)), (r"\tfrac{3}{4}", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)),
    ("3/4", Fraction(3, 4)), (".5", Fraction(1, 2)), ("$70k", 70000), ("70K", 70000), ("70 thousand", 70000),
    ("1.5 million", 1500000), ("$2.4M", 2400000), ("$2B", 2 * 10**9), ("3 billion", 3 * 10**9),
    ("2 dozen", 24),
    ("18 dollars and 50 cents", Fraction(37, 2)), ("$18 and 50 cents", Fraction(37, 2)), ("1.2e3", 1200),
    ("1.2E+03", 1200), (r"1.2 \times 10^3", 1200), (r"1.2 \cdot 10^{3}", 1200), ("1.2 × 10^3", 1200),
    ("1.2×10³", 1200), ("25%", 25), (r"25\%", 25), ("25 percent", 25), ("42.0", 42), ("42.00", 42),
    ("forty-two", 42), ("Forty two", 42), ("a dozen", 12), ("half a dozen", 6), ("none", 0), ("zero", 0),
    ("one hundred and five", 105), ("two hundred ninety-four", 294),
    ("twenty-one thousand two hundred fifty", 21250),
    ("one and a half", Fraction(3, 2)), ("４２", 42),
])
def test_number_as_written_reads_exactly(text: str, value: Fraction) -> None:
    num = read_number(text)
    assert num is not None, text
    assert num.value == value
    assert correctness(f"<answer>{text}</answer>", {"answer": str(value)}) == 1.0


@pytest.mark.parametrize("text, values", [
    ("25%", {25, Fraction(1, 4)}), ("2100 cents", {2100, 21}), ("50¢", {50, Fraction(1, 2)}), ("42", {42}),
])
def test_a_number_can_mean_more_than_one_value(text: str, values: set) -> None:
    assert set(read_number(text).values) == values


def test_number_words_are_read_only_as_numbers() -> None:
    assert [w.value for w in find_number_words("the one I like has a lot and no more")] == [1]
    assert find_number_words("a and an") == []
    assert [w.value for w in find_number_words("one " * 20)] == []  # a run of 20 words is no number


@pytest.mark.parametrize("pred, ref, same", [
    ("0.75", "3/4", True), ("3/4", "0.75", True), ("42", "42.0", True), ("1,234", "1234", True),
    ("0.333", "1/3", False), ("8/3", "2.666666666666667", True), ("2.67", "2.666666666666667", False),
    ("25%", "25", True), ("25%", "0.25", True), ("0.25", "25", False), ("2100 cents", "21", True),
    ("6 × 7", "42", True), (r"\sqrt{16}", "4", True), ("x + 1", "1+x", True), ("B", "b", True),
    ("banana", "5", False), ("-42", "42", False), ("$42k", "42", False),
])
def test_answers_match_exactly_for_numbers_else_by_math_verify(pred: str, ref: str, same: bool) -> None:
    assert answers_match(pred, ref) is same


# ----------------------------------------------------------------------------- what is read, what is refused


QUESTION = ("A bakery sells muffins in boxes of 6. Mara buys 7 boxes for a party. "
            "How many muffins does she buy?")


@pytest.mark.parametrize("completion", [
    "<answer>42 (6 × 7)</answer>", "<answer>42, since 7 boxes hold 6 each</answer>",
    "<answer>7 × 6 = 42</answer>",
    "<answer>42 = 6 × 7</answer>", "<answer>The total is 42, which is 6 × 7.</answer>",
    "<answer>Mara buys 42 muffins.</answer>",
    "<answer>Mara buys 42 muffins in 7 boxes.</answer>",
    "<answer>She buys 7 boxes of 6, so 42 muffins.</answer>",
    "<answer>9 muffins are eaten, so she keeps 42.</answer>", "<answer>\\boxed{42}</answer>",
    "<answer>The answer is $\\boxed{42}$.</answer>", "<answer>**Answer:** 42 muffins</answer>",
    "<answer>She has 42 because 7 boxes × 6 = 42.</answer>", "<answer>(3 + 4) × 6</answer>",
    "Therefore Mara buys $\\boxed{42}$ muffins for the 7 tables.",
    "The final answer is 42. That is 7 boxes of 6.",
    "7 × 6 = 42\n#### 42", "7 * 6 = 42 muffins.", "Answer: **42**", "So the answer is \\( 42 \\).",
    "7 boxes × 6 = 42. The answer is 42.\n\nQuestion: Sam has 3 apples and eats 1. How many left?\nAnswer: 2",
    "<think>draft <answer>40</answer> no: 7 × 6 = 42</think>\nThe final answer is 42.",
    "<think>7 × 6 = 42</think><answer>42</answer>\nUser: and 8 boxes?\nAssistant: <answer>48</answer>",
    "<answer>Not 48 but 42.</answer>", "<answer>It is not 36; it is 42.</answer>",
    "<answer>42, 6 muffins in each of 7 boxes</answer>", "<answer>42 (6, 7)</answer>",
    "<answer>42, not 48</answer>",
    "<answer>Forty-two muffins (7 × 6)</answer>", "<answer>42 - she buys 7 boxes of 6</answer>",
    "<answer>3 boxes of 7, so 6 boxes hold 42</answer>", "<answer>The count went from 36 to 42.</answer>",
    "First the eggs: $\\boxed{9}$ left.\nThen the total is $7 \\times 6 = \\boxed{42}$.",
])
def test_the_announced_value_is_read(completion: str) -> None:
    assert correctness(completion, {"question": QUESTION, "answer": "42"}) == 1.0


@pytest.mark.parametrize("completion", [
    "<answer>42 or 56</answer>", "<answer>36, 42</answer>", "<answer>either 36 or 42</answer>",
    "<answer>42 (or 48 if a box holds 8)</answer>", "<answer>40-45</answer>", "<answer>40–45</answer>",
    "<answer>between 40 and 45</answer>", "<answer>40 to 45 muffins</answer>", "<answer>not 42</answer>",
    "The answer is not 42.", "If a box holds 6 the answer is \\boxed{42}; if 8, \\boxed{56}.",
    "The answer is 42 or 43.", "<answer></answer>", "<answer> </answer> 42",
    "<think>7 × 6 = 42</think><answer>",
    "<answer>-42</answer>", "<answer>$42k</answer>", "<answer>42 - 6 = 36</answer>", "<answer>6/7</answer>",
    "<think>The answer is 42.</think><answer>48</answer>", "I need more information.", "",
    "<answer>42, 48.</answer>", "<answer>36 and 42 muffins</answer>",
    "<answer>She buys 40 to 45 muffins</answer>",
    "\\boxed{40} or \\boxed{42}",
])
def test_no_credit_where_a_grader_gives_none(completion: str) -> None:
    assert correctness(completion, {"question": QUESTION, "answer": "42"}) == -1.0


def test_a_sentence_answer_is_read_past_restated_question_numbers() -> None:
    leo = "<answer>Leo earned $10 for 50 minutes of babysitting.</answer>"
    assert read_answer(leo).values == (10,)  # "for 50 minutes": the object of a preposition is no result
    zoe = "<answer>Zoe has 30 stickers after she used 12.</answer>"
    q = "Zoe has 3 sheets of 14 stickers. She uses 12 stickers. How many stickers does she have left?"
    assert read_answer(zoe, q).values == (30,)  # 12 is the question's
    assert read_answer(zoe).values == (12,)  # without the question: the last number, as the seed


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize("completion, ok", [
    ("<think>a</think><answer>1</answer>", True),
    ("<think>\nstep\n</think>\n<answer>\n42\n</answer>", True),
    ("\r\n<think>\r\na\r\n</think>\r\n\r\n<answer>1</answer>\r\n", True),
    ("\t<think>a</think>\t <answer>1</answer>\t\n", True),
    ("<think></think><answer></answer>", True),  # empty blocks: structure only
    ("<think>a</think>\u00a0<answer>1</answer>", False),  # a no-break space is not whitespace here
    ("<think>a</think>\f<answer>1</answer>", False),
    ("<think>a</think>.<answer>1</answer>", False),
    ("Sure! <think>a</think><answer>1</answer>", False),
    ("<think>a</think><answer>1</answer> Done.", False),
    ("<think>a</think><answer><answer>1</answer>", False),
    ("<think>a<answer>1</answer></think><answer>1</answer>", False),
    ("<think><think>a</think></think><answer>1</answer>", False),
    ("<think>a</think><answer>1</answer><answer>2</answer>", False),
    ("<answer>1</answer><think>a</think>", False),
    ("<think>a</think><answer>1", False),
    ("<Think>a</Think><Answer>1</Answer>", False),
    ("<answer>1</answer>", False),
    ("", False),
])
def test_format_rule(completion: str, ok: bool) -> None:
    assert well_formed(completion) is ok
    assert format_reward(completion, {}) == (1.25 if ok else -1.0)


def test_format_strict_allows_no_whitespace_and_is_a_named_option() -> None:
    assert format_strict("<think>a</think><answer>1</answer>", {}) == 1.25
    for text in ("<think>a</think>\n<answer>1</answer>", " <think>a</think><answer>1</answer>",
                 "<think>a</think><answer>1</answer>\n"):
        assert format_strict(text, {}) == -1.0 and format_reward(text, {}) == 1.25
    assert resolve("format_strict") is format_strict


# ----------------------------------------------------------------------------- how a completion ended


GOOD = "<think>7 × 6 = 42</think><answer>42</answer>"


def test_truncated_completions_get_no_credit_when_asked() -> None:
    sample = {"question": QUESTION, "answer": "42"}
    assert correctness(GOOD, {**sample, "finish_reason": "length"}) == 1.0  # the seed's default
    assert correctness(GOOD, {**sample, "finish_reason": "length"}, truncated_correct=False) == -1.0
    assert correctness(GOOD, {**sample, "finish_reason": "stop"}, truncated_correct=False) == 1.0
    assert correctness(GOOD, sample, truncated_correct=False) == 1.0  # called without a finish reason


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.slow
def test_runner_passes_truncated_correct_to_the_builtin_in_every_process(workers: int) -> None:
    samples = [{"answer": "42", "finish_reason": f} for f in ("stop", "length")]
    cfg = RewardsConfig(functions=["correctness", "format"], workers=workers, truncated_correct=False)
    with RewardRunner.from_config(cfg) as runner:  # workers=1: the worker process resolves it by name
        res = runner.score([GOOD, GOOD], samples)
    assert res.per_function["correctness"] == [1.0, -1.0]
    assert res.per_function["format"] == [1.25, 1.25]
    if workers == 0:
        with RewardRunner(["correctness"], workers=0) as runner:
            assert runner.score([GOOD, GOOD], samples).total == [1.0, 1.0]


def test_config_key_is_typed_and_documented() -> None:
    assert RewardsConfig().truncated_correct is True
    assert RewardsConfig(truncated_correct="false").truncated_correct is False
    with pytest.raises(ValueError):
        RewardsConfig(truncated_correct="sometimes")


def test_every_completion_gets_its_own_sample_dict() -> None:
    rows = [{"question": "q0", "answer": "1", "meta": {"k": 1}}, {"question": "q1", "answer": "2"}]
    samples = completion_samples(rows, 2, ["stop", "length", "length", "stop"])
    assert [s["finish_reason"] for s in samples] == ["stop", "length", "length", "stop"]
    assert [s["answer"] for s in samples] == ["1", "1", "2", "2"]
    assert len({id(s) for s in samples}) == 4 and all("finish_reason" not in r for r in rows)
    samples[0]["scratch"] = 1  # a reward writing into its sample reaches no other completion
    assert "scratch" not in samples[1] and "scratch" not in rows[0]


@pytest.mark.slow
def test_rewards_see_how_each_completion_of_a_rollout_ended() -> None:
    """A real rollout (the embedded model, its engine): each reward sees how its completion ended."""
    from nanogrpo.config import load_config
    from nanogrpo.data import load_rows
    from nanogrpo.engines.factory import make_engine
    from nanogrpo.models.load import load_policy
    from nanogrpo.rollout.collect import Collector

    cfg = load_config(preset="demo", overrides=["rewards.workers=0", "grpo.group_size=4"])
    model, tok, _ = load_policy(cfg.model)
    engine = make_engine("auto", model, tok)
    rows = load_rows(cfg.data, "train")[:6]
    specs = ["tests.reward_fixtures:cut_off", "correctness"]
    with RewardRunner(specs, workers=0, truncated_correct=False) as rewards:
        for max_new, expect_cut in ((6, True), (60, None)):
            rcfg = cfg.with_overrides({"rollout.max_new_tokens": max_new})
            _, stats = Collector(engine, tok, rewards, rcfg).collect(rows, seed=0)
            cut = stats.reward_by_function["tests.reward_fixtures:cut_off"]
            assert cut == pytest.approx(1.0 - stats.stop_rate)
            if expect_cut:
                assert cut == 1.0 and stats.accuracy == 0.0  # every completion cut off: no credit
    assert 0.0 < stats.stop_rate  # with room to finish, the warm-started model ends its answers


@pytest.mark.slow
def test_bench_rewards_reports_agreement_and_speed(tmp_path, capsys) -> None:
    import json

    from nanogrpo import bench
    from nanogrpo.bench.rewards import LATEX_DATA

    data, latex = tmp_path / "set.jsonl", tmp_path / "latex.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:5]))
    latex.write_text("".join(json.dumps(r) + "\n" for r in load_set(LATEX_DATA)[:6]))
    argv = ["rewards", "--data", str(data), "--latex", str(latex), "--repeats", "1", "--markdown"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    row = json.loads(out[-1])
    assert row["n"] == 5 and row["correctness_agreement"] == 1.0 and row["pathological_100k_worst_ms"] > 0
    assert row["correctness_rows_reaching_math_verify"] == 0
    assert row["correctness_without_math_verify_p99_ms"] > 0
    assert row["latex_n"] == 6 and row["latex_correctness_agreement"] == 1.0
    assert row["latex_categories_below_math_verify"] == []
    assert row["pathological_100k_latex_reference_worst_ms"] > 0
    assert out[0].startswith("| category |") and any(line.startswith("| **all** | 5 |") for line in out)
    assert any(line.startswith("| **all** | 6 |") for line in out)
    assert any(line.startswith("| style |") for line in out)
    assert bench.main(["rewards", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert bench.main(["rewards", "--data", str(data), "--latex", str(tmp_path / "missing.jsonl")]) == 2
