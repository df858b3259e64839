"""The dialogue demo (``demo-dialogue``): a simulated customer orders an item, and gives its size only when
the model asks; the model must then say the order. Its warm start often ignores the reply (it orders the
default size); GRPO, rewarded for the right order, learns to read it. ``task``: the rows; ``env``: the
simulated customer; ``build``: the warm start."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-dialogue"
"""``nanogrpo train --config demo-dialogue`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ("dialogue",)
"""The ``data.source`` names served by this folder's ``task.py``."""
MODEL = "embedded-dialogue"
"""The model path that loads this folder's ``weights/``."""
