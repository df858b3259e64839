"""The vision demo: read a three-digit number drawn in a small picture (a tiny Qwen2-VL)."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-vision"
"""``nanogrpo train --config demo-vision`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ("vision",)
"""The ``data.source`` names served by this folder's ``task.py``."""
MODEL = "embedded-vision"
"""The model path that loads this folder's ``weights/``."""
