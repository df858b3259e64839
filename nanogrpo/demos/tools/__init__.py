"""The tool demo (``demo-tools``): multi-digit arithmetic the tiny model gets wrong in its head; its
warm start sometimes calls the sandboxed Python tool; GRPO learns to reach for the tool.
``task``: the problems; ``build``: the warm start."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-tools"
"""``nanogrpo train --config demo-tools`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ("multidigit",)
"""The ``data.source`` names served by this folder's ``task.py``."""
MODEL = "embedded-tools"
"""The model path that loads this folder's ``weights/``."""
