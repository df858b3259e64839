"""Tests for nanogrpo.data: sources, samples, the arithmetic task, prompts and the sampler."""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.config import DataConfig
from nanogrpo.data import PromptSampler, build_messages, encode_prompts, load_rows, render_prompt
from nanogrpo.demos.arithmetic.task import make_split, solution
from nanogrpo.errors import DataError, ModelError
from nanogrpo.models.tiny import make_tokenizer

ROWS = [
    {"question": "What is 2+3?", "answer": "5", "level": 1},
    {"question": "What is 7*6?", "answer": "42", "level": 2},
    {"question": "What is 9-4?", "answer": "5", "level": 1},
]


def _write(path: Path, rows: list[dict], fmt: str) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "json-data":
        path.write_text(json.dumps({"data": rows}))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def _cfg(source: str | Path, **kw) -> DataConfig:
    return DataConfig(source=str(source), **kw)


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("fmt,ext", [("jsonl", "jsonl"), ("json", "json"), ("json-data", "json"),
                                     ("parquet", "parquet"), ("csv", "csv")])
def test_file_formats_round_trip(tmp_path, fmt, ext):
    path = _write(tmp_path / f"d.{ext}", ROWS, fmt)
    samples = load_rows(_cfg(path), "train")
    assert [s["question"] for s in samples] == [r["question"] for r in ROWS]
    assert [s["answer"] for s in samples] == ["5", "42", "5"]
    assert [s["id"] for s in samples] == ["0", "1", "2"]
    level = [s["level"] for s in samples]
    assert level == (["1", "2", "1"] if fmt == "csv" else [1, 2, 1])  # every column kept


def test_split_placeholder_and_id_column(tmp_path):
    _write(tmp_path / "train.jsonl", [{"id": "a7", "question": "q", "answer": 3}], "jsonl")
    _write(tmp_path / "test.jsonl", [{"id": 9, "question": "t", "answer": "4"}], "jsonl")
    cfg = _cfg(tmp_path / "{split}.jsonl")
    assert load_rows(cfg, "train")[0]["id"] == "a7"
    test = load_rows(cfg, "test")[0]
    assert (test["id"], test["question"], test["answer"]) == ("9", "t", "4")
    # without {split} the split argument is ignored
    assert load_rows(_cfg(tmp_path / "train.jsonl"), "test")[0]["question"] == "q"


def test_gsm8k_delimiter_on_local_file(tmp_path):
    rows = [
        {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = <<48/2=24>>24.\n#### 72"},
        {"question": "Weng earns $12...", "answer": "12/60 = 0.2 #### x #### 10 "},
    ]
    path = _write(tmp_path / "gsm8k.jsonl", rows, "jsonl")
    samples = load_rows(_cfg(path, answer_delimiter="####"), "train")
    assert [s["answer"] for s in samples] == ["72", "10"]
    assert samples[0]["answer_raw"] == rows[0]["answer"]


def test_custom_field_names(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"problem": "p", "solution": "s"}], "jsonl")
    s = load_rows(_cfg(path, question_field="problem", answer_field="solution"), "train")[0]
    assert (s["question"], s["answer"], s["problem"]) == ("p", "s", "p")


def test_chat_rows(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
         "answer": "4"},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3+3?"}],
         "answer": "6"},
    ]
    samples = load_rows(_cfg(_write(tmp_path / "c.jsonl", rows, "jsonl")), "train")
    assert samples[0]["question"] == "2+2?"
    # the trailing assistant turn (the answer) is dropped
    assert [t["role"] for t in samples[0]["messages"]] == ["user", "assistant", "user"]
    assert samples[1]["question"] == "3+3?"
    msgs = build_messages(samples[1], "default system", [])
    assert msgs == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "3+3?"}]
    msgs = build_messages(samples[0], "sys", [{"question": "1+1?", "answer": "2"}])
    assert [m["content"] for m in msgs] == ["sys", "1+1?", "2", "hi", "hello", "2+2?"]
    sft = {"question": "q",
           "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert build_messages(sft, "", []) == [{"role": "user", "content": "q"}]  # never leaks the answer turn


def test_chat_rows_from_csv_json_text(tmp_path):
    rows = [{"messages": json.dumps([{"role": "user", "content": "5+1?"}]), "answer": "6"}]
    s = load_rows(_cfg(_write(tmp_path / "c.csv", rows, "csv")), "train")[0]
    assert s["question"] == "5+1?" and s["messages"] == [{"role": "user", "content": "5+1?"}]


def test_arithmetic_source():
    cfg = DataConfig(source="arithmetic", generated_train_size=50, generated_eval_size=20)
    assert len(load_rows(cfg, "train")) == 50
    assert len(load_rows(cfg, "test")) == 20
    with pytest.raises(DataError, match="no split"):
        load_rows(cfg, "dev")


# ----------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*nope\.jsonl"):
        load_rows(_cfg(tmp_path / "nope.jsonl"), "train")


def test_unknown_source():
    with pytest.raises(DataError, match="unknown data source 'gsm9k'"):
        load_rows(_cfg("gsm9k"), "train")


def test_malformed_jsonl_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", "answer": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 3: malformed JSON"):
        load_rows(_cfg(path), "train")


def test_malformed_json_and_parquet(tmp_path):
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(DataError, match=r"bad\.json: malformed JSON"):
        load_rows(_cfg(tmp_path / "bad.json"), "train")
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(DataError, match="expected a list of objects"):
        load_rows(_cfg(tmp_path / "bad.json"), "train")
    pytest.importorskip("pyarrow")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: unreadable parquet"):
        load_rows(_cfg(tmp_path / "bad.parquet"), "train")


@pytest.mark.parametrize("content,ext", [("", "jsonl"), ("\n\n", "jsonl"), ("[]", "json"),
                                         ("question,answer\n", "csv")])
def test_empty_dataset(tmp_path, content, ext):
    path = tmp_path / f"empty.{ext}"
    path.write_text(content)
    with pytest.raises(DataError, match=r"empty\.\w+: dataset is empty"):
        load_rows(_cfg(path), "train")


def test_missing_fields_name_present_fields(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"problem": "p", "solution": "s"}], "jsonl")
    with pytest.raises(DataError, match=r"row 0 has no question field 'question'.*problem, solution"):
        load_rows(_cfg(path), "train")
    with pytest.raises(DataError, match=r"row 0 has no answer field 'answer'.*problem, solution"):
        load_rows(_cfg(path, question_field="problem"), "train")


def test_all_rows_validated_up_front(tmp_path):
    rows = [{"question": "q", "answer": "1"}] * 5 + [{"question": "q"}]
    with pytest.raises(DataError, match="row 5 has no answer field"):
        load_rows(_cfg(_write(tmp_path / "d.jsonl", rows, "jsonl")), "train")


def test_hf_source_errors_are_data_errors(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def boom(*a, **k):
        raise ConnectionError("Couldn't reach 'nobody/nothing' on the Hub\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(DataError, match=r"nothing.*unreachable: Couldn't reach .* on the Hub$"):
        load_rows(_cfg("hf:nobody/nothing"), "train")


def test_hf_source_rows(monkeypatch):
    datasets = pytest.importorskip("datasets")
    seen = {}

    def fake(name, config, split):
        seen.update(name=name, config=config, split=split)
        return datasets.Dataset.from_list([{"question": "q", "answer": "work #### 7"}])

    monkeypatch.setattr(datasets, "load_dataset", fake)
    s = load_rows(_cfg("gsm8k"), "test")[0]
    assert seen == {"name": "openai/gsm8k", "config": "main", "split": "test"}
    assert s["answer"] == "7"


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.slow
def test_arithmetic_train_test_disjoint():
    train = make_split("train", 20000)
    test = make_split("test", 500)
    assert len(train) == 20000 and len(test) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    keys = {(r["template"], r["a"], r["b"]) for r in train}
    assert not keys & {(r["template"], r["a"], r["b"]) for r in test}
    assert {r["op"] for r in test} == {"+", "-", "*"}
    for r in train[:2000] + test:
        assert len(r["question"]) < 90
        assert int(r["answer"]) == eval(f"{r['a']}{r['op']}{r['b']}")  # noqa: S307 - our own digits


def test_arithmetic_deterministic_across_processes():
    def digest(rows):
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()

    code = ("import hashlib, json; from nanogrpo.demos.arithmetic.task import make_split; "
            "rows = json.dumps(make_split('train', 300, seed=3), sort_keys=True); "
            "print(hashlib.sha256(rows.encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == digest(make_split("train", 300, seed=3))
    assert make_split("train", 300, seed=3) != make_split("train", 300, seed=4)


def test_solution():
    s = {"op": "+", "a": 23, "b": 14, "answer": "37"}
    assert solution(s) == "<think>23+14=37</think><answer>37</answer>"
    r = make_split("test", 1)[0]
    assert solution(r) == f"<think>{r['equation']}</think><answer>{r['answer']}</answer>"
    with pytest.raises(DataError, match="arithmetic sample"):
        solution({"question": "q", "answer": "1"})


# ----------------------------------------------------------------------------- prompts


def test_build_messages_system_and_few_shot():
    sample = {"question": "Q?", "answer": "1"}
    few = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    msgs = build_messages(sample, "SYS", few)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == ["SYS", "1+1?", "2", "2+2?", "4", "Q?"]
    assert build_messages(sample, "", []) == [{"role": "user", "content": "Q?"}]
    assert build_messages(sample, None, []) == [{"role": "user", "content": "Q?"}]
    with pytest.raises(DataError, match=r"few_shot\[0\]"):
        build_messages(sample, "", [{"q": "x"}])


def test_per_sample_system_prompt(tmp_path):
    rows = [{"question": "a", "answer": "1", "system": "Only digits."},
            {"question": "b", "answer": "2", "system": ""}]
    samples = load_rows(_cfg(_write(tmp_path / "d.jsonl", rows, "jsonl")), "train")
    assert build_messages(samples[0], "Default.", [])[0] == {"role": "system", "content": "Only digits."}
    assert build_messages(samples[1], "Default.", [])[0] == {"role": "system", "content": "Default."}


def test_plain_template():
    msgs = build_messages({"question": "Q?"}, "SYS", [{"question": "1+1?", "answer": "2"}])
    text = render_prompt(None, msgs, "plain")
    assert text == "SYS\n\nUser: 1+1?\nAssistant: 2\nUser: Q?\nAssistant:"
    assert render_prompt(None, [{"role": "user", "content": "Q?"}], "plain") == "User: Q?\nAssistant:"


def test_chat_template_render():
    tok = make_tokenizer()
    text = render_prompt(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "auto")
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_no_chat_template_error():
    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(ModelError, match="has no chat template; set model.chat_template=plain"):
        render_prompt(tok, [{"role": "user", "content": "Q"}], "auto")


def test_encode_prompts_skips_long():
    tok = make_tokenizer()
    samples = [{"question": "1+1?"}, {"question": "x" * 200}, {"question": "2+2?"}]
    cfg = DataConfig(source="arithmetic", system_prompt="", max_prompt_tokens=40)
    ids, skipped = encode_prompts(tok, samples, cfg, "plain")
    assert skipped == [1]
    assert len(ids) == 2
    assert tok.decode(ids[0]) == "User: 1+1?\nAssistant:"
    assert len(ids[1]) == len("User: 2+2?\nAssistant:")  # char-level, no special tokens added
    ids, _ = encode_prompts(tok, samples[:1], cfg, "auto")
    assert ids[0][0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert encode_prompts(tok, [], cfg, "auto") == ([], [])


# ----------------------------------------------------------------------------- sampler


def test_sampler_epochs_and_shuffle():
    rows = [{"id": str(i)} for i in range(10)]
    s = PromptSampler(rows, batch_size=4, seed=1)
    got = [r["id"] for _ in range(5) for r in s.next_batch()]  # 20 rows = 2 epochs
    assert sorted(got[:10]) == sorted(r["id"] for r in rows)
    assert sorted(got[10:]) == sorted(r["id"] for r in rows)
    assert got[:10] != got[10:]  # reshuffled
    plain = PromptSampler(rows, batch_size=3, seed=1, shuffle=False)
    assert [r["id"] for r in plain.next_batch() + plain.next_batch()] == [str(i) for i in range(6)]


def test_sampler_resume_is_exact():
    rows = [{"id": str(i)} for i in range(7)]
    ref = PromptSampler(rows, batch_size=3, seed=5)
    expected = [[r["id"] for r in ref.next_batch()] for _ in range(12)]

    first = PromptSampler(rows, batch_size=3, seed=5)
    got = [[r["id"] for r in first.next_batch()] for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(rows, batch_size=3, seed=0)
    resumed.load_state_dict(state)
    got += [[r["id"] for r in resumed.next_batch()] for _ in range(7)]
    assert got == expected

    with pytest.raises(DataError, match="saved on 7 rows"):
        PromptSampler(rows[:5], batch_size=3).load_state_dict(state)
