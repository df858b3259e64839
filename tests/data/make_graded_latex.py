"""Write ``graded_latex.jsonl``: competition-math (MATH / AIME style) final answers, labelled by hand.

    python tests/data/make_graded_latex.py          # rewrites tests/data/graded_latex.jsonl

Each item below is one final answer as a model writes it, with the question, the reference as the
dataset writes it (MATH's boxed answer, MATH-500's ``answer`` column, AIME's integer) and a human
label: would a careful competition grader accept it? Every item is rendered in the three ways
models write a final answer:

- ``tags``: bare inside ``<answer>`` tags, Qwen-style newlines (the seed's think/answer prompt);
- ``r1``: R1-distill style, no answer tags, ``\\boxed{}`` after the reasoning (under "**Final
  Answer**", or in a closing sentence, inside ``\\[…\\]`` / ``$$…$$`` / ``$…$`` or bare);
- ``sentence``: a sentence inside the tags, "The answer is $…$.".

The reasoning before the answer (``{ans}`` in it is the written answer) is written so that a
wrong answer comes from wrong reasoning, except in ``earlier_mention``, where the reference
appears in the reasoning but the final answer is another value (and the reverse). ``SPECIAL``
holds whole completions written by hand for what templates cannot show: boxes inside ``$$``,
``\\fbox``, text after the box, several boxes, drafts in the think block, hedges.

The labels were written with the items, before nanogrpo's reader was run on them; the set was
written by the engineer who wrote the reader: read it as a regression set, not a blind test.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("graded_latex.jsonl")

SIN60 = "Compute $\\sin 60^\\circ$."
T_SIN60 = ("The point at $60^\\circ$ on the unit circle comes from a 30-60-90 triangle with hypotenuse $1$: "
           "the short leg is $\\frac{1}{2}$ and the long leg is $\\frac{\\sqrt{3}}{2}$.\nSo $\\sin 60^\\circ = {ans}$.")
T_SIN60_WRONG = ("The point at $60^\\circ$ on the unit circle has $x$-coordinate $\\frac12$.\n"
                 "So $\\sin 60^\\circ = {ans}$.")

# (category, question, reference, written answer, correct?, reasoning)
ITEMS: list[tuple[str, str, str, str, bool, str]] = [
    # ------------------------------------------------------------------ radicals in fractions
    ("radical_fraction", SIN60, "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True, T_SIN60),
    ("radical_fraction", SIN60, "\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}", True, T_SIN60),
    ("radical_fraction", SIN60, "\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2", True, T_SIN60),
    ("radical_fraction", SIN60, "\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}", False, T_SIN60_WRONG),
    ("radical_fraction", "Rationalize the denominator of $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}",
     "\\frac{\\sqrt2}2", True, "Multiply top and bottom by $\\sqrt{2}$: $\\frac{\\sqrt2}{2}$. So the result is ${ans}$."),
    ("radical_fraction", "Rationalize the denominator of $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}",
     "\\frac{1}{2}\\sqrt{2}", True, "Multiply top and bottom by $\\sqrt{2}$ to get ${ans}$."),
    ("radical_fraction", "Rationalize the denominator of $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}",
     "\\frac{\\sqrt{2}}{4}", False, "Multiply by $\\frac{\\sqrt2}{\\sqrt2}$; the denominator becomes $4$, so ${ans}$."),
    # ------------------------------------------------------------------ fractions the wrong way up
    ("fraction", "What is $\\frac{3}{8} \\div \\frac{1}{2}$?", "\\frac{3}{4}", "\\frac{4}{3}", False,
     "Dividing flips the first fraction: $\\frac{8}{3} \\cdot \\frac{1}{2} = {ans}$."),
    ("fraction", "What is $\\frac{3}{8} \\div \\frac{1}{2}$?", "\\frac{3}{4}", "0.75", True,
     "$\\frac{3}{8} \\cdot 2 = \\frac{6}{8} = {ans}$."),
    ("fraction", "What is $\\frac{3}{8} \\div \\frac{1}{2}$?", "\\frac{3}{4}", "\\tfrac34", True,
     "$\\frac{3}{8} \\cdot \\frac{2}{1} = \\frac{6}{8}$, which reduces to ${ans}$."),
    ("fraction", "What is $\\frac{3}{8} \\div \\frac{1}{2}$?", "\\frac{3}{4}", "3/4", True,
     "Multiply by the reciprocal: $\\frac{3}{8} \\times 2 = {ans}$."),
    ("fraction", "What is $\\frac{3}{8} \\div \\frac{1}{2}$?", "\\frac{3}{4}", "\\frac{3}{16}", False,
     "$\\frac{3}{8} \\cdot \\frac{1}{2} = {ans}$."),
    # ------------------------------------------------------------------ radicals
    ("radical", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "3\\sqrt2", True, "The diagonal is $\\sqrt{3^2 + 3^2} = \\sqrt{18} = {ans}$."),
    ("radical", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "\\sqrt{18}", True, "By Pythagoras the diagonal is $\\sqrt{9 + 9} = {ans}$."),
    ("radical", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "3 \\sqrt{2}", True, "The diagonal of a square of side $s$ is $s\\sqrt{2}$, here ${ans}$."),
    ("radical", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "6 \\sqrt{2}", False, "The diagonal is $2 \\cdot 3 \\cdot \\sqrt{2} = {ans}$."),
    ("radical", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "2\\sqrt{3}", False, "The diagonal is $\\sqrt{3 + 9} = \\sqrt{12} = {ans}$."),
    # ------------------------------------------------------------------ decimals for exact values
    ("decimal_approx", SIN60, "\\frac{\\sqrt{3}}{2}", "0.866", False,
     "$\\sin 60^\\circ = \\frac{\\sqrt3}{2} \\approx {ans}$."),
    ("decimal_approx", SIN60, "\\frac{\\sqrt{3}}{2}", "0.8660254", False,
     "$\\sqrt{3} \\approx 1.7320508$, so $\\sin 60^\\circ \\approx {ans}$."),
    ("decimal_approx", "What is the circumference of a circle of radius $1$?", "2\\pi", "6.28", False,
     "$C = 2\\pi r = 2\\pi \\approx {ans}$."),
    ("decimal_approx", "What is the circumference of a circle of radius $1$?", "2\\pi", "6.283185", False,
     "$C = 2 \\pi r$ with $r = 1$, about ${ans}$."),
    ("decimal_approx", "What is the circumference of a circle of radius $1$?", "2\\pi", "2\\pi", True,
     "$C = 2\\pi r = {ans}$."),
    ("decimal_approx", "Simplify $\\sqrt{8}$.", "2\\sqrt{2}", "2.828427", False,
     "$\\sqrt{8} = \\sqrt{4 \\cdot 2}$, numerically ${ans}$."),
    ("decimal_approx", "What is $1 \\div 3$? Express your answer as a common fraction.", "\\frac{1}{3}",
     "0.333", False, "One third is about ${ans}$."),
    ("decimal_approx", "What is $1 \\div 8$?", "0.125", "\\frac{1}{8}", True,
     "$1 \\div 8 = 0.125$, that is ${ans}$."),
    ("decimal_approx", "Write $\\frac{5}{8}$ as a decimal.", "0.625", "0.625", True,
     "$5 \\div 8 = {ans}$."),
    # ------------------------------------------------------------------ ordered pairs
    ("tuple", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)", "(2, 3)", True,
     "Set $x + 1 = 5 - x$, so $x = 2$ and $y = 3$: the point is ${ans}$."),
    ("tuple", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)",
     "\\left( 2, 3 \\right)", True, "$2x = 4$, $x = 2$, $y = 3$. The point is ${ans}$."),
    ("tuple", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)", "(3,2)", False,
     "$x + 1 = 5 - x$ gives $x = 2$; then the point is ${ans}$."),
    ("tuple", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)", "(2,-3)", False,
     "$x = 2$ and $y = 5 - 2$... so ${ans}$."),
    ("tuple", "Find the ordered pair $(a, b)$ with $a + b = 7$ and $a - b = 1$.", "(4,3)", "(a,b)=(4,3)", True,
     "Adding, $2a = 8$, so $a = 4$ and $b = 3$."),
    # ------------------------------------------------------------------ intervals: open vs closed
    ("interval", "Solve $-3 \\le 2x - 1 < 7$. Express your answer in interval notation.", "[-1,4)",
     "[-1, 4)", True, "Add $1$: $-2 \\le 2x < 8$; halve: $-1 \\le x < 4$, i.e. ${ans}$."),
    ("interval", "Solve $-3 \\le 2x - 1 < 7$. Express your answer in interval notation.", "[-1,4)",
     "x \\in [-1,4)", True, "$-2 \\le 2x < 8$ so $-1 \\le x < 4$."),
    ("interval", "Solve $-3 \\le 2x - 1 < 7$. Express your answer in interval notation.", "[-1,4)",
     "(-1,4)", False, "$-1 < x < 4$, so ${ans}$."),
    ("interval", "Solve $-3 \\le 2x - 1 < 7$. Express your answer in interval notation.", "[-1,4)",
     "[-1,4]", False, "$-1 \\le x \\le 4$, so ${ans}$."),
    ("interval", "Find the domain of $\\sqrt{x - 2}$.", "[2,\\infty)", "[2, \\infty)", True,
     "We need $x - 2 \\ge 0$, so $x \\ge 2$: ${ans}$."),
    ("interval", "Find the domain of $\\sqrt{x - 2}$.", "[2,\\infty)", "(2, \\infty)", False,
     "We need $x - 2 > 0$: ${ans}$."),
    # ------------------------------------------------------------------ unions with infinity
    ("union_infinity", "Solve $(x-2)(x-3) > 0$. Give your answer in interval notation.",
     "(-\\infty,2)\\cup(3,\\infty)", "(-\\infty, 2) \\cup (3, \\infty)", True,
     "The product is positive outside the roots $2$ and $3$: ${ans}$."),
    ("union_infinity", "Solve $(x-2)(x-3) > 0$. Give your answer in interval notation.",
     "(-\\infty,2)\\cup(3,\\infty)", "\\left(-\\infty,2\\right)\\cup\\left(3,\\infty\\right)", True,
     "Sign chart: $+$, $-$, $+$. So ${ans}$."),
    ("union_infinity", "Solve $(x-2)(x-3) > 0$. Give your answer in interval notation.",
     "(-\\infty,2)\\cup(3,\\infty)", "(-\\infty,2]\\cup[3,\\infty)", False,
     "Outside the roots, roots included: ${ans}$."),
    ("union_infinity", "Solve $(x-2)(x-3) > 0$. Give your answer in interval notation.",
     "(-\\infty,2)\\cup(3,\\infty)", "(3, \\infty)", False, "For $x > 3$ both factors are positive: ${ans}$."),
    # ------------------------------------------------------------------ lists of solutions
    ("solution_list", "Find all roots of $x^3 - 6x^2 + 11x - 6 = 0$.", "1, 2, 3", "3, 2, 1", True,
     "$x = 1$ is a root; dividing gives $x^2 - 5x + 6 = (x-2)(x-3)$. Roots: ${ans}$."),
    ("solution_list", "Find all roots of $x^3 - 6x^2 + 11x - 6 = 0$.", "1, 2, 3", "1,2,3", True,
     "$(x-1)(x-2)(x-3) = 0$, so ${ans}$."),
    ("solution_list", "Find all roots of $x^3 - 6x^2 + 11x - 6 = 0$.", "1, 2, 3", "1, 2", False,
     "$x = 1$ and $x = 2$ work; so ${ans}$."),
    ("solution_list", "Find all roots of $x^3 - 6x^2 + 11x - 6 = 0$.", "1, 2, 3", "1, 2, 3, 6", False,
     "Candidates $\\pm1, \\pm2, \\pm3, \\pm6$; the roots are ${ans}$."),
    ("solution_list", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5", "x=-2 \\text{ or } x=5", True,
     "$(x - 5)(x + 2) = 0$."),
    ("solution_list", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5", "5, -2", True,
     "Factor: $(x-5)(x+2)$, so ${ans}$."),
    ("solution_list", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5", "x = 5", False,
     "$x^2 - 3x = 10$, and $25 - 15 = 10$, so ${ans}$."),
    ("solution_list", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5", "2, -5", False,
     "$(x - 2)(x + 5)$... roots ${ans}$."),
    # ------------------------------------------------------------------ plus or minus
    ("plus_minus", "Find the roots of $x^2 - 4x + 1 = 0$.", "2 \\pm \\sqrt{3}", "2+\\sqrt{3}, 2-\\sqrt{3}", True,
     "$x = \\frac{4 \\pm \\sqrt{12}}{2} = 2 \\pm \\sqrt{3}$."),
    ("plus_minus", "Find the roots of $x^2 - 4x + 1 = 0$.", "2 \\pm \\sqrt{3}", "2 \\pm \\sqrt3", True,
     "Quadratic formula: $\\frac{4 \\pm \\sqrt{16 - 4}}{2} = {ans}$."),
    ("plus_minus", "Find the roots of $x^2 - 4x + 1 = 0$.", "2 \\pm \\sqrt{3}", "2+\\sqrt{3}", False,
     "Taking the positive root: ${ans}$."),
    ("plus_minus", "Find the roots of $x^2 - 4x + 1 = 0$.", "2 \\pm \\sqrt{3}", "4 \\pm \\sqrt{3}", False,
     "$x = 4 \\pm \\sqrt{3}$ after simplifying."),
    # ------------------------------------------------------------------ polynomials
    ("polynomial", "Expand $(x+2)(x+5)$.", "x^2+7x+10", "x^2 + 7x + 10", True,
     "FOIL: $x^2 + 5x + 2x + 10 = {ans}$."),
    ("polynomial", "Expand $(x+2)(x+5)$.", "x^2+7x+10", "x^2+7x+10", True, "$x^2 + (2+5)x + 2 \\cdot 5 = {ans}$."),
    ("polynomial", "Expand $(x+2)(x+5)$.", "x^2+7x+10", "x^2 + 10x + 7", False,
     "$x^2 + 2 \\cdot 5 x + (2 + 5) = {ans}$."),
    ("polynomial", "Expand $(x+2)(x+5)$.", "x^2+7x+10", "x^2+7x+7", False, "$x^2 + 7x + 7$."),
    ("polynomial", "Simplify $\\frac{x^2 - 1}{x - 1}$ for $x \\ne 1$.", "x+1", "1 + x", True,
     "$x^2 - 1 = (x-1)(x+1)$, cancel: ${ans}$."),
    ("polynomial", "Simplify $\\frac{x^2 - 1}{x - 1}$ for $x \\ne 1$.", "x+1", "x - 1", False,
     "Cancel $x - 1$... ${ans}$."),
    # ------------------------------------------------------------------ equations and functions
    ("equation", "Find the equation of the line with slope $2$ through $(0,3)$, in the form $y = mx + b$.",
     "y = 2x + 3", "y=2x+3", True, "$m = 2$, $b = 3$: ${ans}$."),
    ("equation", "Find the equation of the line with slope $2$ through $(0,3)$, in the form $y = mx + b$.",
     "y = 2x + 3", "2x + 3", True, "$y$ is $2x + 3$."),
    ("equation", "Find the equation of the line with slope $2$ through $(0,3)$, in the form $y = mx + b$.",
     "y = 2x + 3", "y = 3x + 2", False, "Slope and intercept: ${ans}$."),
    ("equation", "The linear function $f$ has $f(0) = -1$ and $f(1) = 2$. Find $f(x)$.", "3x-1",
     "f(x) = 3x - 1", True, "The slope is $2 - (-1) = 3$ and the intercept $-1$."),
    ("equation", "The linear function $f$ has $f(0) = -1$ and $f(1) = 2$. Find $f(x)$.", "3x-1",
     "3x - 1", True, "Slope $3$, intercept $-1$: ${ans}$."),
    ("equation", "The linear function $f$ has $f(0) = -1$ and $f(1) = 2$. Find $f(x)$.", "3x-1",
     "f(x) = 3x + 1", False, "Slope $3$, and $f(0) = 1$... ${ans}$."),
    # ------------------------------------------------------------------ e, logs, powers
    ("exp_log", "Simplify $\\frac{e^{\\ln 2 + 2}}{2}$.", "e^2", "e^2", True,
     "$e^{\\ln 2 + 2} = 2e^2$; halve it: ${ans}$."),
    ("exp_log", "Simplify $\\frac{e^{\\ln 2 + 2}}{2}$.", "e^2", "e^{2}", True, "$\\frac{2 e^2}{2} = {ans}$."),
    ("exp_log", "Simplify $\\frac{e^{\\ln 2 + 2}}{2}$.", "e^2", "2e^2", False, "$e^{\\ln 2} e^2 = {ans}$."),
    ("exp_log", "Write $\\frac{\\ln 3}{\\ln 2}$ as a single logarithm.", "\\log_{2}3", "\\log_2 3", True,
     "Change of base: $\\frac{\\ln 3}{\\ln 2} = {ans}$."),
    ("exp_log", "Write $\\frac{\\ln 3}{\\ln 2}$ as a single logarithm.", "\\log_{2}3", "\\log_{2} 3", True,
     "By the change-of-base formula, ${ans}$."),
    ("exp_log", "Write $\\frac{\\ln 3}{\\ln 2}$ as a single logarithm.", "\\log_{2}3", "\\log_3 2", False,
     "$\\frac{\\ln 3}{\\ln 2}$ is ${ans}$."),
    # ------------------------------------------------------------------ complex numbers
    ("complex", "Compute $(2+i)^2$.", "3+4i", "4i+3", True, "$(2+i)^2 = 4 + 4i + i^2 = {ans}$."),
    ("complex", "Compute $(2+i)^2$.", "3+4i", "3 + 4i", True, "$4 + 4i - 1 = {ans}$."),
    ("complex", "Compute $(2+i)^2$.", "3+4i", "3-4i", False, "$4 - 4i + i^2 = {ans}$."),
    ("complex", "Compute $(2+i)^2$.", "3+4i", "4+3i", False, "$(2+i)(2+i) = {ans}$."),
    ("complex", "Compute $(2+i)^2$.", "3+4i", "5+4i", False, "$4 + 4i + 1 = {ans}$."),
    # ------------------------------------------------------------------ other bases
    ("base", "Express $11_{10}$ in base $2$.", "1011_2", "1011_2", True,
     "$11 = 8 + 2 + 1$, so ${ans}$."),
    ("base", "Express $11_{10}$ in base $2$.", "1011_2", "1011_{2}", True, "$11 = 1 \\cdot 8 + 0 \\cdot 4 + 1 \\cdot 2 + 1$."),
    ("base", "Express $11_{10}$ in base $2$.", "1011_2", "1011", True, "Repeated halving gives ${ans}$."),
    ("base", "Express $11_{10}$ in base $2$.", "1011_2", "1101_2", False, "$11 = 8 + 4 + 1$... ${ans}$."),
    ("base", "Express $11_{10}$ in base $2$.", "1011_2", "1011_3", False, "In base three: ${ans}$."),
    # ------------------------------------------------------------------ degrees
    ("degrees", "How many degrees are in each interior angle of a regular hexagon?", "120",
     "120^\\circ", True, "The angles sum to $180^\\circ \\cdot 4 = 720^\\circ$; each is ${ans}$."),
    ("degrees", "How many degrees are in each interior angle of a regular hexagon?", "120",
     "120^{\\circ}", True, "$\\frac{(6-2) \\cdot 180^\\circ}{6} = {ans}$."),
    ("degrees", "How many degrees are in each interior angle of a regular hexagon?", "120", "120°", True,
     "$720 / 6 = 120$."),
    ("degrees", "How many degrees are in each interior angle of a regular hexagon?", "120",
     "60^\\circ", False, "Each exterior angle is $60^\\circ$, so ${ans}$."),
    ("degrees", "What is the smallest angle of a $30$-$60$-$90$ triangle?", "30^\\circ", "30", True,
     "The angles are $30^\\circ$, $60^\\circ$ and $90^\\circ$."),
    ("degrees", "What is the smallest angle of a $30$-$60$-$90$ triangle?", "30^\\circ", "60^\\circ", False,
     "The middle angle is ${ans}$."),
    # ------------------------------------------------------------------ money and percent
    ("money_percent", "Three notebooks cost $\\$6.30$. How much do nine notebooks cost?", "\\$18.90",
     "\\$18.90", True, "One notebook costs $\\$2.10$; nine cost $9 \\times 2.10 = 18.90$."),
    ("money_percent", "Three notebooks cost $\\$6.30$. How much do nine notebooks cost?", "\\$18.90",
     "18.90", True, "Nine is three times three, so $3 \\times 6.30 = {ans}$."),
    ("money_percent", "Three notebooks cost $\\$6.30$. How much do nine notebooks cost?", "\\$18.90",
     "\\$18.9", True, "$3 \\cdot \\$6.30 = {ans}$."),
    ("money_percent", "Three notebooks cost $\\$6.30$. How much do nine notebooks cost?", "\\$18.90",
     "\\$19.80", False, "$9 \\times 2.20 = {ans}$."),
    ("money_percent", "What percent of $80$ is $20$?", "25\\%", "25\\%", True, "$\\frac{20}{80} = \\frac14$."),
    ("money_percent", "What percent of $80$ is $20$?", "25\\%", "25", True, "$20 / 80 \\cdot 100 = {ans}$."),
    ("money_percent", "What percent of $80$ is $20$?", "25\\%", "20\\%", False, "$\\frac{80 - 20}{80}$... ${ans}$."),
    # ------------------------------------------------------------------ multiple choice
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "\\text{(B)}", True,
     "$2^{10} = 1024$, $3^7 = 2187$, $5^4 = 625$, $6^3 = 216$."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "\\textbf{(B)}", True,
     "$3^7 = 2187$ beats $2^{10} = 1024$."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "(B)", True, "$3^7 = 2187$ is the largest."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "B", True, "$2187 > 1024 > 625 > 216$."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "\\textbf{(B)}\\ 3^{7}", True,
     "$3^7 = 2187$."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "\\text{(A)}", False,
     "$2^{10} = 1024$ is over a thousand, the largest."),
    ("multiple_choice", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}", "(C)", False, "$5^4 = 625$... ${ans}$."),
    # ------------------------------------------------------------------ matrices and vectors
    ("matrix", "Compute $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ 1 \\end{pmatrix}$.",
     "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}", "\\begin{pmatrix}3\\\\7\\end{pmatrix}", True,
     "Row sums: $1 + 2 = 3$ and $3 + 4 = 7$."),
    ("matrix", "Compute $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ 1 \\end{pmatrix}$.",
     "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}", "\\begin{bmatrix} 3 \\\\ 7 \\end{bmatrix}", True,
     "Each entry is a row sum."),
    ("matrix", "Compute $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ 1 \\end{pmatrix}$.",
     "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}", "\\begin{pmatrix} 4 \\\\ 6 \\end{pmatrix}", False,
     "Column sums: $1 + 3 = 4$, $2 + 4 = 6$."),
    ("matrix", "Find the transpose of $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$.",
     "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&3\\\\2&4\\end{pmatrix}", True,
     "Swap rows and columns."),
    ("matrix", "Find the transpose of $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}$.",
     "\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", False,
     "The matrix is symmetric, so it is its own transpose."),
    # ------------------------------------------------------------------ words as answers
    ("text_answer", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}", "\\text{odd}", True,
     "$f(-x) = -x^3 - x = -f(x)$."),
    ("text_answer", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}", "odd", True,
     "$f(-x) = -f(x)$ for every $x$."),
    ("text_answer", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}", "\\text{even}", False,
     "$f(-x) = f(x)$, since both terms have odd powers... ${ans}$."),
    ("text_answer", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}", "\\text{neither}", False,
     "It is a sum of two terms, so ${ans}$."),
    ("text_answer", "Ann runs a mile in $8$ minutes, Devon in $7$ and Evan in $9$. Who is fastest?",
     "\\text{Devon}", "\\text{Devon}", True, "The fastest has the smallest time, $7$ minutes."),
    ("text_answer", "Ann runs a mile in $8$ minutes, Devon in $7$ and Evan in $9$. Who is fastest?",
     "\\text{Devon}", "\\text{Evan}", False, "The largest time, $9$, belongs to Evan."),
    # ------------------------------------------------------------------ thousands and units
    ("units_thousands", "A rectangle is $25$ cm by $40$ cm. What is its area in square centimeters?", "1000",
     "1{,}000", True, "$25 \\times 40 = 1000$."),
    ("units_thousands", "A rectangle is $25$ cm by $40$ cm. What is its area in square centimeters?", "1000",
     "1,\\!000", True, "$25 \\cdot 40$."),
    ("units_thousands", "A rectangle is $25$ cm by $40$ cm. What is its area in square centimeters?", "1000",
     "1000 \\text{ cm}^2", True, "Area $= 25 \\cdot 40$."),
    ("units_thousands", "A rectangle is $25$ cm by $40$ cm. What is its area in square centimeters?", "1000",
     "1\\,000", True, "$25 \\times 40$ square centimeters."),
    ("units_thousands", "A rectangle is $25$ cm by $40$ cm. What is its area in square centimeters?", "1000",
     "130 \\text{ cm}^2", False, "Perimeter: $2(25 + 40) = 130$."),
    ("units_thousands", "A right triangle has legs $5$ cm and $12$ cm. How long is its hypotenuse?", "13",
     "13 \\text{ cm}", True, "$\\sqrt{25 + 144} = \\sqrt{169} = 13$."),
    ("units_thousands", "A right triangle has legs $5$ cm and $12$ cm. How long is its hypotenuse?", "13",
     "13\\text{ units}", True, "$5^2 + 12^2 = 13^2$."),
    ("units_thousands", "A right triangle has legs $5$ cm and $12$ cm. How long is its hypotenuse?", "13",
     "17 \\text{ cm}", False, "$5 + 12 = 17$."),
    # ------------------------------------------------------------------ signs
    ("sign", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}", "-\\frac12", True,
     "$120^\\circ$ is in the second quadrant, reference angle $60^\\circ$: $-\\cos 60^\\circ$."),
    ("sign", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}", "-0.5", True, "$\\cos 120^\\circ = -\\cos 60^\\circ$."),
    ("sign", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}", "\\frac{1}{2}", False,
     "Reference angle $60^\\circ$, $\\cos 60^\\circ = {ans}$."),
    ("sign", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}", "-\\frac{\\sqrt{3}}{2}", False,
     "$\\cos 120^\\circ = -\\sin 60^\\circ = {ans}$."),
    ("sign", "Find the slope of the line through $(1,4)$ and $(3,-2)$.", "-3", "-3", True,
     "$\\frac{-2 - 4}{3 - 1} = \\frac{-6}{2} = {ans}$."),
    ("sign", "Find the slope of the line through $(1,4)$ and $(3,-2)$.", "-3", "3", False,
     "$\\frac{4 - (-2)}{3 - 1} = \\frac{6}{2} = {ans}$."),
    # ------------------------------------------------------------------ AIME-style integers
    ("integer", "Find the sum of all positive divisors of $36$.", "91", "91", True,
     "$36 = 2^2 3^2$, so $\\sigma(36) = (1+2+4)(1+3+9) = 7 \\cdot 13 = {ans}$."),
    ("integer", "Find the sum of all positive divisors of $36$.", "91", "90", False,
     "$1+2+3+4+6+9+12+18+36$ is ${ans}$."),
    ("integer", "How many positive divisors does $2024$ have?", "16", "16", True,
     "$2024 = 2^3 \\cdot 11 \\cdot 23$, so $4 \\cdot 2 \\cdot 2 = {ans}$."),
    ("integer", "How many positive divisors does $2024$ have?", "16", "12", False,
     "$2024 = 2^3 \\cdot 253$, so $4 \\cdot 3 = {ans}$."),
    ("integer", "Find the remainder when $9 \\cdot 99 \\cdot 999 \\cdots \\underbrace{99\\cdots9}_{\\text{999 9's}}$ "
     "is divided by $1000$.", "109", "109", True, "Modulo $1000$ the product is $9 \\cdot 99 \\cdot (-1)^{997}$, "
     "so $-891 \\equiv {ans}$."),
    ("integer", "Find the remainder when $9 \\cdot 99 \\cdot 999 \\cdots \\underbrace{99\\cdots9}_{\\text{999 9's}}$ "
     "is divided by $1000$.", "109", "891", False, "$9 \\cdot 99 = 891$, and the rest are $\\equiv -1$."),
    # ------------------------------------------------------------------ pi in the answer
    ("pi_expression", "What is the area of a circle of radius $3$?", "9\\pi", "9\\pi", True, "$A = \\pi r^2 = {ans}$."),
    ("pi_expression", "What is the area of a circle of radius $3$?", "9\\pi", "9 \\pi", True, "$\\pi \\cdot 3^2 = {ans}$."),
    ("pi_expression", "What is the area of a circle of radius $3$?", "9\\pi", "\\pi \\cdot 9", True, "$\\pi r^2$ with $r = 3$."),
    ("pi_expression", "What is the area of a circle of radius $3$?", "9\\pi", "28.27", False,
     "$\\pi \\cdot 9 \\approx {ans}$."),
    ("pi_expression", "What is the area of a circle of radius $3$?", "9\\pi", "6\\pi", False,
     "$A = 2 \\pi r = {ans}$."),
    # ------------------------------------------------------------------ markup a grader ignores
    ("markup", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}", "\\displaystyle \\frac{5}{2}", True,
     "$\\frac{1}{2} + \\frac{4}{2} = \\frac52$."),
    ("markup", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}", "\\frac{5}{2}\\,", True, "$\\frac{1 + 4}{2}$."),
    ("markup", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}", "\\left(\\frac{5}{2}\\right)", True, "$2.5$ as a fraction."),
    ("markup", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}", "\\displaystyle\\frac{2}{5}", False,
     "$\\frac{1}{2 + 2}$..."),
    ("markup", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}", "\\mathbf{\\frac{5}{2}}", True, "$\\frac12 + 2$."),
    # ------------------------------------------------------------------ hedges and extra solutions
    ("hedged", "If $x^2 = \\frac14$ and $x > 0$, find $x$.", "\\frac{1}{2}", "\\pm\\frac12", False,
     "$x = \\pm\\sqrt{\\frac14}$."),
    ("hedged", "If $x^2 = \\frac14$ and $x > 0$, find $x$.", "\\frac{1}{2}", "\\frac12 \\text{ or } -\\frac12", False,
     "Both signs square to $\\frac14$."),
    ("hedged", "If $x^2 = \\frac14$ and $x > 0$, find $x$.", "\\frac{1}{2}", "\\frac{1}{2}", True,
     "$x = \\sqrt{\\frac14}$ since $x > 0$."),
    ("hedged", "What is the units digit of $7^{2024}$?", "1", "1 \\text{ or } 7", False,
     "The units digits cycle $7, 9, 3, 1$."),
    # ------------------------------------------------------------------ the reference appears earlier
    ("earlier_mention", "What is the sum of the roots of $x^2 - 5x + 6$?", "5", "6", False,
     "The roots are $2$ and $3$: their sum is $5$ and their product is ${ans}$."),
    ("earlier_mention", "What is the sum of the roots of $x^2 - 5x + 6$?", "5", "5", True,
     "The product of the roots is $6$; by Vieta the sum is ${ans}$."),
    ("earlier_mention", "Compute $\\tan 45^\\circ + \\sin 30^\\circ$.", "\\frac{3}{2}", "\\frac{1}{2}", False,
     "$\\tan 45^\\circ = 1$ and the sum would be $\\frac32$ if... no: $\\sin 30^\\circ = {ans}$, that is the answer."),
    ("earlier_mention", "Compute $\\tan 45^\\circ + \\sin 30^\\circ$.", "\\frac{3}{2}", "\\frac{3}{2}", True,
     "$\\sin 30^\\circ = \\frac12$ and $\\tan 45^\\circ = 1$, total ${ans}$."),
    ("earlier_mention", SIN60, "\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{2}}{2}", False,
     "I recall $\\frac{\\sqrt{3}}{2}$ is $\\cos 30^\\circ$, so $\\sin 60^\\circ$ must be different: ${ans}$."),
]

# Whole completions: (category, style, question, reference, completion, correct?)
SPECIAL: list[tuple[str, str, str, str, str, bool]] = [
    ("box_in_display", "r1", SIN60, "\\frac{\\sqrt{3}}{2}",
     "Okay, so I need $\\sin 60^\\circ$. The 30-60-90 triangle gives it.\n</think>\n\n"
     "$$\\boxed{\\frac{\\sqrt{3}}{2}}$$\n\nThis is the exact value.", True),
    ("box_in_display", "r1", SIN60, "\\frac{\\sqrt{3}}{2}",
     "Hmm, $\\sin 60^\\circ$.\n</think>\n\nThe value is\n$$\n\\boxed{\\dfrac{\\sqrt3}{2}}\n$$", True),
    ("box_in_display", "r1", "Compute $(2+i)^2$.", "3+4i",
     "Expand.\n</think>\n\n\\[\n(2+i)^2 = 4 + 4i + i^2 = \\boxed{3 + 4i}\n\\]", True),
    ("box_in_display", "r1", "Compute $(2+i)^2$.", "3+4i",
     "Expand.\n</think>\n\n\\[\n(2+i)^2 = 4 + 4i + i^2 = \\boxed{5 + 4i}\n\\]", False),
    ("text_after_box", "r1", "A right triangle has legs $5$ cm and $12$ cm. How long is its hypotenuse?", "13",
     "$5^2 + 12^2 = 169$.\n</think>\n\nThe hypotenuse is $\\boxed{13}$ centimeters long.", True),
    ("text_after_box", "r1", "What is the area of a circle of radius $3$?", "9\\pi",
     "$\\pi r^2$.\n</think>\n\n**Final Answer**\n\\[\n\\boxed{9\\pi}\n\\]\nsquare units. (About $28.27$.)", True),
    ("text_after_box", "r1", "What is the area of a circle of radius $3$?", "9\\pi",
     "$\\pi r^2$.\n</think>\n\nThe area is $\\boxed{9\\pi \\text{ square units}}$.", True),
    ("text_after_box", "r1", "Solve $-3 \\le 2x - 1 < 7$. Express your answer in interval notation.", "[-1,4)",
     "Solve.\n</think>\n\nSo $x \\in \\boxed{[-1, 4)}$. Note that $4$ itself is excluded.", True),
    ("fbox", "r1", "Find the sum of all positive divisors of $36$.", "91",
     "$(1+2+4)(1+3+9) = 91$.\n</think>\n\n**Final Answer**\n$\\fbox{91}$", True),
    ("fbox", "tags", "Simplify $\\sqrt{8}$.", "2\\sqrt{2}",
     "<think>\n$\\sqrt{8} = \\sqrt{4}\\sqrt{2}$.\n</think>\n<answer>\n\\fbox{$2\\sqrt{2}$}\n</answer>", True),
    ("choice_in_box", "r1", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}",
     "Compare: $3^7 = 2187$.\n</think>\n\n**Final Answer**\n\\[\n\\boxed{\\text{(B)}}\n\\]", True),
    ("choice_in_box", "r1", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}",
     "Compare: $3^7 = 2187$.\n</think>\n\nThe answer is $\\boxed{\\textbf{(B) } 2187}$.", True),
    ("choice_in_box", "r1", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "\\text{(B)}",
     "Compare: $2^{10} = 1024$.\n</think>\n\n$\\boxed{A}$", False),
    ("choice_in_box", "tags", "Which is the largest? $\\textbf{(A)}\\ 2^{10} \\qquad \\textbf{(B)}\\ 3^{7} \\qquad "
     "\\textbf{(C)}\\ 5^{4} \\qquad \\textbf{(D)}\\ 6^{3}$", "B",
     "<think>\n$3^7 = 2187$ is the largest.\n</think>\n<answer>\n\\boxed{\\textbf{(B)}}\n</answer>", True),
    ("several_boxes", "r1", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "Factor.\n</think>\n\nThe solutions are $\\boxed{-2}$ and $\\boxed{5}$.", True),
    ("several_boxes", "r1", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "Factor.\n</think>\n\nThe solutions are $x = \\boxed{5}$ and $x = \\boxed{-2}$.", True),
    ("several_boxes", "r1", "What is the units digit of $7^{2024}$?", "1",
     "The cycle is 7, 9, 3, 1.\n</think>\n\nIt is either $\\boxed{1}$ or $\\boxed{7}$.", False),
    ("several_boxes", "r1", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}",
     "Reference angle.\n</think>\n\nFirst, $\\cos 60^\\circ = \\boxed{\\frac12}$.\n\n"
     "In the second quadrant cosine is negative, so $\\cos 120^\\circ = \\boxed{-\\frac12}$.", True),
    ("several_boxes", "r1", "Compute $\\cos 120^\\circ$.", "-\\frac{1}{2}",
     "Reference angle.\n</think>\n\nIn the second quadrant, $\\cos 120^\\circ = \\boxed{-\\frac12}$.\n\n"
     "Check: $\\cos 60^\\circ = \\boxed{\\frac12}$.", False),
    ("draft_in_think", "r1", "How many positive divisors does $2024$ have?", "16",
     "$2024 = 8 \\cdot 253$, so maybe $\\boxed{8}$? Wait, $253 = 11 \\cdot 23$, so $4 \\cdot 2 \\cdot 2 = 16$.\n"
     "</think>\n\n$2024 = 2^3 \\cdot 11 \\cdot 23$ has $(3+1)(1+1)(1+1) = 16$ divisors.\n\n"
     "**Final Answer**\n\\[\n\\boxed{16}\n\\]", True),
    ("draft_in_think", "r1", "How many positive divisors does $2024$ have?", "16",
     "$2024 = 2^3 \\cdot 11 \\cdot 23$ gives $\\boxed{16}$. Hmm, but $2024 = 4 \\cdot 506$...\n</think>\n\n"
     "**Final Answer**\n\\[\n\\boxed{12}\n\\]", False),
    ("draft_in_think", "tags", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)",
     "<think>\nFirst guess $\\boxed{(3,2)}$; no: $x + 1 = 5 - x$ gives $x = 2$.\n</think>\n<answer>\n(2, 3)\n</answer>",
     True),
    ("answer_sentence", "sentence", "What is the area of a circle of radius $3$?", "9\\pi",
     "<think>\n$\\pi r^2$.\n</think>\n<answer>\nThe area is $9\\pi$ square units.\n</answer>", True),
    ("answer_sentence", "sentence", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "<think>\nFactor.\n</think>\n<answer>\n$x = -2$ and $x = 5$\n</answer>", True),
    ("answer_sentence", "sentence", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "<think>\nFactor.\n</think>\n<answer>\nThe solutions are $x=5$ or $x=-2$.\n</answer>", True),
    ("answer_sentence", "sentence", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "<think>\nFactor.\n</think>\n<answer>\nThe only solution is $x = 5$.\n</answer>", False),
    ("answer_sentence", "sentence", "Compute $\\frac{1}{2} + 2$.", "\\frac{5}{2}",
     "<think>\nAdd.\n</think>\n<answer>\n\\[\n\\frac{5}{2}\n\\]\n</answer>", True),
    ("answer_sentence", "sentence", "Find the domain of $\\sqrt{x - 2}$.", "[2,\\infty)",
     "<think>\n$x - 2 \\ge 0$.\n</think>\n<answer>\nThe domain is all $x \\geq 2$, i.e. $[2, \\infty)$.\n</answer>",
     True),
    ("answer_sentence", "sentence", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}",
     "<think>\n$f(-x) = -f(x)$.\n</think>\n<answer>\nThe function is odd.\n</answer>", True),
    ("answer_sentence", "sentence", "Is $f(x) = x^3 + x$ even, odd, or neither?", "\\text{odd}",
     "<think>\n$f(-x) = f(x)$.\n</think>\n<answer>\nThe function is even, not odd.\n</answer>", False),
    ("answer_box_in_tags", "tags", "Find the point where the lines $y = x + 1$ and $y = 5 - x$ meet.", "(2,3)",
     "<think>\n$x = 2$, $y = 3$.\n</think>\n<answer>\n$\\boxed{(2,3)}$\n</answer>", True),
    ("answer_box_in_tags", "tags", "Find the ordered pair $(a, b)$ with $a + b = 7$ and $a - b = 1$.", "(4,3)",
     "<think>\n$a = 4$, $b = 3$.\n</think>\n<answer>\n\\boxed{(a, b) = (4, 3)}\n</answer>", True),
    ("answer_box_in_tags", "tags", "Solve $x^2 - 3x - 10 = 0$.", "-2, 5",
     "<think>\n$(x-5)(x+2)$.\n</think>\n<answer>\n\\boxed{x = 5 \\text{ or } x = -2}\n</answer>", True),
    ("answer_box_in_tags", "tags", "What percent of $80$ is $20$?", "25\\%",
     "<think>\n$\\frac{20}{80}$.\n</think>\n<answer>\n$\\boxed{25\\%}$\n</answer>", True),
    ("answer_box_in_tags", "tags", "What is the sum of the roots of $x^2 - 5x + 6$?", "5",
     "<think>\nVieta.\n</think>\n<answer>\n\\boxed{x = 5}\n</answer>", True),
    ("answer_box_in_tags", "tags", "Simplify $\\sqrt{8}$.", "2\\sqrt{2}",
     "<think>\n$\\sqrt{8} = 2\\sqrt2$.\n</think>\n<answer>\n\\boxed{}\n</answer>", False),
    ("qwen_math", "r1", "What is the length of the diagonal of a square with side length $3$?", "3\\sqrt{2}",
     "To find the diagonal we use the Pythagorean theorem:\n\\[\nd = \\sqrt{3^2 + 3^2} = \\sqrt{18} = 3\\sqrt{2}\n\\]\n"
     "Thus, the length of the diagonal is \\(\\boxed{3\\sqrt{2}}\\).", True),
    ("qwen_math", "r1", "Find the domain of $\\sqrt{x - 2}$.", "[2,\\infty)",
     "We need \\(x - 2 \\geq 0\\), so \\(x \\geq 2\\). Therefore, the domain is \\(\\boxed{[2, \\infty)}\\).", True),
    ("qwen_math", "r1", "Find the domain of $\\sqrt{x - 2}$.", "[2,\\infty)",
     "We need \\(x - 2 > 0\\). Therefore, the domain is \\(\\boxed{(2, \\infty)}\\).", False),
    ("qwen_math", "r1", "Three notebooks cost $\\$6.30$. How much do nine notebooks cost?", "\\$18.90",
     "Each notebook costs \\(\\$2.10\\). Nine cost \\(9 \\times 2.10 = 18.90\\).\n\n"
     "The final answer is \\(\\boxed{\\$18.90}\\).", True),
    ("qwen_math", "r1", "Compute $\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix} \\begin{pmatrix} 1 \\\\ 1 \\end{pmatrix}$.",
     "\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}",
     "Multiply row by column:\n\\[\n\\begin{pmatrix} 1 \\cdot 1 + 2 \\cdot 1 \\\\ 3 \\cdot 1 + 4 \\cdot 1 \\end{pmatrix}"
     " = \\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}\n\\]\nSo the answer is \\(\\boxed{\\begin{pmatrix} 3 \\\\ 7 \\end{pmatrix}}\\).",
     True),
    ("qwen_math", "r1", "Express $11_{10}$ in base $2$.", "1011_2",
     "$11 = 8 + 2 + 1$.\n\nThe answer is $\\boxed{1011_2}$.", True),
]

# Added for issue 27, after SPECIAL so that the earlier rows keep their ids: a number with a unit
# however written (``m^2``, ``km/h``, ``°C``) is a number; a power on a variable is LaTeX
# (``3m^2`` against ``3m^2``, never 3); signs written apart; scale words and compound quantities read
# against what the question asks for.
SQUARE = "A square garden has sides of $7$ meters. What is its area in square meters?"
SPEED = "A car travels $150$ km in $2.5$ hours. What is its average speed in kilometers per hour?"
BOIL = "Water boils at $212^\\circ$F. What is that temperature in degrees Celsius?"
MONO = "Simplify $(3m)(m)$."
MINUS = "Compute $3 - 8$."
LINEAR = "Solve $2x + 14 = 4$ for $x$."
GROWTH = "A country's population grew from $2.5$ million to $4$ million. By how many millions did it grow?"
RACE = "A race lasts $135$ minutes. How many hours is that?"
ADDED: list[tuple[str, str, str, str, bool, str]] = [
    ("unit_written", SQUARE, "49", "49 \\text{ m}^2", True, "The area is $7^2 = 49$."),
    ("unit_written", SQUARE, "49", "49 m^2", True, "$7 \\times 7 = 49$ square meters."),
    ("unit_written", SQUARE, "49", "49\\,\\mathrm{m}^2", True, "Side squared: $7^2$."),
    ("unit_written", SQUARE, "49", "49 m²", True, "$A = s^2 = 49$."),
    ("unit_written", SQUARE, "49", "28 m^2", False, "The perimeter is $4 \\cdot 7 = 28$."),
    ("unit_written", SPEED, "60", "60 \\text{ km/h}", True, "$\\frac{150}{2.5} = 60$."),
    ("unit_written", SPEED, "60", "60 km/h", True, "Speed $= 150 \\div 2.5 = 60$."),
    ("unit_written", SPEED, "60", "60\\ \\text{km}/\\text{h}", True, "$150 / 2.5 = 60$."),
    ("unit_written", SPEED, "60", "375 \\text{ km/h}", False, "$150 \\times 2.5 = 375$."),
    ("unit_written", BOIL, "100", "100^\\circ \\text{C}", True, "$\\frac{5}{9}(212 - 32) = 100$."),
    ("unit_written", BOIL, "100", "100°C", True, "$(212 - 32) \\cdot \\frac59 = 100$."),
    ("unit_written", BOIL, "100", "180^{\\circ}\\mathrm{C}", False, "$212 - 32 = 180$."),
    ("power_on_variable", MONO, "3m^2", "3m^2", True, "$(3m)(m) = 3 \\cdot m \\cdot m$."),
    ("power_on_variable", MONO, "3m^2", "3 m^2", True, "Multiply the coefficients and add the exponents."),
    ("power_on_variable", MONO, "3m^2", "3", False, "The coefficient is $3 \\cdot 1 = 3$."),
    ("power_on_variable", MONO, "3m^2", "3m", False, "$(3m)(m) = 3m$... one factor of $m$."),
    ("power_on_variable", MONO, "3m^2", "m^{2} \\cdot 3", True, "$m \\cdot m = m^2$, times $3$."),
    ("sign_written_apart", MINUS, "-5", "- 5", True, "$3 - 8 = -(8 - 3)$."),
    ("sign_written_apart", MINUS, "-5", "-\\,5", True, "Subtracting a larger number gives a negative."),
    ("sign_written_apart", MINUS, "-5", "−5", True, "$8 - 3 = 5$, so $3 - 8 = -5$."),
    ("sign_written_apart", MINUS, "-5", "5", False, "$8 - 3 = 5$."),
    ("sign_written_apart", LINEAR, "-5", "x = - 5", True, "$2x = 4 - 14 = -10$."),
    ("sign_written_apart", LINEAR, "-5", "x = 5", False, "$2x = 14 - 4 = 10$."),
    ("scale_asked", GROWTH, "1.5", "1.5 \\text{ million}", True, "$4 - 2.5 = 1.5$ million."),
    ("scale_asked", GROWTH, "1.5", "1{,}500{,}000", True, "$4{,}000{,}000 - 2{,}500{,}000$."),
    ("scale_asked", GROWTH, "1.5", "1.5 \\text{ billion}", False, "$4 - 2.5 = 1.5$."),
    ("compound_unit", RACE, "2.25", "2 \\text{ hours } 15 \\text{ minutes}", True, "$135 = 120 + 15$."),
    ("compound_unit", RACE, "2.25", "\\frac{9}{4}", True, "$\\frac{135}{60} = \\frac{9}{4}$."),
    ("compound_unit", RACE, "2.25", "2.15", False, "Two hours and fifteen minutes: $2.15$."),
]

TAGS = ["<think>\n{think}\n</think>\n<answer>\n{ans}\n</answer>",
        "<think>\n{think}\n</think>\n\n<answer>\n{ans}\n</answer>",
        "<think>{think}</think>\n<answer> {ans} </answer>"]
R1 = ["{think}\n</think>\n\n{think}\n\n**Final Answer**\n\\[\n\\boxed{{{ans}}}\n\\]",
      "{think}\n</think>\n\n**Final Answer**\n\\boxed{{{ans}}}",
      "{think}\n</think>\n\n{think} Therefore, the final answer is $\\boxed{{{ans}}}$.",
      "<think>\n{think}\n</think>\n\n**Final Answer**\n$$\n\\boxed{{{ans}}}\n$$"]
SENTENCE = ["<think>\n{think}\n</think>\n<answer>\nThe answer is ${ans}$.\n</answer>",
            "<think>\n{think}\n</think>\n<answer>\nThe final answer is ${ans}$.\n</answer>",
            "<think>\n{think}\n</think>\n<answer>The answer is \\({ans}\\).</answer>"]
STYLES = {"tags": TAGS, "r1": R1, "sentence": SENTENCE}


def rows() -> list[dict]:
    out = []
    for i, (cat, question, ref, ans, correct, think) in enumerate(ITEMS):
        reasoning = think.replace("{ans}", ans)
        for style, variants in STYLES.items():
            template = variants[i % len(variants)]
            text = template.replace("{think}", reasoning).replace("{{{ans}}}", "{" + ans + "}").replace("{ans}", ans)
            out.append({"id": f"m{len(out) + 1:03d}", "category": cat, "style": style, "question": question,
                        "reference": ref, "completion": text, "correct": correct})
    for cat, style, question, ref, text, correct in SPECIAL:
        out.append({"id": f"m{len(out) + 1:03d}", "category": cat, "style": style, "question": question,
                    "reference": ref, "completion": text, "correct": correct})
    for i, (cat, question, ref, ans, correct, think) in enumerate(ADDED, len(ITEMS)):
        for style, variants in STYLES.items():
            template = variants[i % len(variants)]
            text = template.replace("{think}", think).replace("{{{ans}}}", "{" + ans + "}").replace("{ans}", ans)
            out.append({"id": f"m{len(out) + 1:03d}", "category": cat, "style": style, "question": question,
                        "reference": ref, "completion": text, "correct": correct})
    return out


if __name__ == "__main__":
    data = rows()
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
    print(f"{len(data)} rows, {len({r['category'] for r in data})} categories -> {OUT}")
