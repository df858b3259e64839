"""Grading: how a completion's final answer is found, read and judged equal to the reference, the way a
careful human grader does it (what the built-in ``correctness`` reward calls; ``nanogrpo eval``'s votes
too). Pure functions of text: no model, no process, nothing loaded at import but patterns.

Where the answer is (:mod:`~nanogrpo.grading.region`); the value it states in words and numbers
(:mod:`~nanogrpo.grading.extract`, reading numbers with :mod:`~nanogrpo.grading.numbers`,
:mod:`~nanogrpo.grading.number_words`, :mod:`~nanogrpo.grading.units` and
:mod:`~nanogrpo.grading.arithmetic`; refusing hedges, :mod:`~nanogrpo.grading.hedges`); the answer kept
as LaTeX (:mod:`~nanogrpo.grading.latex`) and answers of other forms (:mod:`~nanogrpo.grading.forms`);
math equivalence through math_verify (:mod:`~nanogrpo.grading.verify`); the verdict
(:mod:`~nanogrpo.grading.grade`). How it behaves, case by case: docs/guides/grading.md.
"""

from nanogrpo.grading.extract import Answer, extract_answer, read_answer
from nanogrpo.grading.grade import final_answer, grade

__all__ = ["Answer", "read_answer", "extract_answer", "final_answer", "grade"]
