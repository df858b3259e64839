"""The run monitor: rules over each step's metrics that flag reward hacking, collapse and engine drift
while a run trains (``[watch]``, on by default; docs/guides/watching-a-run.md).

- :mod:`~nanogrpo.watch.history`: the series the rules read;
- :mod:`~nanogrpo.watch.rules`: the rules, pure functions in :data:`RULES`;
- :mod:`~nanogrpo.watch.monitor`: the monitor the training loop calls after every step (screen line,
  ``watch/<rule>`` metrics, ``RUN/watch.jsonl``, ``watch.stop_on``), and :func:`replay` over a finished
  run's rows;
- :mod:`~nanogrpo.watch.figures`: what ``nanogrpo report`` draws of an event.
"""

from nanogrpo.watch.history import History
from nanogrpo.watch.monitor import WATCH_FILE, Monitor, read_events, replay, stop_now, summary
from nanogrpo.watch.rules import RULES, Finding

__all__ = ["RULES", "WATCH_FILE", "Finding", "History", "Monitor", "read_events", "replay", "stop_now",
           "summary"]
