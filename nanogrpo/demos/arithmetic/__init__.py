"""The default demo (``nanogrpo train``): one-step word problems; a warm start that writes the right
equation and often the wrong number; GRPO with the rule reward lifts held-out accuracy from 7% to
about 50% on a 2-core CPU in minutes. ``task``: the problems; ``build``: the warm start."""
