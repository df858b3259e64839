"""MkDocs hook: the code's docstrings cross-reference in reST (``:class:`Run```, ``:func:`train```);
mkdocstrings renders the role's name as text before the code. Keep the code, drop the role's name."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|obj|exc|py:\w+):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("", html)
