"""The default demo (``nanogrpo train``): one-step word problems; a warm start that writes the right
equation and often the wrong number; GRPO with the rule reward lifts held-out accuracy from 7% to
about 50% on a 2-core CPU in minutes. ``task``: the problems; ``build``: the warm start."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo"
"""``nanogrpo train --config demo`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ("arithmetic",)
"""The ``data.source`` names served by this folder's ``task.py``."""
MODEL = "embedded"
"""The model path that loads this folder's ``weights/``."""
