"""The dialogue demo (``demo-dialogue``): a simulated customer orders an item, and gives its size only when
the model asks; the model must then say the order. Its warm start often ignores the reply (it orders the
default size); GRPO, rewarded for the right order, learns to read it. ``task``: the rows; ``env``: the
simulated customer; ``build``: the warm start."""
