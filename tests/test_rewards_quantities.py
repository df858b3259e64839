"""Quantities as graders read them (issue 27): a number with a unit however it is written, signs however
they are written, scale words against the scale the question asks in, compound quantities in the unit
it asks for, and no credit for a completion the token limit cut off before it gave an answer.

Each rule is checked through the built-in ``correctness`` (what a run scores), with the question in the
sample dict as the rollout passes it, and on the pieces that implement it (:mod:`nanogrpo.grading.units`,
the number reader). Hard negatives beside each: a wrong number with a unit, a variable's power, a
subtraction, another scale, a question that names no unit.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from nanogrpo.config import RewardsConfig, load_config
from nanogrpo.grading.grade import answered
from nanogrpo.grading.latex import clean, plain_values
from nanogrpo.grading.numbers import find_number_words, find_numbers, normalize
from nanogrpo.grading.units import asked_scale, asked_unit, drop_units, unit_end
from nanogrpo.rewards import RewardRunner, correctness


def score(completion: str, ref: str, question: str = "", finish_reason: str | None = None, **kw) -> float:
    sample = {"question": question, "answer": ref}
    if finish_reason is not None:
        sample["finish_reason"] = finish_reason
    return correctness(completion, sample, **kw)


# ----------------------------------------------------------------------------- units

AREA = "A garden is 12 meters long and 8 meters wide. What is its area?"


@pytest.mark.parametrize("completion", [
    "<answer>96 m^2</answer>", "<answer>96 m²</answer>", "<answer>96m^2</answer>",
    "<answer>96 m^{2}</answer>",
    "<answer>96 sq m</answer>", "<answer>96 square meters</answer>",
    "The answer is \\boxed{96 \\text{ m}^2}.",
    "The final answer is: $\\boxed{96\\,\\mathrm{m}^2}$", "**Answer:** 96 m²",
    "<answer>96 m^2 (12 × 8)</answer>",
    "<answer>The area is $96 m^2$.</answer>", "Area = 12 m × 8 m = 96 m².", "12 × 8 = 96\n#### 96 m^2",
])
def test_a_number_with_a_square_unit_is_a_number(completion: str) -> None:
    assert score(completion, "96", AREA) == 1.0
    assert score(completion.replace("96", "86"), "96", AREA) == -1.0  # a wrong number with the same unit


@pytest.mark.parametrize("completion, ref", [
    ("<answer>45 km/h</answer>", "45"), ("\\boxed{45 \\text{ km/h}}", "45"),
    ("<answer>45 km/hr</answer>", "45"),
    ("The average speed is 45 mph.", "45"), ("<answer>45 miles per hour</answer>", "45"),
    ("<answer>$12/hour</answer>", "12"), ("<answer>\\$12/hr</answer>", "12"),
    ("<answer>$12 an hour</answer>", "12"),
    ("<answer>9.8 m/s^2</answer>", "9.8"), ("<answer>9.8 m/s²</answer>", "9.8"),
    ("<answer>30 L/min</answer>", "30"),
    ("<answer>-4°F</answer>", "-4"), ("<answer>−4 °F</answer>", "-4"), ("\\boxed{-4^\\circ \\text{F}}", "-4"),
    ("\\boxed{7^{\\circ}\\text{C}}", "7"), ("<answer>7 degrees Celsius</answer>", "7"),
    ("\\boxed{-6\\,^{\\circ}\\mathrm{C}}", "-6"), ("<answer>240 cm³</answer>", "240"),
    ("<answer>240 cubic centimeters</answer>", "240"), ("<answer>3 kW·h</answer>", "3"),
])
def test_rates_degrees_and_cubes_are_units(completion: str, ref: str) -> None:
    assert score(completion, ref) == 1.0
    assert score(completion, str(-Fraction(ref) + 1)) == -1.0


def test_what_a_unit_is() -> None:
    for rest in (" m^2", " m²", "°F", " °C", " km/h", " m/s^2", "/hour", " per hour", " an hour", " sq ft",
                 " \\text{ m}^2", " \\text{ cm}^{2}", "^\\circ", "^{\\circ}", " square units", " apples",
                 " cm^3",
                 " \\mathrm{km/h}", " kW·h", " m^{-1}", " ^\\circ C", "\\,\\text{m}^2"):
        assert unit_end(rest) == len(rest), rest
    for rest in (" x^2", " or 5", " 5", " x", " \\pi", " i", " sqrt", " million", " + 1", " \\cdot 3",
                 "^{10}"):
        assert unit_end(rest) == -1, rest
    assert drop_units("96 m^2 (12 \\times 8)") == "96 (12 \\times 8)"
    assert drop_units("12 apples") == "12 apples" and drop_units("5x + 3") == "5x + 3"


def test_latex_stays_latex() -> None:
    """A power on a variable, a root, pi, a product with a variable: never a number with a unit."""
    for text in ("5 x^2", "2\\sqrt{2}", "2\\pi", "3x", "2^{10}", "x^{2} + 1", "e^{-2}"):
        assert plain_values(text) is None, text
    assert score("<answer>3 m^2</answer>", "3m^2") == 1.0  # a monomial against a monomial
    assert score("<answer>3</answer>", "3m^2") == -1.0  # the reference 3m^2 is LaTeX, not 3 square meters
    assert score("<answer>3 m^2</answer>", "6m^2") == -1.0
    assert score("<answer>2\\sqrt{2} m</answer>", "2") == -1.0
    assert clean("13 \\text{ cm}^2") == "13" and clean("72°F") == "72" and clean("3 m^2") == "3 m^2"
    # exponents of units and variables are no numbers of their own; a number's power is
    assert [n.value for n in find_numbers("12 m^2 and x^3")] == [12]
    assert [n.value for n in find_numbers("2^{10}")] == [2, 10]


# ----------------------------------------------------------------------------- signs


@pytest.mark.parametrize("completion", [
    "<answer>- 17</answer>", "<answer>−17</answer>", "<answer>− 17 dollars</answer>", "\\boxed{- 17}",
    "The answer is $- 17$.", "The final answer is: $\\boxed{-\\,17}$", "<answer>‐17</answer>",
    "<answer>﹣17</answer>",
    "<answer>－17</answer>", "<answer>negative seventeen</answer>", "<answer>minus 17</answer>",
    "<answer>17 below zero</answer>", "<answer>seventeen degrees below zero</answer>",
    "His balance is 40 - 57 = - 17 dollars.", "<answer>x = - 17</answer>",
])
def test_every_way_a_sign_is_written(completion: str) -> None:
    assert score(completion, "-17") == 1.0
    assert score(completion, "17") == -1.0


def test_a_subtraction_is_no_sign() -> None:
    assert [n.value for n in find_numbers("57 - 17")] == [57, 17]
    assert [n.value for n in find_numbers("x - 17")] == [17]
    assert [n.value for n in find_numbers("is - 17")] == [-17]
    assert [n.value for n in find_number_words("ten minus five")] == [10, 5]
    assert [n.value for n in find_number_words("minus five")] == [-5]
    assert score("<answer>He has 57 - 40 = 17 dollars</answer>", "-17") == -1.0
    assert score("<answer>40 - 23</answer>", "17") == 1.0  # an expression, evaluated
    assert normalize("\u2212\u2010\u2011\ufe63\uff0d") == "-----"


# ----------------------------------------------------------------------------- scale words

MILLIONS = "A startup raised $1.2 million and then $3.3 million. How many millions of dollars did it raise?"
THOUSANDS = "A house cost $180,000 and rose by $70,000. What is it worth now, in thousands of dollars?"


@pytest.mark.parametrize("completion", [
    "<answer>4.5</answer>", "<answer>4.5 million</answer>", "<answer>$4.5 million</answer>",
    "**Answer:** $4.5M",
    "\\boxed{4.5 \\text{ million}}", "<answer>$4,500,000</answer>",
    "It raised 1.2 + 3.3 = 4.5 million dollars.",
])
def test_a_scale_word_is_read_in_the_scale_the_question_asks(completion: str) -> None:
    assert score(completion, "4.5", MILLIONS) == 1.0


@pytest.mark.parametrize("completion", [
    "<answer>4.5 billion</answer>", "<answer>4.5 thousand</answer>", "<answer>45 million</answer>",
    "<answer>$450,000</answer>", "\\boxed{4.5 \\text{ billion}}",
])
def test_another_scale_is_wrong(completion: str) -> None:
    assert score(completion, "4.5", MILLIONS) == -1.0


def test_scale_needs_the_question_to_ask_for_it() -> None:
    assert score("<answer>$250,000</answer>", "250", THOUSANDS) == 1.0
    assert score("<answer>250k</answer>", "250", THOUSANDS) == 1.0
    assert score("<answer>$25,000</answer>", "250", THOUSANDS) == -1.0
    # a question that mentions millions without asking in them: the amount is read as written
    plain = "A company earned $2 million and spent $500,000. How many dollars are left?"
    assert score("<answer>1.5 million</answer>", "1500000", plain) == 1.0
    assert score("<answer>1.5 million</answer>", "1.5", plain) == -1.0
    assert score("<answer>1.5 million</answer>", "1.5") == -1.0  # no question, no scale
    assert asked_scale(MILLIONS) == 10**6 and asked_scale(THOUSANDS) == 10**3
    assert asked_scale("How many thousand tickets were sold?") == 10**3 and asked_scale(plain) is None


# ----------------------------------------------------------------------------- compound quantities

MINUTES = "Lena's flight lasts 2 hours and her layover 30 minutes. How many minutes does the trip take?"
HOURS = "Tom swims for 90 minutes and runs for 1 hour. How many hours does he exercise?"
INCHES = "Sam is 4 feet 10 inches tall and grows 8 inches. How tall is he now, in inches?"
CENTS = "A pen costs $1.25 and a notebook $2. How much do both cost, in cents?"
NO_UNIT = "Lena's flight lasts 2 hours and her layover 30 minutes. How long does the trip take?"


@pytest.mark.parametrize("completion, ref, question", [
    ("<answer>2 hours and 30 minutes</answer>", "150", MINUTES),
    ("\\boxed{2 \\text{ hours } 30 \\text{ minutes}}", "150", MINUTES),
    ("The trip takes 2 hours and 30 minutes in all.", "150", MINUTES),
    ("**Answer:** 2 h 30 min", "150", MINUTES),
    ("<answer>2h30m</answer>", "150", MINUTES), ("<answer>2 hours and 30 minutes</answer>", "2.5", HOURS),
    ("He exercises 1 hour 30 minutes + 1 hour = 2 hours 30 minutes.", "2.5", HOURS),
    ("<answer>5 feet 6 inches</answer>", "66", INCHES), ("<answer>5'6\"</answer>", "66", INCHES),
    ("He is now 5 ft 6 in tall.", "66", INCHES), ("<answer>$3 and 25 cents</answer>", "325", CENTS),
    ("<answer>3 dollars and 25 cents</answer>", "325", CENTS),
    # money is read in dollars when the question names no unit
    ("<answer>3 dollars and 25 cents</answer>", "3.25", "How much do both cost?"),
])
def test_a_compound_quantity_is_read_in_the_unit_the_question_asks(completion: str, ref: str,
                                                                    question: str) -> None:
    assert score(completion, ref, question) == 1.0


@pytest.mark.parametrize("completion, ref, question", [
    ("<answer>2 hours and 30 minutes</answer>", "2.5", MINUTES),  # read in minutes, it is 150
    ("<answer>2 hours and 30 minutes</answer>", "150", HOURS),
    ("<answer>2 hours and 50 minutes</answer>", "150", MINUTES),
    ("<answer>5 feet 8 inches</answer>", "66", INCHES),
    ("<answer>5 feet 6 inches</answer>", "5.6", INCHES), ("<answer>$3.25</answer>", "325", CENTS),
    ("<answer>2 hours and 30 minutes</answer>", "150", NO_UNIT),  # the question cannot decide: stricter
    ("<answer>2 hours and 30 minutes</answer>", "2.5", NO_UNIT),
    ("<answer>2 hours and 30 minutes</answer>", "150", ""),
])
def test_a_compound_quantity_gets_no_other_reading(completion: str, ref: str, question: str) -> None:
    assert score(completion, ref, question) == -1.0


def test_what_the_question_asks_in() -> None:
    assert asked_unit(MINUTES, "time") == 60 and asked_unit(HOURS, "time") == 3600
    assert asked_unit(INCHES, "length") == 1 and asked_unit(CENTS, "money") == 1
    assert asked_unit(NO_UNIT, "time") is None and asked_unit(None, "time") is None
    assert asked_unit("He ran 3 miles. How long did it take? Answer in whole minutes.", "time") == 60
    # an instruction about the answer's unit outranks the units the question names
    assert asked_unit("Max ran 95 minutes. How many hours and minutes is that? Give the answer in minutes.",
                      "time") == 60
    # units named earlier in the question are not what it asks for
    assert asked_unit("A 2-hour film. How many minutes of it are left after 45 minutes?", "time") == 60
    assert [(n.value, n.measure) for n in find_numbers("3 apples and 4 pears")] == [(3, None), (4, None)]
    assert [n.value for n in find_numbers("5 hours, 3 days")] == [5, 3]  # a larger unit second: two of them


# ----------------------------------------------------------------------------- fractions in words

@pytest.mark.parametrize("completion, ref", [
    ("two thirds", "\\frac{2}{3}"), ("two-thirds", "2/3"), ("three fourths", "0.75"), ("a quarter", "0.25"),
    ("one half", "0.5"), ("a third", "1/3"), ("one and a half", "1.5"), ("two and one half", "2.5"),
    ("three and two thirds", "11/3"), ("a dozen and a half", "12.5"), ("twenty-one hundredths", "0.21"),
    ("2 thirds", "2/3"), ("7 tenths", "0.7"), ("negative two thirds", "-2/3"),
    ("three quarters", "0.75"), ("three quarters", "3"),  # a fraction, or three coins
    ("It is 3 fifths of the class.", "0.6"),
])
def test_a_fraction_in_words_is_its_value(completion: str, ref: str) -> None:
    assert score(f"<answer>{completion}</answer>", ref) == 1.0


@pytest.mark.parametrize("completion, ref", [
    ("two thirds", "2"), ("three-fourths", "3"), ("one fifth", "1"), ("2 thirds", "2"),  # read as before
    ("one half", "1.5"), ("three fourth", "0.75"),
])
def test_a_fraction_in_words_is_not_its_numerator(completion: str, ref: str) -> None:
    assert score(f"<answer>{completion}</answer>", ref) == -1.0


def test_an_ordinal_is_no_fraction() -> None:
    assert [n.values for n in find_number_words("the twenty-fifth day")] == [(20,)]  # not 20/5
    assert score("<answer>5 fourth-graders</answer>", "5") == 1.0
    assert score("<answer>5 fifth graders</answer>", "5") == 1.0
    assert score("<answer>On his third try he scored 5.</answer>", "5") == 1.0
    assert [n.values for n in find_number_words("half a dozen, half")] == [(6,), (Fraction(1, 2),)]


# ----------------------------------------------------------------------------- times of day

TRAIN = "A train leaves at 6:15 PM and the trip takes 2 hours and 15 minutes. When does it arrive?"


@pytest.mark.parametrize("completion", [
    "<answer>8:30 PM</answer>", "<answer>8:30 pm</answer>", "<answer>8:30pm</answer>",
    "<answer>8:30 p.m.</answer>", "<answer>8:30 P.M.</answer>", "<answer>20:30</answer>",
    "<answer>It arrives at 8:30 p.m.</answer>", "The answer is $\\boxed{\\text{8:30 PM}}$.",
    "<answer>8:30</answer>",  # the 12-hour clock: the question says which half of the day
])
def test_a_time_of_day_however_written(completion: str) -> None:
    assert score(completion, "8:30 PM", TRAIN) == 1.0


@pytest.mark.parametrize("completion", [
    "<answer>8:30 AM</answer>", "<answer>9:30 PM</answer>", "<answer>830</answer>",
    "<answer>8:03 PM</answer>",
    "<answer>8</answer>",  # a number, not a time
    "<answer>It leaves at 6:15 PM and arrives at 8:30 PM</answer>",  # two times: which is the answer?
    "<answer>8:30 AM or 8:30 PM</answer>",
])
def test_another_time_or_no_single_time_is_wrong(completion: str) -> None:
    assert score(completion, "8:30 PM", TRAIN) == -1.0


def test_what_a_time_is() -> None:
    from nanogrpo.grading.forms import clock, same_time

    assert clock("8 p.m.") == (8, 0, "pm") and clock("7 o'clock") == (7, 0, None)
    assert clock("\\text{12:05 a.m.}") == (12, 5, "am") and clock("20:30") == (20, 30, None)
    assert clock("8") is None and clock("3:2") is None and clock("13:00 PM") is None  # a number, a ratio
    assert same_time((12, 15, "am"), (0, 15, None)) and not same_time((12, 15, "am"), (12, 15, "pm"))
    assert score("<answer>3:2</answer>", "3:2") == 1.0 and score("<answer>1.5</answer>", "3:2") == 1.0
    assert score("<answer>8:30 PM</answer>", "8:30") == 1.0  # a reference that names no half of the day


# ----------------------------------------------------------------------------- no answer, no credit

EGGS = ("Janet's ducks lay 16 eggs. She eats 3 and bakes with 4, and sells the rest at $2 each. "
        "How much does she make?")
CUT = [
    "<think>\n16 - 3 - 4 = 9 eggs, 9 × 2 = 18. Wait, let me re-read the question about the 18",
    "Okay, so 16 minus 7 is 9, and 9 times 2 is 18. Hmm, but is it 18",
    "## Step 1: Eggs left\n16 - 3 - 4 = 9\n\n## Step 2: Money\n9 * 2 = 18",
    "<think>\nThe answer is 18. Let me double check: 9 × 2 = 18",  # announced, but inside open reasoning
]
ANSWERED = [
    "<think>\n9 × 2 = 18\n</think>\n<answer>\n18\n</answer>\nLet me also explain",
    "9 × 2 = 18\n\nThe final answer is: $\\boxed{18}$\n\n## Step 3: Verify\n2 × 9 = 1",
    "9 × 2 = 18.\n\n**Answer:** 18\n\n**Explanation:** Multiplying",
    "<think>\n9 × 2 = 18\n</think>\n<answer>\n18",
]


@pytest.mark.parametrize("completion", CUT)
def test_a_cut_off_completion_without_an_answer_gets_no_credit(completion: str) -> None:
    assert not answered(completion)
    assert score(completion, "18", EGGS, "length") == -1.0  # its last number is the reference
    assert score(completion, "18", EGGS, "length", truncated_last_number=True) == 1.0  # the seed's reading
    assert score(completion, "18", EGGS, "stop") == 1.0  # a completion that ended by itself is read as before
    assert score(completion, "18", EGGS) == 1.0  # called without a finish reason


@pytest.mark.parametrize("completion", ANSWERED)
def test_a_cut_off_completion_with_an_answer_is_read(completion: str) -> None:
    assert answered(completion)
    assert score(completion, "18", EGGS, "length") == 1.0
    assert score(completion, "17", EGGS, "length") == -1.0
    assert score(completion, "18", EGGS, "length", truncated_correct=False) == -1.0  # DAPO's filter: none


def test_the_parity_key_is_typed_documented_and_reaches_every_process() -> None:
    assert RewardsConfig().truncated_last_number is False
    assert load_config(overrides=["rewards.truncated_last_number=true"]).rewards.truncated_last_number is True
    with pytest.raises(ValueError):
        RewardsConfig(truncated_last_number="sometimes")
    assert "seed" in _key_doc("truncated_last_number")  # the docstring under the key says what it is for
    samples = [{"question": EGGS, "answer": "18", "finish_reason": "length"}] * 2
    for parity in (False, True):
        cfg = RewardsConfig(functions=["correctness"], workers=0, truncated_last_number=parity)
        with RewardRunner.from_config(cfg) as runner:
            got = runner.score([CUT[0], ANSWERED[0]], samples).per_function["correctness"]
        assert got == ([1.0, 1.0] if parity else [-1.0, 1.0])


def _key_doc(name: str) -> str:
    """The docstring under a ``[rewards]`` key, as the config reference reads it."""
    import inspect

    from nanogrpo.config import rewards

    return inspect.getsource(rewards).split(f"    {name}:", 1)[1].split('"""')[1]


@pytest.mark.slow
def test_the_parity_key_reaches_reward_worker_processes() -> None:
    samples = [{"question": EGGS, "answer": "18", "finish_reason": "length"}] * 2
    for parity in (False, True):
        cfg = RewardsConfig(functions=["correctness", "format"], workers=1, truncated_last_number=parity)
        with RewardRunner.from_config(cfg) as runner:
            got = runner.score([CUT[0], ANSWERED[0]], samples).per_function["correctness"]
        assert got == ([1.0, 1.0] if parity else [-1.0, 1.0])


def test_the_question_reaches_the_grader_through_the_runner() -> None:
    """The sample dict carries the row's question to ``correctness``: the unit it asks in decides."""
    rows = [{"question": MINUTES, "answer": "150"}, {"question": HOURS, "answer": "150"}]
    with RewardRunner(["correctness"], workers=0) as runner:
        got = runner.score(["<answer>2 hours and 30 minutes</answer>"] * 2, rows).total
    assert got == [1.0, -1.0]


# ----------------------------------------------------------------------------- the guide's examples


def test_the_grading_guide_examples_work(tmp_path) -> None:
    """Every Python and TOML block of ``docs/guides/grading.md`` runs as written."""
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parents[1] / "docs" / "guides" / "grading.md"
    text = guide.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) >= 5
    for block in blocks:
        exec(compile(block, "docs/guides/grading.md", "exec"), {})  # noqa: S102 - our own docs
    (toml,) = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    (tmp_path / "c.toml").write_text(toml, encoding="utf-8")
    assert load_config(tmp_path / "c.toml").rewards.truncated_last_number is True
