"""Where samples come from: presets, local files and HF datasets.

``load_rows(cfg, split)`` dispatches on ``cfg.source``:

- ``gsm8k``: HF ``openai/gsm8k`` (config ``main``), answer after ``####`` (the
  seed's dataset). Offline, point ``source`` at a local copy in the same format
  and set ``answer_delimiter="####"``.
- ``arithmetic``: the embedded synthetic task (:mod:`nanogrpo.data.arithmetic`);
  split ``train`` has ``arithmetic_train_size`` rows, any other split
  (``test``/``eval``/``validation``) ``arithmetic_eval_size`` held-out rows.
- ``multidigit``: the tool demo's multi-digit arithmetic (:mod:`nanogrpo.data.multidigit`),
  sized by the same two settings.
- a file, by extension: ``.jsonl``, ``.json`` (a list of objects or
  ``{"data": [...]}``), ``.parquet`` (pyarrow), ``.csv``. ``split`` is ignored
  unless the path contains ``{split}``, which is replaced by it.
- ``hf:NAME``: ``datasets.load_dataset(NAME, cfg.hf_config, split=split)``.

``datasets`` and ``pyarrow`` are optional (``pip install nanogrpo[data]``) and
imported only when a source needs them. Every failure is a one-line
:class:`~nanogrpo.errors.DataError` naming the source and the problem.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from nanogrpo import hub
from nanogrpo.config import DataConfig
from nanogrpo.data import arithmetic, multidigit
from nanogrpo.data.samples import normalize_rows
from nanogrpo.errors import DataError

GSM8K = ("openai/gsm8k", "main", "####")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- file readers


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"data file {path} line {lineno}: malformed JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"data file {path} line {lineno}: expected a JSON object, got "
                                f"{type(obj).__name__}")
            rows.append(obj)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"data file {path}: malformed JSON at line {e.lineno} ({e.msg})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"data file {path}: expected a list of objects or {{\"data\": [...]}}, got "
                        f"{type(obj).__name__}")
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            raise DataError(f"data file {path}: item {i} is a {type(item).__name__}, expected an object")
    return obj


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data file {path}: reading parquet needs pyarrow "
                        f"(pip install 'nanogrpo[data]')") from None
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"data file {path}: unreadable parquet ({_first_line(e)})") from None


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8", newline="") as f:
        try:
            return [dict(r) for r in csv.DictReader(f)]
        except csv.Error as e:
            raise DataError(f"data file {path}: malformed CSV ({_first_line(e)})") from None


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}


def read_file(path: Path) -> list[dict[str, Any]]:
    """Raw rows of a local data file, chosen by extension."""
    suffix = path.suffix.lower()
    if suffix not in READERS:
        raise DataError(f"data file {path}: unknown extension {path.suffix!r} "
                        f"(use {', '.join(FILE_SUFFIXES)})")
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    try:
        return READERS[suffix](path)
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path}: not UTF-8 text ({_first_line(e)})") from None
    except OSError as e:
        raise DataError(f"data file {path}: unreadable ({_first_line(e)})") from None


# ----------------------------------------------------------------------------- HF datasets


def read_hf(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Raw rows of an HF dataset (needs the optional ``datasets`` package)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"HF dataset {name}: needs the 'datasets' package (pip install 'nanogrpo[data]'), "
                        f"or point data.source at a local .jsonl/.parquet copy") from None
    _reachable(name)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # any failure here (network, auth, bad name or split) is the user's to fix
        raise DataError(f"HF dataset {name} (config {config}, split {split}) unreachable: "
                        f"{_first_line(e)}") from None
    return [dict(r) for r in ds]


def _reachable(name: str) -> None:
    """A DataError in seconds when the hub cannot be reached for dataset ``name`` (``datasets`` would
    retry for about a minute first). Not asked offline (``HF_HUB_OFFLINE``: the datasets cache) nor
    for a local directory; any answer from the hub, even a refusal, is left to ``datasets``."""
    if Path(name).exists() or hub.offline():
        return
    from huggingface_hub import HfApi
    from huggingface_hub.utils import HfHubHTTPError

    try:
        hub.ask(lambda: HfApi().dataset_info(name, timeout=hub.TIMEOUT_S))
    except HfHubHTTPError:
        return
    except hub.network_errors() as e:
        raise DataError(f"HF dataset {name}: the HF hub ({hub.endpoint()}) cannot be reached "
                        f"({hub.reason(e)}): point data.source at a local .jsonl/.parquet copy, or set "
                        "HF_HUB_OFFLINE=1 to read the datasets cache") from None


# ----------------------------------------------------------------------------- dispatch


def _arithmetic_rows(cfg: DataConfig, split: str, task=arithmetic) -> list[dict[str, Any]]:
    if split == "train":
        return task.make_split("train", cfg.arithmetic_train_size)
    if split in ("test", "eval", "validation"):
        return task.make_split("test", cfg.arithmetic_eval_size)
    raise DataError(f"data source {cfg.source} has no split {split!r} (use train or test)")


def load_rows(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """Load and validate all samples of ``split`` from ``cfg.source`` (see module docstring)."""
    source = cfg.source
    fields = {"question_field": cfg.question_field, "answer_field": cfg.answer_field}
    if source == "arithmetic":
        return _arithmetic_rows(cfg, split)
    if source == "multidigit":
        return _arithmetic_rows(cfg, split, multidigit)
    if source == "gsm8k":
        name, config, delim = GSM8K
        rows = read_hf(name, cfg.hf_config or config, split)
        return normalize_rows(rows, origin=f"gsm8k ({name}, split {split})", **fields,
                              answer_delimiter=cfg.answer_delimiter or delim)
    if source.startswith("hf:"):
        name = source[3:]
        if not name:
            raise DataError("data.source 'hf:' needs a dataset name, e.g. hf:openai/gsm8k")
        rows = read_hf(name, cfg.hf_config, split)
        return normalize_rows(rows, origin=f"HF dataset {name} (split {split})", **fields,
                              answer_delimiter=cfg.answer_delimiter)
    path = Path(source.replace("{split}", split))
    if path.suffix.lower() not in READERS:
        raise DataError(f"unknown data source {source!r}: use a preset (gsm8k, arithmetic, multidigit), a "
                        f"{'/'.join(FILE_SUFFIXES)} file, or hf:NAME")
    return normalize_rows(read_file(path), origin=f"data file {path}", **fields,
                          answer_delimiter=cfg.answer_delimiter)


def samples_from(rows: list[dict[str, Any]], cfg: DataConfig, origin: str) -> list[dict[str, Any]]:
    """Samples from rows already in memory (the public API's ``dataset``), checked as a file's are."""
    return normalize_rows(rows, origin=origin, question_field=cfg.question_field,
                          answer_field=cfg.answer_field, answer_delimiter=cfg.answer_delimiter)
