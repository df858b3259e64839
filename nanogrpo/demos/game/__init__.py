"""The game demo (``demo-game``): guess the number with higher/lower feedback, over several turns. Its warm
start often ignores the feedback (it guesses 1, 2, 3, ... whatever it is told); GRPO, rewarded only for
finding the number, learns to use the feedback (a binary search). ``task``: the episodes' rows; ``env``:
the game; ``build``: the warm start."""
