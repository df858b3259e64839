"""Competition-math answers: the built-in ``correctness`` against LaTeX references (MATH, MATH-500,
AIME), as a careful grader reads them; what must not be accepted; the plain-number fast path; time.

``tests/data/graded_latex.jsonl`` (written by ``tests/data/make_graded_latex.py``) is the labelled
set; ``python -m nanogrpo.bench.rewards --markdown`` prints its table beside math_verify alone.
"""

from __future__ import annotations

import time

import pytest

from nanogrpo.bench.rewards import LATEX_DATA, load_set, pathological
from nanogrpo.grading import verify
from nanogrpo.grading.forms import base_number, choice, words
from nanogrpo.grading.grade import final_answer, kind, reference
from nanogrpo.grading.latex import clean, final_span
from nanogrpo.rewards import correctness
from nanogrpo.rewards.builtin import warm_up

ROWS = load_set(LATEX_DATA)


def ok(completion: str, ref: str, question: str = "") -> bool:
    return correctness(completion, {"question": question, "answer": ref}) > 0


def sampled(cases: list, every: int = 4) -> list:
    """``cases`` with all but every ``every``-th one marked slow: the fast suite runs a sample, CI all."""
    slow = pytest.mark.slow
    return [c if i % every == 0 else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=slow)
            for i, c in enumerate(cases)]


# ----------------------------------------------------------------------------- the labelled set


def test_latex_set_is_what_it_claims() -> None:
    assert len(ROWS) >= 200
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    assert len({r["completion"] for r in ROWS}) == len(ROWS), "a completion appears twice"
    cats = {r["category"] for r in ROWS}
    assert len(cats) >= 20
    assert {"fraction", "interval", "solution_list", "decimal_approx", "sign", "earlier_mention"} <= cats
    assert {r["style"] for r in ROWS} == {"tags", "r1", "sentence"}
    for style in ("tags", "r1", "sentence"):
        assert sum(r["style"] == style for r in ROWS) >= 60
    assert 0.3 < sum(r["correct"] for r in ROWS) / len(ROWS) < 0.8


@pytest.mark.slow  # (over 1 s: the fast suite stays under a minute)
def test_latex_set_agreement_is_total_in_every_category() -> None:
    """Every row (a change to the plain-number path that costs this set one case fails here); the
    comparison with math_verify alone and the seed's rule, per category, is the slow bench test
    (``tests/test_rewards_grading.py``)."""
    wrong = [(r["id"], r["category"]) for r in ROWS
             if ok(r["completion"], r["reference"], r["question"]) != r["correct"]]
    assert not wrong
    assert {"unit_written", "power_on_variable", "sign_written_apart", "scale_asked", "compound_unit"} <= {
        r["category"] for r in ROWS}


# ----------------------------------------------------------------------------- right answers, as written

SIN60 = "\\frac{\\sqrt{3}}{2}"


@pytest.mark.parametrize("completion", sampled([
    "<answer>\n\\frac{\\sqrt{3}}{2}\n</answer>", "<answer>\n$\\frac{\\sqrt3}{2}$\n</answer>",
    "<answer>\\(\\dfrac{\\sqrt{3}}{2}\\)</answer>", "<answer>\n\\[\n\\frac{\\sqrt{3}}{2}\n\\]\n</answer>",
    "<answer>\nThe answer is $\\frac{\\sqrt{3}}{2}$.\n</answer>",
    "<answer>The answer is: $\\sqrt{3}/2$</answer>",
    "<answer>**\\frac{\\sqrt{3}}{2}**</answer>", "<answer>x = \\frac{\\sqrt{3}}{2}</answer>",
    "<answer>\\sin 60^\\circ = \\frac{\\sqrt{3}}{2}</answer>", "<answer>√3/2</answer>",
    "<answer>\\frac{1}{2}\\sqrt{3}</answer>", "<answer>$\\displaystyle \\frac{\\sqrt{3}}{2}$</answer>",
    "Think.\n</think>\n\n**Final Answer**\n\\[\n\\boxed{\\dfrac{\\sqrt{3}}{2}}\n\\]",
    "</think>\n\nThe value of $\\sin 60^\\circ$ is $\\boxed{\\frac{\\sqrt3}{2}}$.",
    "</think>\n\n$$\\boxed{\\frac{\\sqrt{3}}{2}}$$\n\nThis is exact.", "\\(\\boxed{\\frac{\\sqrt{3}}{2}}\\)",
    "Final Answer: The final answer is $\\frac{\\sqrt{3}}{2}$. I hope it is correct.",
    "**Final Answer**\nThe sine is $\\frac{\\sqrt{3}}{2}$.", "**Answer:** $\\frac{\\sqrt3}{2}$",
    "So the answer is $\\frac{\\sqrt{3}}{2}$", "</think>\nSo $\\sin 60^\\circ = \\frac{\\sqrt{3}}{2}$.",
    "<think>maybe $\\boxed{\\frac12}$</think>\n<answer>\\frac{\\sqrt3}{2}</answer>",
    "\\boxed{\\frac{\\sqrt{3}}{2}}\n\nHuman: and cos?\n\\boxed{\\frac12}",
]))
def test_right_answers_as_models_write_them(completion: str) -> None:
    assert ok(completion, SIN60)


@pytest.mark.parametrize("answer, ref", sampled([
    ("(2, 3)", "(2,3)"), ("\\left( 2, 3 \\right)", "(2,3)"), ("(x, y) = (2, 3)", "(2,3)"),
    ("[-1, 4)", "[-1,4)"), ("x \\in [-1, 4)", "[-1,4)"), ("\\left[-1,4\\right)", "[-1,4)"),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("(-∞, 2) ∪ (3, ∞)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("3, 2, 1", "1, 2, 3"), ("1, 2, and 3", "1, 2, 3"),
    ("x = 1, 2, 3", "1, 2, 3"), ("\\{1, 2, 3\\}", "1, 2, 3"),
    ("x=-2 \\text{ or } x=5", "-2, 5"), ("x = 5, x = -2", "-2, 5"), ("-2 \\text{ and } 5", "-2, 5"),
    ("2 \\pm \\sqrt3", "2 \\pm \\sqrt{3}"), ("2+\\sqrt{3}, 2-\\sqrt{3}", "2 \\pm \\sqrt{3}"),
    ("x^2 + 7x + 10", "x^2+7x+10"), ("1 + x", "x+1"),
    ("3\\sqrt2", "3\\sqrt{2}"), ("\\sqrt{18}", "3\\sqrt{2}"),
    ("e^{2}", "e^2"), ("\\log_2 3", "\\log_{2}3"), ("4i+3", "3+4i"), ("3 + 4i", "3+4i"),
    ("1011_2", "1011_2"), ("1011_{2}", "1011_2"), ("1011", "1011_2"), ("\\text{A3}_{16}", "A3_{16}"),
    ("y=2x+3", "y = 2x + 3"), ("2x + 3", "y = 2x + 3"), ("f(x) = 3x - 1", "3x-1"),
    ("\\text{(B)}", "\\text{(B)}"), ("\\textbf{(B)}", "\\text{(B)}"),
    ("(B)", "\\text{(B)}"), ("B", "\\text{(B)}"),
    ("\\textbf{(B) } 2187", "\\text{(B)}"), ("**(B)**", "B"), ("B) 2187", "\\textbf{(B)}"),
    ("\\begin{pmatrix}3\\\\7\\end{pmatrix}", "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}"),
    ("\\begin{bmatrix} 3 \\\\ 7 \\end{bmatrix}", "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}"),
    ("120^\\circ", "120"), ("120^{\\circ}", "120"),
    ("120°", "120"), ("30", "30^\\circ"), ("120 degrees", "120"),
    ("\\$18.90", "\\$18.90"), ("18.9", "\\$18.90"), ("$18.90", "18.90"), ("25\\%", "25\\%"), ("25", "25\\%"),
    ("1{,}000", "1000"), ("1,\\!000", "1000"), ("1\\,000", "1000"), ("1,000", "1000"),
    ("1000 \\text{ cm}^2", "1000"), ("13\\text{ units}", "13"), ("9\\pi \\text{ square units}", "9\\pi"),
    ("9\\pi square units", "9\\pi"), ("\\pi \\cdot 9", "9\\pi"), ("\\frac{9\\pi}{4}", "\\frac{9}{4}\\pi"),
    ("-\\frac12", "-\\frac{1}{2}"), ("-0.5", "-\\frac{1}{2}"),
    ("0.75", "\\frac{3}{4}"), ("3/4", "\\frac{3}{4}"),
    ("\\tfrac34", "\\frac{3}{4}"), ("\\frac{1}{8}", "0.125"), ("1.5", "\\sqrt{2.25}"), ("1024", "2^{10}"),
    ("2^{10}", "1024"), ("\\sqrt{16}", "4"),
    ("0.\\overline{3}", "\\frac{1}{3}"), ("0.1\\overline{6}", "\\frac16"),
    ("3\\frac{1}{2}", "\\frac{7}{2}"), ("\\text{odd}", "\\text{odd}"), ("odd", "\\text{odd}"),
    ("\\text{Devon}", "\\text{Devon}"), ("\\varnothing", "\\emptyset"), ("\\frac{5}{2}\\,", "\\frac{5}{2}"),
    ("\\left(\\frac{5}{2}\\right)", "\\frac{5}{2}"), ("\\mathbf{\\frac{5}{2}}", "\\frac{5}{2}"),
    ("\\dfrac{5}{2}.", "\\frac{5}{2}"), ("k = 7", "7"), ("a_n = 2n + 1", "2n+1"), ("\\infty", "\\infty"),
]))
def test_equivalent_answers_are_accepted_in_every_style(answer: str, ref: str) -> None:
    for completion in (f"<think>\nwork\n</think>\n<answer>\n{answer}\n</answer>",
                       f"work\n</think>\n\n**Final Answer**\n\\[\n\\boxed{{{answer}}}\n\\]",
                       f"<think>\nwork\n</think>\n<answer>\nThe answer is ${answer}$.\n</answer>"):
        assert ok(completion, ref), completion


@pytest.mark.parametrize("completion, ref", sampled([
    ("<answer>The area is $9\\pi$ square units.</answer>", "9\\pi"),
    ("<answer>$x = -2$ and $x = 5$</answer>", "-2, 5"),
    ("<answer>The solutions are $x=5$ or $x=-2$.</answer>", "-2, 5"),
    ("<answer>The roots are x = 2 and x = 3</answer>", "2, 3"),
    ("<answer>The domain is all $x \\geq 2$, i.e. $[2, \\infty)$.</answer>", "[2,\\infty)"),
    ("<answer>The function is odd.</answer>", "\\text{odd}"),
    ("<answer>It is neither even nor odd.</answer>", "\\text{neither}"),
    ("</think>\n\nThe solutions are $\\boxed{-2}$ and $\\boxed{5}$.", "-2, 5"),
    ("</think>\n\nThe solutions are $x = \\boxed{5}$ and $x = \\boxed{-2}$.", "-2, 5"),
    ("First $\\cos 60^\\circ = \\boxed{\\frac12}$.\n\nSo $\\cos 120^\\circ = \\boxed{-\\frac12}$.",
     "-\\frac{1}{2}"),
    ("</think>\n\nThe hypotenuse is $\\boxed{13}$ centimeters long.", "13"),
    ("</think>\n\nSo $x \\in \\boxed{[-1, 4)}$. Note that $4$ is excluded.", "[-1,4)"),
    ("$\\fbox{91}$", "91"), ("<answer>\\fbox{$2\\sqrt{2}$}</answer>", "2\\sqrt{2}"),
    ("<answer>\\boxed{(a, b) = (4, 3)}</answer>", "(4,3)"), ("<answer>\\boxed{x = 5}</answer>", "5"),
    ("Thus, the length of the diagonal is \\(\\boxed{3\\sqrt{2}}\\).", "3\\sqrt{2}"),
    ("The answer is $\\boxed{\\text{(C)}}$.", "\\text{(C)}"), ("The answer is (C).", "C"),
    ("<answer>The answer is $\\frac{1}{2}$, not $\\frac{1}{3}$.</answer>", "\\frac{1}{2}"),
    ("...\\boxed{8}? Wait.\n</think>\n\nSo there are $16$ divisors in all.", "16"),
    ("<answer>The answer is $\\frac{\\sqrt3}{2}$, not $\\frac12$.</answer>", SIN60),
    ("<answer>\\frac{1}{2} \\text{ or } 0.5</answer>", "\\frac12"), ("<answer>1/2 or 0.5</answer>", "0.5"),
    ("<answer>\\frac{\\sqrt2}{2} \\text{ or } \\frac{1}{\\sqrt2}</answer>", "\\frac{\\sqrt{2}}{2}"),
]))
def test_sentences_boxes_and_lists(completion: str, ref: str) -> None:
    assert ok(completion, ref)


# ----------------------------------------------------------------------------- wrong answers that look right


@pytest.mark.parametrize("answer, ref", sampled([
    ("\\frac{4}{3}", "\\frac{3}{4}"), ("\\frac{3}{16}", "\\frac{3}{4}"), ("\\frac{1}{2}", SIN60),
    ("-\\frac{\\sqrt3}{2}", SIN60), ("\\frac{\\sqrt{2}}{2}", SIN60),
    ("0.866", SIN60), ("0.8660254", SIN60), ("0.866025403784", SIN60),
    ("6.283185", "2\\pi"), ("3.14", "\\pi"),
    ("1.414214", "\\sqrt{2}"), ("1.585", "\\log_2 3"), ("0.333", "\\frac{1}{3}"), ("0.3333333", "\\frac13"),
    ("(3, 2)", "(2,3)"), ("[2, 3]", "(2,3)"), ("(2, -3)", "(2,3)"),
    ("(-1, 4)", "[-1,4)"), ("[-1, 4]", "[-1,4)"), ("(2, \\infty)", "[2,\\infty)"),
    ("(-\\infty, 2] \\cup [3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("(3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)"),
    ("1, 2", "1, 2, 3"), ("1, 2, 3, 6", "1, 2, 3"), ("x = 5", "-2, 5"), ("2, -5", "-2, 5"), ("5", "-2, 5"),
    ("2 + \\sqrt{3}", "2 \\pm \\sqrt{3}"), ("\\pm\\frac12", "\\frac{1}{2}"),
    ("\\frac12 \\text{ or } -\\frac12", "\\frac12"),
    ("1 \\text{ or } 7", "1"), ("x = 5 \\text{ or } x = -5", "5"), ("5, -5", "5"),
    ("6\\sqrt{2}", "3\\sqrt{2}"), ("2\\sqrt{3}", "3\\sqrt{2}"),
    ("2\\sqrt{2}", "2"), ("\\frac{\\sqrt{2}}{2}", "2"),
    ("x^2", "2"), ("2^{10}", "2"), ("2\\pi", "2"), ("3i", "3"), ("5x", "5"),
    ("x^2 + 10x + 7", "x^2+7x+10"), ("2e^2", "e^2"),
    ("\\log_3 2", "\\log_{2}3"), ("3-4i", "3+4i"), ("4+3i", "3+4i"),
    ("1101_2", "1011_2"), ("1011_3", "1011_2"), ("11", "1011_2"),
    ("60^\\circ", "120"), ("\\$19.80", "\\$18.90"),
    ("20\\%", "25\\%"), ("\\text{(A)}", "\\text{(B)}"), ("(C)", "\\text{(B)}"), ("2187", "\\text{(B)}"),
    ("\\begin{pmatrix} 7 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}"),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}"),
    ("\\text{even}", "\\text{odd}"), ("\\text{Evan}", "\\text{Devon}"),
    ("f(x) = 3x + 1", "3x-1"), ("y = 3x + 2", "y=2x+3"),
    ("", "5"), ("\\boxed{}", "5"), ("-3", "3"), ("3", "-3"), ("28.27", "9\\pi"), ("9", "9\\pi"),
]))
def test_wrong_answers_are_refused_in_every_style(answer: str, ref: str) -> None:
    for completion in (f"<think>\nwork\n</think>\n<answer>\n{answer}\n</answer>",
                       f"work\n</think>\n\n**Final Answer**\n\\[\n\\boxed{{{answer}}}\n\\]",
                       f"<think>\nwork\n</think>\n<answer>\nThe answer is ${answer}$.\n</answer>"):
        assert not ok(completion, ref), completion


@pytest.mark.parametrize("completion, ref", sampled([
    ("</think>\n\nIt is either $\\boxed{1}$ or $\\boxed{7}$.", "1"),
    ("</think>\n\nSo $\\cos 120^\\circ = \\boxed{-\\frac12}$.\n\n"
     "Check: $\\cos 60^\\circ = \\boxed{\\frac12}$.",
     "-\\frac12"),
    ("$2024 = 2^3 \\cdot 11 \\cdot 23$ gives $\\boxed{16}$. Hmm.\n</think>\n\n"
     "**Final Answer**\n\\[\n\\boxed{12}\n\\]",
     "16"),
    ("<think>The answer is $\\frac{\\sqrt3}{2}$.</think>\n<answer>\\frac{1}{2}</answer>", SIN60),
    ("<think>$\\boxed{(2,3)}$</think>\n<answer>(3, 2)</answer>", "(2,3)"),
    ("<answer>The function is even, not odd.</answer>", "\\text{odd}"),
    ("<answer>It is odd or even.</answer>", "\\text{odd}"),
    ("<answer>The answer is not $\\frac{\\sqrt3}{2}$.</answer>", SIN60),
    ("<answer>The only solution is $x = 5$.</answer>", "-2, 5"),
    ("<answer></answer> \\boxed{\\frac{\\sqrt3}{2}}", SIN60),
    ("<answer>\\boxed{}</answer>", SIN60),
    ("The sum is $5$ and the product is $\\boxed{6}$.", "5"),
    ("<answer>The answer is $\\frac{1}{2}$, not $\\frac{\\sqrt3}{2}$.</answer>", SIN60),
    ("<answer>1/2 or 0.6</answer>", "0.5"),
    ("I think the answer is $\\frac{14}{3}$, but it might be $\\frac{13}{3}$.", "\\frac{14}{3}"),
    ("<answer>\\frac{\\sqrt2}{2} \\text{ or } \\frac{1}{\\sqrt3}</answer>", "\\frac{\\sqrt2}{2}"),
]))
def test_no_credit_for_drafts_hedges_negations_and_missing_answers(completion: str, ref: str) -> None:
    assert not ok(completion, ref)


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("raw, cleaned", [
    ("$\\dfrac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}"), ("\\left( 2, 3 \\right)", "( 2, 3 )"),
    ("\\displaystyle\\frac12", "\\frac12"), ("1{,}000", "1000"), ("1,\\!000,\\!000", "1000000"),
    ("30^{\\circ}", "30"), ("\\$18.90", "18.90"), ("13 \\text{ cm}^2", "13"), ("x \\in [1, 2)", "[1, 2)"),
    ("x = 1 \\text{ or } x = 2", "1, 2"), ("a = 2, b = 3", "a = 2, b = 3"), ("f(x) = 3x - 1", "3x - 1"),
    ("\\boxed{\\textbf{7}}.", "7"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("0.\\overline{3}", "\\frac{1}{3}"), ("5\\%", "5\\%"),
])
def test_clean_takes_off_only_what_a_grader_ignores(raw: str, cleaned: str) -> None:
    assert clean(raw) == cleaned


def test_readers_of_other_kinds_of_answers() -> None:
    assert choice("\\text{(B)}") == choice("(b)") == choice("B") == choice("\\textbf{(B) }12") == "B"
    assert choice("(2,3)") is None and choice("b") is None and choice("x") is None
    assert words("\\text{Odd}") == "odd" and words("x") is None and words("\\frac12") is None
    assert base_number("1011_{2}") == ("1011", 2) and base_number("1011") is None
    assert kind("6 \\times 7") == "arithmetic" and kind("2\\sqrt{2}") == "symbolic" and kind("42") == "number"
    assert kind("She has 42 apples") == "prose" and kind("1, 2") == "symbolic" and kind("x+1") == "symbolic"
    r = reference("\\$1{,}234.50")
    assert r.values is not None and float(r.values[0]) == 1234.5


@pytest.mark.parametrize("answer, ref, right", [
    ("2 \\le x \\le 5", "[2,5]", True), ("2 \\leq x < 5", "[2, 5)", True), ("5 \\ge x > 2", "(2,5]", True),
    ("x > 3", "(3, \\infty)", True), ("3 < x", "(3,\\infty)", True),
    ("x \\leqslant -1", "(-\\infty,-1]", True),
    ("-\\frac12 < x < 3", "\\left(-\\frac{1}{2}, 3\\right)", True),
    ("[3, \\infty)", "x \\ge 3", True),  # the other way round: the reference is the inequality
    ("2 < x \\le 5", "[2,5]", False), ("x \\ge 3", "(3,\\infty)", False), ("x < 3", "(3, \\infty)", False),
    ("(3, \\infty)", "x \\ge 3", False), ("2 < x > 5", "(2,5)", False), ("x > y", "(3,\\infty)", False),
])
def test_an_inequality_is_the_interval_it_describes(answer: str, ref: str, right: bool) -> None:
    assert ok(f"The final answer is $\\boxed{{{answer}}}$.", ref) is right
    assert ok(f"<answer>The solution set is ${answer}$.</answer>", ref) is right  # in a sentence
    if "infty" in ref or "[" in ref:  # not announced: the last math of the text
        assert ok(f"Solving the inequality step by step, we get ${answer}$.", ref) is right


def test_final_span_reads_where_a_grader_looks() -> None:
    assert final_span("<answer>\n (2,3) \n</answer>").text == "(2,3)"
    assert final_span("<answer></answer>").text == ""
    assert final_span("Some thinking, no answer.") is None
    assert final_span("\\boxed{1} and \\boxed{2}").text == "1, 2"
    assert final_span("\\boxed{1}. Later, \\boxed{2}").text == "2"
    assert final_span("**Final Answer**\n\\[\n\\frac{1}{2}\n\\]").text.strip().startswith("\\[")
    assert final_answer("<answer>The answer is $\\dfrac{1}{2}$.</answer>") == "\\frac{1}{2}"
    assert final_answer("<answer>She has 42 apples.</answer>") == "42"


# ----------------------------------------------------------------------------- speed


@pytest.mark.parametrize("completion, ref", [
    ("<answer>42</answer>", "42"), ("\\boxed{1,234}", "1234"), ("<answer>She has $35 left.</answer>", "35"),
    ("<answer>\\frac{3}{4}</answer>", "0.75"),
    ("The answer is 18.50.", "\\$18.50"), ("<answer>25%</answer>", "25\\%"),
    ("\\boxed{-7}", "-7"), ("<answer>42 (6 × 7)</answer>", "42"), ("<answer>1 and 1/2</answer>", "1.5"),
])
def test_plain_numbers_never_reach_math_verify(monkeypatch, completion: str, ref: str) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("math_verify was called for a plain number")

    for name in ("equal", "region_equal", "parse_latex", "parse_region", "rational_value"):
        monkeypatch.setattr(verify, name, boom)
    assert ok(completion, ref)


@pytest.mark.parametrize("ref", sampled([SIN60, "(2,3)", "\\text{(B)}", "\\text{odd}"]))
def test_adversarial_completions_take_bounded_time_against_latex_references(ref: str) -> None:
    warm_up()  # sympy's first use of a kind of comparison costs up to a second: workers warm up before work
    ok("<answer>0</answer>", ref)  # the reference is parsed once per group, before the completions
    worst = ("", 0.0)
    for name, text in pathological():
        t0 = time.process_time()
        ok(text, ref)
        dt = time.process_time() - t0
        worst = max(worst, (name, dt), key=lambda x: x[1])
    # target 50 ms for 100k characters (bench); 10x margin here. CPU time, not wall time: other processes
    # on a shared machine stretch the wall clock, not the work a call does
    assert worst[1] < 0.5, worst


@pytest.mark.slow  # math_verify's own 1 s alarm, run out once
def test_a_verdict_that_ran_out_of_time_is_not_kept(monkeypatch) -> None:
    """math_verify timing out (on a loaded machine a normally fast parse can) costs that call its credit,
    not every later call: the verdict is not cached, and the same answer is graded right once the parse
    finishes in time. Before, the timed-out empty parse stayed cached for the run."""
    import math_verify.parser

    from nanogrpo.grading import verify as mv

    real = math_verify.parser.extract_target_from_pred
    slow = {"left": 1}

    def slowed(*a, **kw):
        if slow["left"]:
            slow["left"] -= 1
            time.sleep(1.5)  # past the alarm: math_verify's real timeout fires
        return real(*a, **kw)

    mv.clear_caches()
    monkeypatch.setattr(mv, "TIMEOUT_S", 1)
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", slowed)
    completion, ref = "<answer>\\frac{\\sqrt{3}}{2}</answer>", "\\frac{\\sqrt3}{2}"
    assert not ok(completion, ref)  # ran out of time: no credit this once
    assert slow["left"] == 0
    assert ok(completion, ref)      # asked again, in time
    mv.clear_caches()
