"""The learned-reward demo (``demo-rm``): the default demo's task and warm start with a reward model
as the only reward. ``build``: the reward model (``rm:embedded-rm``), a classifier fine-tuned on the
warm start's own completions, labelled by the rule reward. Its task is
:mod:`nanogrpo.demos.arithmetic.task`."""
