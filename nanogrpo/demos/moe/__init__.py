"""The mixture-of-experts demo (``demo-moe``): the default demo's task and careless-solver warm start on a
small Qwen3-MoE model (4 layers of 8 experts, top 2), trained with routing replay (R3: the hf engine records
the experts every token went to, the trainer's forwards replay them). ``build``: the warm start. Its task is
:mod:`nanogrpo.demos.arithmetic.task`. Run: ``nanogrpo train --config demo-moe``."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-moe"
"""``nanogrpo train --config demo-moe`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ()
"""No ``data.source`` of its own (no ``task.py``): it trains on the default demo's rows,
``arithmetic``."""
MODEL = "embedded-moe"
"""The model path that loads this folder's ``weights/``."""
