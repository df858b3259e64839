"""Where a model is loaded from: a demo's shipped weights (``embedded``, ``embedded-NAME``), a local
directory, or an HF hub id, checked in seconds.

A demo's weights are found by the model name its package registers (:mod:`nanogrpo.entry_points`;
nothing here imports a demo), asked only for a bare name (no ``/``, not ``.``/``~``-relative).

Nothing here imports torch or transformers, so a bad model path is reported before they load.

A hub id is asked about once, with a short timeout and no retries (huggingface_hub's own
download path retries a dead network for about a minute): the hub's answer says whether the
model exists and may be read. Without network, a copy in the HF cache is used (its snapshot
directory, so that transformers does not reach for the network again), said in one line;
with no copy, a one-line :class:`~nanogrpo.errors.ModelError` says what to do (pass a local
directory, or download the model and set ``HF_HUB_OFFLINE=1``). With ``HF_HUB_OFFLINE=1`` the
hub is not asked at all.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from nanogrpo import entry_points, hub
from nanogrpo.errors import ModelError

__all__ = ["EMBEDDED", "check_model_source", "hub_source", "resolve_model_path"]

log = logging.getLogger("nanogrpo.models")

EMBEDDED = "embedded"
"""The model ``model.path`` defaults to: the default demo's warm start, by the name it registers
(``nanogrpo/demos/arithmetic/weights``); ``embedded-NAME`` is demo NAME's."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _demo(path: str) -> entry_points.Demo | None:
    """The demo whose shipped weights ``path`` names; a path or an ``org/name`` id is none (not asked)."""
    if "/" in path or path.startswith((".", "~")):
        return None
    return entry_points.model_demo(path)


def _looks_like_path(s: str) -> bool:
    """Anything but ``name`` or ``org/name`` is a filesystem path."""
    return s.startswith((".", "/", "~")) or not _HUB_ID.match(s)


def resolve_model_path(path: str) -> str:
    """Where to load ``path`` from: a demo's shipped weights (``embedded``, ``embedded-NAME``), a local
    directory (checked to hold an HF model), or for a hub id the id itself or, offline, its
    directory in the HF cache (:func:`hub_source`)."""
    demo = _demo(path)
    if demo is not None:
        shipped = demo.weights
        if not (shipped / "config.json").is_file() or not (shipped / "model.safetensors").is_file():
            raise ModelError(f"model {path!r}: the demo's weights are not in this install ({shipped}); build "
                             f"them with: python -m {demo.builder} --out {shipped}")
        return str(shipped)
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"model path {p} has no config.json: not an HF model directory")
        return str(p)
    if _looks_like_path(path):
        raise ModelError(f"model path not found: {path}")
    head = Path(path.split("/", 1)[0]) if "/" in path else None
    if head is not None and head.is_dir():  # `runs/nothere`: a typo of a local path, not a hub id to ask
        raise ModelError(f"model path not found: {path} ({head}/ is a directory here"
                         f"{_holding(head, p.name)}; a hub id of that name is not asked for: run from "
                         "another directory to load it)")
    return hub_source(path)


def _holding(folder: Path, name: str) -> str:
    """``, holding a, b, c`` (the closest to ``name`` first), or nothing for an empty folder."""
    import difflib

    try:
        entries = sorted(e.name for e in folder.iterdir() if not e.name.startswith("."))
    except OSError:
        return ""
    if not entries:
        return ", empty"
    close = difflib.get_close_matches(name, entries, n=3, cutoff=0.5)
    shown = close + [e for e in entries if e not in close][:max(0, 5 - len(close))]
    return ", holding " + ", ".join(shown) + (", ..." if len(entries) > len(shown) else "")


def check_model_source(cfg) -> str | None:
    """Cheap early check of ``cfg.model.path`` (a :class:`~nanogrpo.config.ModelConfig`), no weights
    read: where the model will load from, or None for a demo's shipped weights (checked here too)."""
    if _demo(cfg.path) is not None:
        resolve_model_path(cfg.path)
        return None
    return resolve_model_path(cfg.path)


def _cached_snapshot(repo_id: str) -> tuple[str | None, bool]:
    """(the snapshot directory of ``repo_id`` in the HF cache or None, whether it holds weights)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id for the hub
        return None, False
    if not isinstance(found, str):
        return None, False
    snap = Path(found).parent
    return str(snap), any((snap / f).is_file() for f in WEIGHT_FILES)


def hub_source(repo_id: str, timeout_s: float = hub.TIMEOUT_S, endpoint: str | None = None) -> str:
    """``repo_id`` when the hub has it; its HF cache directory when the hub cannot be reached (or
    ``HF_HUB_OFFLINE`` is set) and the cache holds it; otherwise a one-line ModelError.
    ``endpoint``: the hub's address (default: ``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
    )

    snap, complete = _cached_snapshot(repo_id)
    cache = constants.HF_HUB_CACHE
    endpoint = endpoint or hub.endpoint()
    if hub.offline():
        if snap is not None and complete:
            return snap
        what = "has no weights of it" if snap is not None else "does not hold it"
        raise ModelError(f"model {repo_id!r}: HF_HUB_OFFLINE is set and the HF cache ({cache}) {what}; "
                         f"download it where there is network (`hf download {repo_id}`), or pass a local "
                         "model directory")
    try:
        url = hf_hub_url(repo_id, "config.json", endpoint=endpoint)
        hub.ask(lambda: get_hf_file_metadata(url, timeout=timeout_s), timeout_s)
    except GatedRepoError:
        raise ModelError(f"model {repo_id!r} is gated on the HF hub: accept its terms on its page and log in "
                         "(`hf auth login`, or set HF_TOKEN), or pass a local model directory") from None
    except RepositoryNotFoundError:
        raise ModelError(f"model {repo_id!r} is not on the HF hub ({endpoint}), or is private "
                         "(log in with `hf auth login` or set HF_TOKEN); a local directory must exist "
                         "(it does not here)") from None
    except EntryNotFoundError:
        raise ModelError(f"model {repo_id!r} on the HF hub has no config.json: not a transformers "
                         "model") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        problem = f"the HF hub answered {status}" if status else f"the HF hub failed ({hub.reason(e)})"
        if snap is not None and complete:
            log.info("%s; using the copy of %s in the HF cache (%s)", problem, repo_id, snap)
            return snap
        raise ModelError(f"model {repo_id!r}: {problem}; try again later, or pass a local model "
                         "directory") from None
    except hub.network_errors() as e:
        problem = f"the HF hub ({endpoint}) cannot be reached ({hub.reason(e)})"
        if snap is not None and complete:
            log.info("%s; using the copy of %s in the HF cache (%s)", problem, repo_id, snap)
            return snap
        what = "has no weights of it" if snap is not None else "does not hold it"
        raise ModelError(f"model {repo_id!r}: {problem} and the HF cache ({cache}) {what}: pass "
                         "a local model directory (--model /path/to/model), or download it where there is "
                         f"network (`hf download {repo_id}`) and set HF_HUB_OFFLINE=1") from None
    return repo_id
