"""The tool of a run: its protocol, its function (by name) and its sandbox, behind one object.

:class:`ToolRunner` is built from the ``tools`` config at start (a tool that does not import is
an error then, in one line) and owns the sandbox's fork server, started on first use and
stopped by :meth:`ToolRunner.close`. :meth:`ToolRunner.run` takes the calls parsed out of a turn
and returns what each trajectory is shown, with a status the caller counts.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections import Counter
from pathlib import Path

from nanogrpo.errors import ToolError
from nanogrpo.tools.protocols import Call, make_protocol
from nanogrpo.tools.sandbox import Sandbox, ToolResult, describe

log = logging.getLogger("nanogrpo.tools")

BUILTIN = {"python": "nanogrpo.tools.python:run_python"}
_WARN_LIMIT = 3


def resolve_tool(spec: str) -> str:
    """The ``module:function`` / ``file.py:function`` a tool name stands for, checked to import here
    (the sandbox imports it again); a bad name is a :class:`ToolError`."""
    spec = BUILTIN.get(spec.strip(), spec.strip())
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise ToolError(f"tool {spec!r}: expected 'python', 'module:function' or 'path/to/file.py:function'")
    try:
        if module.endswith(".py") or "/" in module:
            path = Path(module).expanduser().resolve()
            if not path.is_file():
                raise ToolError(f"tool {spec!r}: file not found: {path}")
            spec = f"{path}:{attr}"
            file_spec = importlib.util.spec_from_file_location(f"_nanogrpo_tool_check_{path.stem}", path)
            mod = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except ToolError:
        raise
    except (Exception, SystemExit) as e:
        first = (str(e).splitlines() or [""])[0]
        raise ToolError(f"tool {spec!r}: cannot import {module!r} ({type(e).__name__}: {first})") from None
    if not callable(getattr(mod, attr, None)):
        raise ToolError(f"tool {spec!r}: {module!r} has no function {attr!r}")
    return spec


class ToolRunner:
    """Protocol + sandboxed tool function for a run (``tools`` config)."""

    def __init__(self, cfg, *, protocol=None, disable: tuple[str, ...] = ()):
        """``protocol``: an object like those of :mod:`nanogrpo.tools.protocols` (``stop``,
        ``parse``, ``before_output``, ``after_output``) instead of ``cfg.protocol``'s."""
        self.cfg = cfg
        self.protocol = protocol if protocol is not None else \
            make_protocol(cfg.protocol, cfg.name, cfg.argument)
        self.spec = resolve_tool(cfg.function)
        self.sandbox = Sandbox(self.spec, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb,
                               file_mb=cfg.file_mb, output_bytes=cfg.max_output_bytes, workers=cfg.workers,
                               preload=cfg.preload, require_isolation=cfg.require_isolation, disable=disable)
        self.fields = tuple(cfg.sample_fields) if self.spec != BUILTIN["python"] else ()
        self.counts: Counter = Counter()
        """Calls by status over the run (``ok`` included)."""
        self._announced = False

    @classmethod
    def from_config(cls, cfg) -> ToolRunner | None:
        """None when ``tools.enabled`` is false."""
        return cls(cfg) if cfg.enabled else None

    @property
    def stop(self) -> tuple[str, ...]:
        return self.protocol.stop

    def start(self) -> ToolRunner:
        prot = self.sandbox.start()
        if not self._announced:
            self._announced = True
            text, missing = describe(prot)
            log.log(logging.WARNING if missing else logging.INFO, "tool %s (%s protocol) in the sandbox, "
                    "%s%s", self.spec, self.protocol.name, text,
                    " (see nanogrpo/tools/sandbox.py: what holds without them)" if missing else "")
        return self

    def close(self) -> None:
        self.sandbox.close()
        for status, n in sorted(self.counts.items()):
            if status != "ok" and n > _WARN_LIMIT:
                log.warning("tool calls over the run: %d %s", n, status)

    def __enter__(self) -> ToolRunner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def visible(self, sample: dict) -> dict:
        """What of a dataset row the tool receives: the ``tools.sample_fields`` (none for ``python``)."""
        missing = [k for k in self.fields if k not in sample]
        if missing:
            raise ToolError(f"tools.sample_fields names {missing}, which the dataset rows lack "
                            f"(they have {sorted(sample)})")
        return {k: sample[k] for k in self.fields}

    def run(self, calls: list[Call], samples: list[dict]) -> list[ToolResult]:
        """Run the well-formed calls in the sandbox; a malformed one gets ``invalid`` and its reason.
        Each call's process receives its code and :meth:`visible` of its sample, nothing else."""
        todo = [i for i, c in enumerate(calls) if c.text is not None]
        if todo:
            self.start()
        done = dict(zip(todo, self.sandbox.run([(calls[i].text, self.visible(samples[i])) for i in todo]),
                        strict=True))
        out = []
        for i, c in enumerate(calls):
            res = done[i] if i in done else ToolResult("invalid", f"error: {c.error}")
            out.append(self.shown(res))
            self.counts[res.status] += 1
            if res.status != "ok":
                self._report(res)
        return out

    def shown(self, res: ToolResult) -> ToolResult:
        """What the model reads for a result: the output, or the output and what went wrong."""
        text = res.output.rstrip()
        if res.status == "timeout":
            text = f"TimeoutError: the code ran longer than {self.cfg.timeout_s:g} s and was stopped"
        elif res.status == "overflow":
            text += f"\n[output cut: more than {self.cfg.max_output_bytes} bytes]"
        elif res.status == "crash":
            text = f"error: {text}"
        return ToolResult(res.status, text)

    def _report(self, res: ToolResult) -> None:
        if self.counts[res.status] <= _WARN_LIMIT:
            first = res.output.strip().splitlines()[-1:] or [""]
            last = self.counts[res.status] == _WARN_LIMIT
            log.info("tool call %s: %s%s", res.status, first[0][:200],
                     "; further ones are counted, not logged" if last else "")
