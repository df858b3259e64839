"""The game demo (``demo-game``): guess the number with higher/lower feedback, over several turns. Its warm
start often ignores the feedback (it guesses 1, 2, 3, ... whatever it is told); GRPO, rewarded only for
finding the number, learns to use the feedback (a binary search). ``task``: the episodes' rows; ``env``:
the game; ``build``: the warm start."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-game"
"""``nanogrpo train --config demo-game`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ("game",)
"""The ``data.source`` names served by this folder's ``task.py``."""
MODEL = "embedded-game"
"""The model path that loads this folder's ``weights/``."""
