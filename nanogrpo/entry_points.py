"""The demos found by name: which installed package serves a data source, ships a model's weights, or
holds a preset, read from package metadata (its entry points in the ``nanogrpo.demos`` group).

Why: the demos are examples over the library (a user copies one into a package of their own), so the
library's layers (data, models, config) never import them; they ask here by name, and any package,
nanogrpo's own demos included, registers its tasks the same way, in its ``pyproject.toml``::

    [project.entry-points."nanogrpo.demos"]
    mytask = "mypkg.mytask"            # a package: a folder with an __init__.py

That package's ``__init__`` declares plain constants, each optional, and runs nothing else on import
(this module imports it to read them)::

    PRESET = "demo-mytask"     # --config demo-mytask reads the folder's preset.toml
    SOURCES = ("mytask",)      # data.source names served by the folder's task.py:
                               #   make_split(split, n) -> rows ("train", and "test" for held-out rows)
    MODEL = "embedded-mytask"  # model.path (or rm:NAME) that loads the folder's weights/ directory

``pip install -e .`` of the package writes the entry point. Nothing is read at import, nor cached: each
question reads the entry points again (a few ms), so a package installed while a process runs is seen.
nanogrpo's own demos are registered in its own metadata, so a source tree that was never pip-installed
(or was installed before the demos registered themselves) knows none:
:class:`~nanogrpo.errors.InstallError` says to ``pip install -e .``. The callers turn "no such name"
into their own one-line errors.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import ModuleType

from nanogrpo.errors import InstallError

GROUP = "nanogrpo.demos"
"""The entry-point group a package registers its demos (tasks, presets, weights) in."""
INSTALL_HINT = "pip install -e . in the nanogrpo repository (or pip install nanogrpo)"


@dataclass(frozen=True)
class Demo:
    """One registered demo: what its package's constants declare, and where its folder is."""

    name: str
    """The entry point's name."""
    package: str
    """The package the entry point names (``nanogrpo.demos.tools``)."""
    folder: Path
    dist: str
    """The distribution that registers it (``nanogrpo``), for errors."""
    preset: str | None
    sources: tuple[str, ...]
    model: str | None

    @property
    def preset_file(self) -> Path:
        return self.folder / "preset.toml"

    @property
    def weights(self) -> Path:
        return self.folder / "weights"

    @property
    def task(self) -> str:
        """The module that makes the rows of its data sources."""
        return f"{self.package}.task"

    @property
    def builder(self) -> str:
        """The module that rebuilds its weights (``python -m BUILDER --out DIR``), by convention."""
        return f"{self.package}.build"


def demos() -> list[Demo]:
    """Every registered demo, by name; an :class:`InstallError` when nanogrpo's own metadata is missing,
    a registered package cannot be imported, its constants are malformed, or two claim one name."""
    _check_own_metadata()
    found = sorted((_read(ep) for ep in metadata.entry_points(group=GROUP)), key=lambda d: d.name)
    _check_unique(found)
    return found


def task_module(source: str) -> ModuleType | None:
    """The task module that serves data source ``source``, imported; None if no demo serves it."""
    for d in demos():
        if source in d.sources:
            try:
                return importlib.import_module(d.task)
            except ModuleNotFoundError as e:
                if e.name != d.task:
                    raise
                raise InstallError(f"demo {d.package} ({d.dist}) registers the data source {source!r} but "
                                   f"has no task module {d.task} (task.py beside its __init__.py)") from None
    return None


def source_names() -> list[str]:
    """The data sources the registered demos serve, sorted."""
    return sorted(s for d in demos() for s in d.sources)


def model_demo(model: str) -> Demo | None:
    """The demo whose shipped weights (``Demo.weights``) model path ``model`` names; None if none."""
    return next((d for d in demos() if d.model == model), None)


def preset_file(preset: str) -> Path | None:
    """The ``preset.toml`` that preset name ``preset`` (``demo``, ``demo-tools``, ...) names; None if no
    demo has that preset."""
    return next((d.preset_file for d in demos() if d.preset == preset), None)


def preset_names() -> list[str]:
    """The presets of the registered demos, sorted."""
    return sorted(d.preset for d in demos() if d.preset is not None)


def _check_own_metadata() -> None:
    """nanogrpo registers its own demos: no metadata, or metadata without the group, is a stale install."""
    try:
        own = metadata.distribution("nanogrpo")
    except metadata.PackageNotFoundError:
        raise InstallError("nanogrpo's package metadata is not installed (a source tree that was never "
                           f"pip-installed?): its demos are registered there; run {INSTALL_HINT}") from None
    if not any(ep.group == GROUP for ep in own.entry_points):
        raise InstallError(f"nanogrpo {own.version}'s installed metadata registers no demos (entry points "
                           f"{GROUP!r}): it predates this source tree; run {INSTALL_HINT} again")


def _check_unique(found: list[Demo]) -> None:
    """One owner per preset, data source and model name: a second would be shadowed, silently."""
    for what, names_of in (("preset", lambda d: [d.preset]), ("data source", lambda d: list(d.sources)),
                           ("model", lambda d: [d.model])):
        owner: dict[str, Demo] = {}
        for d in found:
            for v in names_of(d):
                if v is None:
                    continue
                if v in owner:
                    raise InstallError(f"demos {owner[v].package} ({owner[v].dist}) and {d.package} "
                                       f"({d.dist}) both register the {what} {v!r}: rename or uninstall one")
                owner[v] = d


def _read(ep: metadata.EntryPoint) -> Demo:
    dist = ep.dist.name if ep.dist is not None else "?"
    where = f"demo {ep.name!r} (entry point {GROUP} of {dist}: {ep.value})"
    if ep.attr:
        raise InstallError(f"{where}: name a package, not an object in it (mypkg.mytask, no ':')")
    try:
        module = importlib.import_module(ep.module)
    except Exception as e:  # a package not ours fails however it fails: say which, in one line
        text = str(e).strip().splitlines()
        raise InstallError(f"{where}: cannot be imported ({type(e).__name__}: {text[0] if text else ''}); "
                           f"fix it or uninstall {dist}") from None
    init = getattr(module, "__file__", None)
    if not hasattr(module, "__path__") or init is None:
        raise InstallError(f"{where}: not a package with an __init__.py (its folder holds task.py, "
                           "preset.toml, weights/)")
    preset, sources, model = (getattr(module, k, None) for k in ("PRESET", "SOURCES", "MODEL"))
    if preset is not None and (not isinstance(preset, str) or not preset):
        raise InstallError(f"{where}: PRESET must be a name (a string), got {preset!r}")
    sources = () if sources is None else sources
    if not isinstance(sources, (tuple, list)) or not all(isinstance(s, str) and s for s in sources):
        raise InstallError(f"{where}: SOURCES must be a tuple of names, got {sources!r}")
    if model is not None and (not isinstance(model, str) or not model or "/" in model
                              or model.startswith((".", "~"))):
        raise InstallError(f"{where}: MODEL must be a bare name (no '/', not a path), got {model!r}")
    return Demo(ep.name, ep.module, Path(init).parent, dist, preset, tuple(sources), model)
