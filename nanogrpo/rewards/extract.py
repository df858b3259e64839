"""Pull the final answer out of a model completion.

The seed compared the last number anywhere in the text. nanogrpo prefers the
content of the last ``<answer>...</answer>`` block and falls back to the last
number only when no closed answer block exists (DESIGN.md §2).
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "last_number"]

# Content of one <answer> block that does not itself contain another opening tag,
# so "<answer><answer>5</answer>" yields "5", not "<answer>5".
_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|\.\d+)"
_NUMBER_RE = re.compile(
    # \frac{a}{b}, \dfrac, \tfrac with plain numbers: read as the fraction "a/b".
    r"(?P<fsign>-\s*)?\\[dt]?frac\{\s*(?P<num>-?" + _NUM + r")\s*\}\{\s*(?P<den>-?" + _NUM + r")\s*\}"
    # A plain number: integer, decimal, fraction 3/4, thousands commas 1,234.50, optional sign.
    # The sign counts only when it does not follow a word or closing bracket (so "5-3" ends in 3).
    r"|(?P<sign>(?<![\w)\]}.])-)?(?<![\d.])(?P<plain>" + _NUM + r")"
)


def last_number(text: str) -> str | None:
    """The last number in ``text`` as written (``"1,234.50"``, ``"-3"``, ``"3/4"``), or None.

    ``\\frac{a}{b}`` with numeric a and b is returned as ``"a/b"``.
    """
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 - we want the final match
        pass
    if last is None:
        return None
    if last.group("plain") is not None:
        return (last.group("sign") or "") + last.group("plain")
    sign = "-" if last.group("fsign") else ""
    return f"{sign}{last.group('num')}/{last.group('den')}"


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last ``<answer>`` block's content, else the last number.

    Returns the stripped content of the last closed ``<answer>...</answer>`` block
    (None if that block is empty). Without a closed block (none at all, or an
    unclosed ``<answer>``), returns :func:`last_number` of the whole text, which
    is None when the text holds no number.
    """
    blocks = _ANSWER_RE.findall(text)
    if blocks:
        content = blocks[-1].strip()
        return content or None
    return last_number(text)
