"""The configuration reference, generated from the typed config itself so that it cannot drift.

Every key :class:`nanogrpo.config.Config` accepts (its sections walked recursively through
``model_fields``), with its type, its default and its meaning: the docstring written right under the
field in ``nanogrpo/config/<section>.py`` (read from the source with ``ast``).

The page ``docs/reference/config.md`` holds the generated text between the two markers below, committed
so that a reader of the repository finds it too: ``python docs/scripts/config_reference.py --write``
regenerates it there (``tests/test_docs.py`` fails while it is stale, naming this command). MkDocs runs
this as a hook (``mkdocs.yml``: ``hooks``) and fills the markers afresh at build time.
``python docs/scripts/config_reference.py`` prints the generated text.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
import types
import typing
from typing import Any

MARKER = "<!-- config-reference -->"
END = "<!-- /config-reference -->"
PAGE = "reference/config.md"


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for the fields of a pydantic model class (and its bases) that have a
    string literal right under them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not hasattr(klass, "model_fields") or klass.__module__.startswith("pydantic"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_fields")


def keys(cls: type | None = None, prefix: str = "") -> list[tuple[str, Any, type]]:
    """Every dotted key under ``cls`` (default: the whole ``Config``): ``(key, FieldInfo, owner)``,
    in the order the code declares them."""
    if cls is None:
        from nanogrpo.config import Config

        cls = Config
    out = []
    for name, info in cls.model_fields.items():
        if _is_model(info.annotation):
            out += keys(info.annotation, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", info, cls))
    return out


def type_name(tp: Any) -> str:
    """A type as a config file writes it: ``int``, ``"auto" | "plain"``, ``list[str]``, ``float | None``."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def bounds(info: Any) -> str:
    """The field's numeric bounds (``≥ 0``, ``> 0, ≤ 1``) from its ``Field`` constraints."""
    out = []
    for m in info.metadata:
        for attr, sign in _BOUNDS.items():
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {v}")
    return ", ".join(out)


def default_text(info: Any) -> str:
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "None (unset)"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, ensure_ascii=False)


def _markdown_doc(doc: str) -> str:
    """reST-isms of the docstrings in Markdown: ``:class:`X``` -> ```X```."""
    return re.sub(r":(?:class|mod|func|meth|attr|data|obj):`~?([^`]+)`", r"``\1``", doc)


def section_docs(cls: type) -> str:
    doc = cls.__doc__
    return _markdown_doc(inspect.cleandoc(doc)) if doc and "Usage docs" not in doc else ""


def markdown() -> str:
    """The reference: one part per section, one entry per key (anchor ``#section.key``)."""
    from nanogrpo.config import Config

    lines = []
    for sec, info in Config.model_fields.items():
        cls = info.annotation
        lines += [f"## `[{sec}]` {{#{sec}}}", ""]
        if section_docs(cls):
            lines += [section_docs(cls), ""]
        lines += [f"Module: `{cls.__module__}`, class `{cls.__name__}`.", ""]
        for key, finfo, owner in keys(cls, f"{sec}."):
            doc = field_docs(owner).get(key.rsplit(".", 1)[1], "")
            kind = type_name(finfo.annotation)
            limit = bounds(finfo)
            lines += [f"### `{key}` {{#{key}}}", "",
                      f"**type** `{kind}`" + (f" ({limit})" if limit else "")
                      + f" · **default** `{default_text(finfo)}`", ""]
            lines += [_markdown_doc(doc) if doc else "*No description in the code yet.*", ""]
    return "\n".join(lines)


def filled(text: str, generated: str | None = None) -> str:
    """``text`` (the page) with the generated reference (``generated``, else :func:`markdown`'s) between
    its markers (whatever stood there)."""
    if MARKER not in text or END not in text.split(MARKER, 1)[1]:
        raise ValueError(f"{PAGE} lost its markers {MARKER} ... {END}: the reference goes between them")
    head, rest = text.split(MARKER, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{MARKER}\n\n{markdown() if generated is None else generated}\n{END}{tail}"


def on_page_markdown(text: str, page: Any, **_: Any) -> str:
    """MkDocs hook: fill the markers of ``reference/config.md`` from the code as it is."""
    return filled(text) if page.file.src_uri == PAGE else text


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:] == ["--write"]:
        path = Path(__file__).resolve().parents[1] / PAGE
        path.write_text(filled(path.read_text()))
        print(f"wrote {path}")
    else:
        print(markdown())
