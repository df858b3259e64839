"""What makes a training batch: :mod:`.collect` (sample a group per prompt, score it, the advantages, the
batch) and :mod:`.turns` (multi-turn rollouts with a tool). The engines that generate are
:mod:`nanogrpo.engines`; episodes with an environment or an agent program, :mod:`nanogrpo.episodes`."""
