"""The tool demo (``demo-tools``): multi-digit arithmetic the tiny model gets wrong in its head; its
warm start sometimes calls the sandboxed Python tool; GRPO learns to reach for the tool.
``task``: the problems; ``build``: the warm start."""
