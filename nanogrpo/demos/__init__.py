"""The demos: small tasks that learn on a 2-core CPU, one folder each, to read and to copy.

A demo's folder holds everything that makes it:

    demos/NAME/
      task.py       the task: rows generated in code (train and held-out splits), or an environment
      build.py      the program that builds its warm start (or reward model) from scratch, offline
      weights/      what build.py made, shipped with the package (a few MB)
      preset.toml   the run: ``nanogrpo train --config demo-NAME``

``arithmetic`` is the default demo (preset ``demo``, model ``embedded``); every other folder's
preset is ``demo-NAME`` and its weights load as model ``embedded-NAME`` (``rm`` ships a reward
model: ``rm:embedded-rm``). This module only finds the folders (no demo is imported here): a
task module imports nothing above ``nanogrpo.errors``; a builder may import anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT = "arithmetic"
"""The demo ``nanogrpo train`` runs with no arguments (preset ``demo``, model ``embedded``)."""
EMBEDDED = "embedded"


def root() -> Path:
    return Path(str(resources.files("nanogrpo") / "demos"))


def names() -> list[str]:
    """The demos shipped (folders with a ``preset.toml``), sorted."""
    return sorted(p.name for p in root().iterdir() if (p / "preset.toml").is_file())


def preset_name(name: str) -> str:
    """The preset that runs demo ``name``: ``demo`` for the default one, else ``demo-NAME``."""
    return "demo" if name == DEFAULT else f"demo-{name}"


def preset_file(preset: str) -> Path | None:
    """The ``preset.toml`` of the demo a preset name (``demo``, ``demo-tools``, ...) runs; None if
    no demo has that preset."""
    for name in names():
        if preset_name(name) == preset:
            return root() / name / "preset.toml"
    return None


def model_name(name: str) -> str:
    """The model path a demo's shipped weights load by: ``embedded`` or ``embedded-NAME``."""
    return EMBEDDED if name == DEFAULT else f"{EMBEDDED}-{name}"


def weights_dir(model: str) -> Path | None:
    """The shipped weights a model path names (``embedded``, ``embedded-tools``, ``embedded-rm``, ...);
    None if ``model`` names no demo."""
    if model == EMBEDDED:
        return root() / DEFAULT / "weights"
    prefix = f"{EMBEDDED}-"
    if model.startswith(prefix) and "/" not in model:
        name = model[len(prefix):]
        if name and name != DEFAULT and (root() / name).is_dir():
            return root() / name / "weights"
    return None
