"""The dialogue demo (``demo-dialogue``): a simulated user asks for a word transformed, replies to the
model's answer (agreeing, or correcting it) and asks for one more change. Its warm start often ignores the
reply (it says its first answer again); GRPO, rewarded for what the user wanted, learns to read the reply.
``task``: the rows; ``env``: the simulated user; ``build``: the warm start."""
