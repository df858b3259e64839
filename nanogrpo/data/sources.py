"""Where samples come from: presets, local files and HF datasets.

``load_rows(cfg, split)`` dispatches on ``cfg.source`` (``load_eval_rows`` on
``cfg.eval_source``, else the same):

- a preset (:data:`PRESETS`), an HF dataset with its own field names and reference:
  ``gsm8k`` (``openai/gsm8k``, config ``main``, the answer after ``####``: the
  seed's dataset); ``math`` (MATH, ``DigitalLearningGmbH/MATH-lighteval``: 7,500
  train / 5,000 test problems, the reference boxed in the ``solution``);
  ``math500`` (``HuggingFaceH4/MATH-500``, its ``answer`` column; test only);
  ``aime24`` (``HuggingFaceH4/aime_2024``, 30 problems) and ``aime``
  (``AI-MO/aimo-validation-aime``, 90 problems of AIME 2022-2024), integer
  ``answer``, any split name reads their only split; ``deepscaler``
  (``agentica-org/DeepScaleR-Preview-Dataset``, 40k problems, ``answer``; train
  only). Offline, point ``source`` at a local copy in the same format (the
  reference is found as ``data.answer_from=auto`` finds it).
- a demo's task, by the name its package registers (:mod:`nanogrpo.entry_points`; this module imports
  no demo): ``arithmetic``, the default demo's word problems (``nanogrpo/demos/arithmetic/task.py``);
  ``multidigit``, the tool demo's; ``game``, ``dialogue``, the rows that start the multi-turn demos'
  episodes (played with an environment, ``[env]``); ``vision``; and any installed package's own.
  The task's ``make_split`` makes the rows: split ``train`` has ``generated_train_size`` rows, any
  other split (``test``/``eval``/``validation``) ``generated_eval_size`` held-out rows.
- a file, by extension: ``.jsonl``, ``.json`` (a list of objects or
  ``{"data": [...]}``), ``.parquet`` (pyarrow), ``.csv``. ``split`` is ignored
  unless the path contains ``{split}``, which is replaced by it.
- ``verifiers:...``: a verifiers 0.4 taskset's own tasks (:mod:`nanogrpo.envs.adapters.verifiers_v1.tasks`),
  sized by the same two settings.
- ``hf:NAME``: ``datasets.load_dataset(NAME, cfg.hf_config, split=split)``, with
  ``cfg.question_field`` / ``cfg.answer_field`` / ``cfg.answer_from``.

``datasets`` and ``pyarrow`` are optional (``pip install nanogrpo[data]``) and
imported only when a source needs them. Every failure is a one-line
:class:`~nanogrpo.errors.DataError` naming the source and the problem.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from nanogrpo import entry_points, hub
from nanogrpo.config import DataConfig
from nanogrpo.data.samples import normalize_rows
from nanogrpo.errors import DataError


@dataclass(frozen=True)
class Preset:
    """An HF dataset by a short name: where it is and how its rows are read."""

    name: str
    config: str | None
    question_field: str
    answer_field: str
    answer_from: str
    splits: dict[str, str] = field(default_factory=lambda: {"train": "train", "test": "test"})
    """The split asked for -> the dataset's split (a split not listed is an error)."""
    delimiter: str | None = None


_ONLY_SPLIT = {s: "train" for s in ("train", "test", "eval", "validation")}
PRESETS: dict[str, Preset] = {
    "gsm8k": Preset("openai/gsm8k", "main", "question", "answer", "delimiter", delimiter="####"),
    "math": Preset("DigitalLearningGmbH/MATH-lighteval", "default", "problem", "solution", "boxed"),
    "math500": Preset("HuggingFaceH4/MATH-500", None, "problem", "answer", "column",
                      {s: "test" for s in ("test", "eval", "validation")}),
    "aime24": Preset("HuggingFaceH4/aime_2024", None, "problem", "answer", "column", _ONLY_SPLIT),
    "aime": Preset("AI-MO/aimo-validation-aime", None, "problem", "answer", "column", _ONLY_SPLIT),
    "deepscaler": Preset("agentica-org/DeepScaleR-Preview-Dataset", None, "problem", "answer", "column",
                         {"train": "train"}),
}
"""Competition math and GSM8K by name (module docstring); each reads its dataset's own fields."""
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
    try:  # a HEAD: nothing of the answer's body is read (a GET's JSON would be read without a cap)
        hub.ask(lambda: hub.head(f"{hub.endpoint()}/api/datasets/{name}"))
    except hub.network_errors() as e:
        raise DataError(f"HF dataset {name}: the HF hub ({hub.endpoint()}) cannot be reached "
                        f"({hub.reason(e)}): point data.source at a local .jsonl/.parquet copy, or set "
                        "HF_HUB_OFFLINE=1 to read the datasets cache") from None


# ----------------------------------------------------------------------------- dispatch


def _task_rows(cfg: DataConfig, split: str, source: str, task: ModuleType) -> list[dict[str, Any]]:
    """A demo task's rows (its ``make_split(split, n)``), sized by the ``generated_*_size`` settings."""
    make_split = getattr(task, "make_split", None)
    if not callable(make_split):
        raise DataError(f"data source {source}: its task module {task.__name__} has no make_split(split, n)")
    if split == "train":
        return make_split("train", cfg.generated_train_size)
    if split in ("test", "eval", "validation"):
        return make_split("test", cfg.generated_eval_size)
    raise DataError(f"data source {source} has no split {split!r} (use train or test)")


def _preset_rows(cfg: DataConfig, source: str, split: str) -> list[dict[str, Any]]:
    p = PRESETS[source]
    if split not in p.splits:
        raise DataError(f"data source {source} has no split {split!r} (it has: {', '.join(p.splits)})")
    name = p.name
    rows = read_hf(name, cfg.hf_config or p.config, p.splits[split])
    # gsm8k's fields are the defaults: a config may rename them (an earlier nanogrpo's way to use a copy)
    question, answer = ((cfg.question_field, cfg.answer_field) if source == "gsm8k"
                        else (p.question_field, p.answer_field))
    return normalize_rows(rows, origin=f"{source} ({name}, split {p.splits[split]})", question_field=question,
                          answer_field=answer, answer_delimiter=cfg.answer_delimiter or p.delimiter,
                          answer_from=p.answer_from)


def load_rows(cfg: DataConfig, split: str, source: str | None = None) -> list[dict[str, Any]]:
    """Load and validate all samples of ``split`` from ``source`` (default: ``cfg.source``; see the module
    docstring); rows with images (``data.image_field``) have them read and checked here, at start
    (:func:`nanogrpo.data.images.check_rows`)."""
    source = source or cfg.source
    rows = _load_rows(cfg, split, source)
    path = Path(source.replace("{split}", split))
    base = path.parent if path.suffix.lower() in READERS else None
    return with_images(rows, cfg, f"data source {source} (split {split})", base)


def with_images(rows: list[dict[str, Any]], cfg: DataConfig, origin: str,
                base: Path | None = None) -> list[dict[str, Any]]:
    """``rows`` with their images opened and checked, when any row has some (one line naming the row
    otherwise)."""
    if any(r.get(cfg.image_field) is not None for r in rows):
        from nanogrpo.data.images import check_rows

        check_rows(rows, cfg.image_field, cfg.image_placeholder, cfg.max_image_pixels or 28 * 28 * 1280,
                   origin, base)
    return rows


def _load_rows(cfg: DataConfig, split: str, source: str) -> list[dict[str, Any]]:
    fields = {"question_field": cfg.question_field, "answer_field": cfg.answer_field,
              "answer_delimiter": cfg.answer_delimiter, "answer_from": cfg.answer_from}
    if source in PRESETS:
        return _preset_rows(cfg, source, split)
    if source.startswith("verifiers:"):  # a verifiers 0.4 taskset's own tasks
        from nanogrpo.envs.adapters.verifiers_v1.tasks import split_rows

        return split_rows(source[len("verifiers:"):], split, cfg.generated_train_size,
                          cfg.generated_eval_size)
    if source.startswith("hf:"):
        name = source[3:]
        if not name:
            raise DataError("data.source 'hf:' needs a dataset name, e.g. hf:openai/gsm8k")
        rows = read_hf(name, cfg.hf_config, split)
        return normalize_rows(rows, origin=f"HF dataset {name} (split {split})", **fields)
    path = Path(source.replace("{split}", split))
    if path.suffix.lower() in READERS:  # a file: the registry is not asked
        return normalize_rows(read_file(path), origin=f"data file {path}", **fields)
    task = entry_points.task_module(source)
    if task is not None:
        return _task_rows(cfg, split, source, task)
    demos = ", ".join(entry_points.source_names())
    raise DataError(f"unknown data source {source!r}: use a preset ({', '.join(PRESETS)}), a demo's task "
                    f"({demos}), a {'/'.join(FILE_SUFFIXES)} file, or hf:NAME")


def load_eval_rows(cfg: DataConfig, split: str | None = None) -> list[dict[str, Any]]:
    """The held-out problems: ``split`` (default ``cfg.eval_split``) of ``cfg.eval_source``, else of
    ``cfg.source``."""
    return load_rows(cfg, split or cfg.eval_split, cfg.eval_source)


def held_out_file_is_training_file(cfg: DataConfig) -> Path | None:
    """The file that ``load_rows`` would read for both the training split (``cfg.split`` of ``cfg.source``)
    and the held-out one (``cfg.eval_split`` of ``cfg.eval_source``, else ``cfg.source``): a single file
    (no ``{split}`` in its path) gives the same rows to both. None when they differ or are not files."""
    def path(source: str | None, split: str) -> Path | None:
        if source is None or source in PRESETS or source.startswith(("hf:", "verifiers:")):
            return None
        p = Path(source.replace("{split}", split))
        return p if p.suffix.lower() in READERS else None

    train, held = path(cfg.source, cfg.split), path(cfg.eval_source or cfg.source, cfg.eval_split)
    if train is None or held is None:
        return None
    return train if train.resolve() == held.resolve() else None


def samples_from(rows: list[dict[str, Any]], cfg: DataConfig, origin: str) -> list[dict[str, Any]]:
    """Samples from rows already in memory (the public API's ``dataset``), checked as a file's are."""
    return with_images(normalize_rows(rows, origin=origin, question_field=cfg.question_field,
                                      answer_field=cfg.answer_field, answer_delimiter=cfg.answer_delimiter,
                                      answer_from=cfg.answer_from), cfg, origin)
