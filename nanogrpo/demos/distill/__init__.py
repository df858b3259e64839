"""The distillation demo: the careless arithmetic student (``embedded``) learns from a teacher that writes the
answer its own ``<think>`` computed (``embedded-distill``, built by :mod:`nanogrpo.demos.distill.build`), with
the teacher's per-token log-probs as the only signal. Run: ``nanogrpo train --config demo-distill``."""
