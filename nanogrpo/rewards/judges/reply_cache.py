"""The judge's reply cache: one row per distinct request, so none is paid for twice.

Keyed by a SHA-256 of the request as sent (model, messages, sampling fields; never the URL or the API
key), it holds the reply's text and token counts. In a run directory it is a SQLite file
(``RUN/judge_cache.sqlite``), so a resumed run replays its judged steps without calling the server;
elsewhere (a rollout worker, ``nanogrpo eval``) it lives in memory unless ``rewards.judge_cache``
names a file. Only replies the server gave in full are stored (an error is asked again next time).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Reply", "ReplyCache", "NullCache", "request_key"]


class Reply(NamedTuple):
    content: str
    prompt_tokens: int
    completion_tokens: int


def request_key(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class ReplyCache:
    """A SQLite table of replies (``path`` None: in memory). Safe to share between threads."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            where = str(self.path) if self.path is not None else ":memory:"
            db = sqlite3.connect(where, check_same_thread=False)
            db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, content TEXT NOT NULL, "
                       "prompt_tokens INTEGER, completion_tokens INTEGER)")
            db.commit()
            self._db = db
        return self._db

    def get_many(self, keys: list[str]) -> dict[str, Reply]:
        out: dict[str, Reply] = {}
        with self._lock:
            db = self._conn()
            for i in range(0, len(keys), 500):
                part = keys[i:i + 500]
                marks = ",".join("?" * len(part))
                query = ("SELECT key, content, prompt_tokens, completion_tokens FROM replies "
                         f"WHERE key IN ({marks})")
                for key, content, pt, ct in db.execute(query, part):
                    out[key] = Reply(content, pt or 0, ct or 0)
        return out

    def put_many(self, replies: dict[str, Reply]) -> None:
        if not replies:
            return
        with self._lock:
            db = self._conn()
            db.executemany("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?)",
                           [(k, r.content, r.prompt_tokens, r.completion_tokens) for k, r in replies.items()])
            db.commit()

    def __len__(self) -> int:
        with self._lock:
            return self._conn().execute("SELECT COUNT(*) FROM replies").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class NullCache(ReplyCache):
    """``rewards.judge_cache=off``: nothing kept between batches (identical rows of one batch still share
    one request)."""

    def get_many(self, keys: list[str]) -> dict[str, Reply]:
        return {}

    def put_many(self, replies: dict[str, Reply]) -> None:
        return None

    def __len__(self) -> int:
        return 0
