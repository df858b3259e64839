"""A trainer rank's inbox: the batches it took from the server, kept on disk until a checkpoint covers them.

The hand-off of one delivery, exactly once between server and trainer::

    1. write it to RUN/inbox/rankR/ as *pending* (the bytes of a batch to train on; only the id and
       the reason for one it drops as stale or invalid), fsynced
    2. acknowledge its lease to the server
    3. acked -> commit (an atomic rename); lost (the lease ran out and another rank has the batch)
       -> delete; server restarted since (its queue is gone, nobody else gets the batch) -> commit

A rank killed between 1 and 3 leaves a pending entry; the next start settles it by acknowledging
again (acknowledgements are idempotent on the server) before anything else.

Exactly once relative to checkpoints: entries stay until a checkpoint covers their step. A run
resumed from checkpoint ``s`` replays steps ``s+1, ...`` from its inbox, the same batches in the
same order with the staleness they had, and only then takes new ones. So a batch the server handed
over is neither lost with the steps a crash discards nor trained on twice in the run's history,
and a resumed run repeats the metrics of those steps. Each rank replays its own inbox: resume with
the same number of ranks (with more, the new ones start fetching; with fewer, the missing ranks'
batches are not replayed). The inbox holds at most ``train.save_every`` steps of batches per rank
(with ``save_every = 0``, the whole run); on several machines the run directory must be shared, as
for checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from nanogrpo.training.checkpoint import fsync_dir

log = logging.getLogger("nanogrpo.train.server")

_NAME = re.compile(r"(\d{9})-(\d{4})\.(json|pending|batch)")
TRAIN = "train"
"""The action of the one entry per step and rank that the step trains on (others: ``stale``, ``invalid``)."""


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Inbox:
    def __init__(self, root: Path, rank: int, fresh: bool):
        """``root`` is ``RUN/inbox``; ``fresh`` (a run that does not resume) empties this rank's inbox."""
        self.dir = Path(root) / f"rank{rank}"
        if fresh and self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _stem(self, step: int, n: int) -> str:
        return f"{step:09d}-{n:04d}"

    def _files(self, kind: str) -> list[tuple[int, int, Path]]:
        out = []
        for p in self.dir.iterdir():
            m = _NAME.fullmatch(p.name)
            if m and m.group(3) == kind:
                out.append((int(m.group(1)), int(m.group(2)), p))
        return sorted(out)

    # ------------------------------------------------------------------ hand-off
    def hand_off(self, client, entry: dict[str, Any], lease: str, body: bytes | None) -> bool:
        """Steps 1-3 above for one delivery; True when the batch is ours (committed), False when it was
        lost to another consumer (nothing kept). ``entry`` holds ``step``, ``n``, ``id`` and ``action``."""
        stem = self._stem(entry["step"], entry["n"])
        if body is not None:
            _write(self.dir / f"{stem}.batch", body)
        _write(self.dir / f"{stem}.pending", json.dumps({**entry, "lease": lease}).encode())
        fsync_dir(self.dir)
        return self._settle(client, self.dir / f"{stem}.pending")

    def _settle(self, client, pending: Path) -> bool:
        entry = json.loads(pending.read_text())
        answer = client.ack(entry["lease"])
        stem = pending.name[:-len(".pending")]
        if answer == "lost":
            (self.dir / f"{stem}.batch").unlink(missing_ok=True)
            pending.unlink()
            fsync_dir(self.dir)
            log.warning("batch %s went to another consumer before it was acknowledged (its lease ran out); "
                        "dropped here", entry["id"])
            return False
        os.replace(pending, self.dir / f"{stem}.json")
        fsync_dir(self.dir)
        return True

    def settle_pending(self, client) -> int:
        """Settle the hand-offs a killed run left half done; return how many became ours."""
        return sum(self._settle(client, p) for _, _, p in self._files("pending"))

    # ------------------------------------------------------------------ replay
    def entries(self, step: int) -> list[dict[str, Any]]:
        """The committed entries of ``step``, in the order they were taken."""
        return [json.loads(p.read_text()) for s, _, p in self._files("json") if s == step]

    def next_n(self, step: int) -> int:
        ns = [n for s, n, _ in self._files("json") + self._files("pending") if s == step]
        return max(ns) + 1 if ns else 0

    def read(self, entry: dict[str, Any]) -> bytes:
        return (self.dir / f"{self._stem(entry['step'], entry['n'])}.batch").read_bytes()

    def last_step(self) -> int:
        steps = [s for s, _, _ in self._files("json")]
        return max(steps) if steps else 0

    def prune(self, upto_step: int) -> None:
        """Forget the entries a checkpoint at ``upto_step`` covers."""
        for kind in ("json", "batch"):
            for s, _, p in self._files(kind):
                if s <= upto_step:
                    p.unlink(missing_ok=True)
