"""The learned-reward demo (``demo-rm``): the default demo's task and warm start with a reward model
as the only reward. ``build``: the reward model (``rm:embedded-rm``), a classifier fine-tuned on the
warm start's own completions, labelled by the rule reward. Its task is
:mod:`nanogrpo.demos.arithmetic.task`."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-rm"
"""``nanogrpo train --config demo-rm`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ()
"""No ``data.source`` of its own (no ``task.py``): it trains on the default demo's rows,
``arithmetic``."""
MODEL = "embedded-rm"
"""The model path that loads this folder's ``weights/`` (the reward model: ``rm:embedded-rm``)."""
