"""Per-step metrics: one JSON object per line in ``RUN/metrics.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null means "not measured this step"
    return v


class MetricsWriter:
    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None:
            path.write_text("")
        self._f = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
