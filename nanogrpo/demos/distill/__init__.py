"""The distillation demo: the careless arithmetic student (``embedded``) learns from a teacher that writes the
answer its own ``<think>`` computed (``embedded-distill``, built by :mod:`nanogrpo.demos.distill.build`), with
the teacher's per-token log-probs as the only signal. Run: ``nanogrpo train --config demo-distill``."""

# What this demo provides, read by nanogrpo.entry_points (registered in pyproject.toml, entry points
# "nanogrpo.demos"): plain constants, nothing runs on import.
PRESET = "demo-distill"
"""``nanogrpo train --config demo-distill`` reads this folder's ``preset.toml``."""
SOURCES: tuple[str, ...] = ()
"""No ``data.source`` of its own (no ``task.py``): it trains on the default demo's rows,
``arithmetic``."""
MODEL = "embedded-distill"
"""The model path that loads this folder's ``weights/`` (the teacher:
``distill.teacher = "embedded-distill"``)."""
