"""Episodes: an engine's model playing against environments (:mod:`nanogrpo.envs`), turn by turn.

- :mod:`.play`: episodes with a reset/step environment: nanogrpo drives the turns (the model samples,
  the environment answers); :class:`~nanogrpo.episodes.play.Episodes` is what a run builds from ``[env]``;
- :mod:`.agents`: episodes of agent programs, which drive themselves and call the model through
  :mod:`.endpoint` (an OpenAI-compatible server on 127.0.0.1);
- :mod:`.render`: chat messages to token ids (the first observation as the prompt, each later one fed);
- :mod:`.trajectory`: what an agent's requests come to as training sequences.

:mod:`nanogrpo.envs` is the other side of the line: what an environment is, where one comes from and how
its methods are called (:class:`~nanogrpo.envs.runner.EnvRunner`: concurrency, deadlines, failures as
outcomes); it knows no tokens, engines or training. Everything here that calls an environment goes
through that runner.
"""
