"""Competition-math data: references as datasets write them (``data.answer_from``), the presets
(MATH, MATH-500, AIME, DeepScaleR, GSM8K) read from local files shaped like the real datasets
through ``datasets``, held-out problems from another source, the R1 prompt, ``format_boxed``,
``nanogrpo eval --data math500 --k K`` and a short training run on a MATH-shaped file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanogrpo.config import PROMPT_TEMPLATES, R1_BOXED_INSTRUCTION, ConfigError, DataConfig, load_config
from nanogrpo.data import PRESETS, build_messages, load_eval_rows, load_rows
from nanogrpo.data.samples import detect_answer_from, last_boxed, reference_text
from nanogrpo.errors import DataError
from nanogrpo.rewards import correctness, format_boxed, resolve

SHAPED = Path(__file__).parent / "data" / "hf_shaped"
FILES = {"math": "math_lighteval.jsonl", "math500": "math500.jsonl", "aime24": "aime_2024.jsonl",
         "aime": "aimo_validation_aime.jsonl", "deepscaler": "deepscaler.jsonl", "gsm8k": "gsm8k.jsonl"}


@pytest.fixture
def hub(monkeypatch):
    """``datasets.load_dataset`` answering from the local files shaped like each preset's dataset."""
    datasets = pytest.importorskip("datasets")
    seen: list[tuple] = []
    by_name = {p.name: FILES[k] for k, p in PRESETS.items()}

    def fake(name, config=None, split=None, **kw):
        seen.append((name, config, split))
        lines = (SHAPED / by_name[name]).read_text().splitlines()
        return datasets.Dataset.from_list([json.loads(x) for x in lines])

    monkeypatch.setattr(datasets, "load_dataset", fake)
    return seen


# ----------------------------------------------------------------------------- references


def test_last_boxed_reads_nested_braces_and_the_last_box() -> None:
    assert last_boxed("so $\\boxed{\\frac{1}{12}}$.") == "\\frac{1}{12}"
    union = "(-\\infty,3) \\cup (5,\\infty)"
    assert last_boxed("\\boxed{4} then \\boxed{" + union + "}") == union
    vector = "\\begin{pmatrix} 2 \\\\ -1 \\end{pmatrix}"
    assert last_boxed("\\boxed{" + vector + "}.") == vector
    assert last_boxed("$\\fbox{7}$") == "7" and last_boxed("is $\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\boxed{3} and \\boxed{unclosed") == "3"
    assert last_boxed("no box here") is None and not last_boxed("\\boxed{}")


def test_reference_modes_and_auto_detection() -> None:
    assert reference_text(" 42 ", "column", None) == "42"
    assert reference_text("work\n#### 72", "delimiter", None) == "72"
    assert reference_text("a ## b", "delimiter", "##") == "b"
    assert reference_text("no delimiter", "delimiter", None) is None
    assert reference_text("so \\boxed{5}.", "boxed", None) == "5"
    assert reference_text("5", "boxed", None) is None
    assert detect_answer_from(["x \\boxed{1}", "y"]) == "boxed"
    assert detect_answer_from(["x #### 1"]) == "delimiter" and detect_answer_from(["1", "2"]) == "column"


def _file(tmp_path: Path, rows: list[dict]) -> str:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_answer_from_on_a_local_file(tmp_path) -> None:
    rows = [{"problem": "p1", "solution": "so $\\boxed{\\frac{1}{2}}$."},
            {"problem": "p2", "solution": "\\boxed{7}"}]
    cfg = DataConfig(source=_file(tmp_path, rows), question_field="problem", answer_field="solution")
    samples = load_rows(cfg, "train")  # auto: boxed
    assert [s["answer"] for s in samples] == ["\\frac{1}{2}", "7"]
    assert samples[0]["answer_raw"] == rows[0]["solution"]
    col = load_rows(cfg.model_copy(update={"answer_from": "column"}), "train")
    assert col[1]["answer"] == "\\boxed{7}" and "answer_raw" not in col[1]


def test_a_row_without_its_reference_is_an_error_naming_it(tmp_path) -> None:
    rows = [{"problem": "p1", "solution": "\\boxed{1}"}, {"problem": "p2", "solution": "\\boxed{2}"},
            {"id": "q-17", "problem": "p3", "solution": "the answer is two"}]
    cfg = DataConfig(source=_file(tmp_path, rows), question_field="problem", answer_field="solution")
    with pytest.raises(DataError, match=r"row 2 \(id q-17\) field 'solution' has no complete \\boxed\{…\}.*"
                                        r"answer_from=boxed, detected.*answer_from=column") as e:
        load_rows(cfg, "train")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"row 1 .*no '####'"):
        load_rows(DataConfig(source=_file(tmp_path, [{"question": "q", "answer": "#### 1"},
                                                     {"question": "q", "answer": "1"}])), "train")
    with pytest.raises(DataError, match=r"row 0 .*empty reference"):
        load_rows(DataConfig(source=_file(tmp_path, [{"question": "q", "answer": "  "}])), "train")
    with pytest.raises(DataError, match=r"row 0 .*has no complete \\boxed"):
        load_rows(DataConfig(source=_file(tmp_path, [{"question": "q", "answer": "\\boxed{1"}]),
                             answer_from="boxed"), "train")


def test_answer_from_is_a_typed_config_key() -> None:
    assert DataConfig().answer_from == "auto"
    with pytest.raises(ConfigError, match="answer_from"):
        load_config(overrides=["data.answer_from=last_line"])
    with pytest.raises(ConfigError, match="answer_delimiter is read with data.answer_from=delimiter"):
        load_config(overrides=["data.answer_from=boxed", "data.answer_delimiter=####"])
    d = DataConfig(answer_delimiter="##")  # a delimiter set by hand selects it, as before
    assert d.answer_from == "auto"


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset, split, hf_split, first_answer", [
    ("math", "train", "train", "\\frac{1}{12}"),
    *[pytest.param(*p, marks=pytest.mark.slow) for p in [
        ("math", "test", "test", "\\frac{1}{12}"),
        ("math500", "test", "test", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("aime24", "test", "train", "738"), ("aime", "test", "train", "13"),
        ("deepscaler", "train", "train", "\\frac{1}{2}"), ("gsm8k", "test", "test", "12")]],
])
def test_presets_read_their_datasets_fields(hub, preset, split, hf_split, first_answer) -> None:
    rows = load_rows(DataConfig(source=preset), split)
    p = PRESETS[preset]
    assert hub == [(p.name, p.config, hf_split)]
    assert rows[0]["answer"] == first_answer and rows[0]["question"] == rows[0][p.question_field]
    assert all(r["answer"] and r["question"] for r in rows)


def test_math_preset_reads_the_last_box_of_each_solution(hub) -> None:
    answers = [r["answer"] for r in load_rows(DataConfig(source="math"), "train")]
    assert answers == ["\\frac{1}{12}", "\\begin{pmatrix} 2 \\\\ -1 \\end{pmatrix}",
                       "(-\\infty,3) \\cup (5,\\infty)", "\\text{(C)}"]


def test_preset_splits_and_hf_names(hub) -> None:
    with pytest.raises(DataError, match="math500 has no split 'train'"):
        load_rows(DataConfig(source="math500"), "train")
    with pytest.raises(DataError, match="deepscaler has no split 'test'"):
        load_rows(DataConfig(source="deepscaler"), "test")
    rows = load_rows(DataConfig(source="hf:HuggingFaceH4/MATH-500", question_field="problem"), "test")
    assert rows[2]["answer"] == "[-1,4)"  # the same dataset through hf: with its field names
    assert PRESETS["math"].name == "DigitalLearningGmbH/MATH-lighteval" and PRESETS["math500"].name == (
        "HuggingFaceH4/MATH-500")


def test_eval_source_reads_held_out_problems_elsewhere(hub) -> None:
    cfg = DataConfig(source="math", eval_source="math500")
    assert load_rows(cfg, cfg.split)[0]["answer"] == "\\frac{1}{12}"
    assert load_eval_rows(cfg)[1]["answer"] == "3\\sqrt{2}"
    assert load_eval_rows(DataConfig(source="math"))[0]["answer"] == "\\frac{1}{12}"  # None: source


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_preset_references_grade_real_answers(hub) -> None:
    rows = load_rows(DataConfig(source="math500"), "test")
    assert correctness("</think>\n\n$\\boxed{(3, \\frac{\\pi}{2})}$", rows[0]) == 1.0
    assert correctness("<answer>\\sqrt{18}</answer>", rows[1]) == 1.0
    assert correctness("<answer>(-1, 4)</answer>", rows[2]) == -1.0
    aime = load_rows(DataConfig(source="aime"), "test")
    assert correctness("The answer is $\\boxed{13}$.", aime[0]) == 1.0


# ----------------------------------------------------------------------------- the R1 prompt and its format


def test_r1_prompt_template() -> None:
    cfg = DataConfig(prompt_template="r1_boxed")
    assert cfg.system_prompt == "" and cfg.user_template == "{question}\n" + R1_BOXED_INSTRUCTION
    question = "What is $x$ if $2x = {4}$?"
    msgs = build_messages({"question": question}, cfg.system_prompt, [], cfg.user_template)
    assert msgs == [{"role": "user", "content": question + "\nPlease reason step by step, and put "
                                                "your final answer within \\boxed{}."}]
    shot = {"question": "1+1?", "answer": "\\boxed{2}"}
    few = build_messages({"question": "Q"}, "", [shot], cfg.user_template)
    assert few[0]["content"].endswith("\\boxed{}.")
    assert few[1] == {"role": "assistant", "content": "\\boxed{2}"}
    sys_cfg = DataConfig(prompt_template="boxed_system")
    assert build_messages({"question": "Q"}, sys_cfg.system_prompt, [], sys_cfg.user_template)[0] == {
        "role": "system", "content": R1_BOXED_INSTRUCTION}
    assert set(PROMPT_TEMPLATES) == {"think_answer", "r1_boxed", "boxed_system"}


def test_prompt_template_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match="unknown prompt template 'r2'"):
        load_config(overrides=["data.prompt_template=r2"])
    with pytest.raises(ConfigError, match="prompt_template=r1_boxed sets data.system_prompt; drop one"):
        load_config(overrides=["data.prompt_template=r1_boxed", "data.system_prompt=Be brief."])
    with pytest.raises(ConfigError, match="must contain \\{question\\}"):
        load_config(overrides=["data.user_template=Solve it."])
    cfg = load_config(overrides=["data.prompt_template=r1_boxed"])
    again = load_config(overrides=[f"data.{k}={json.dumps(v)}" for k, v in cfg.data.model_dump().items()
                                   if k in ("prompt_template", "system_prompt", "user_template")])
    assert again.data == cfg.data  # a saved run config (the template and what it set) loads back


@pytest.mark.parametrize("completion, ok", [
    ("Reasoning...\n</think>\n\n**Final Answer**\n\\[\n\\boxed{\\frac{1}{2}}\n\\]", True),
    ("So the answer is $\\boxed{42}$", True), ("\\boxed{42}", True), ("$$\\boxed{x^{2}}$$\n", True),
    ("\\(\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}\\)", True), ("so \\boxed {7}  \n", True),
    ("So the answer is $\\boxed{42}$.", False), ("\\boxed{42} apples", False), ("42", False),
    ("First \\boxed{41}, then \\boxed{42}", False), ("<think>\\boxed{1}</think> \\boxed{1}", False),
    ("\\boxed{}", False), ("\\boxed{ }", False), ("\\boxed{42", False), ("\\boxed{4}2}", False), ("", False),
])
def test_format_boxed(completion: str, ok: bool) -> None:
    assert format_boxed(completion, {}) == (1.25 if ok else -1.0)
    assert resolve("format_boxed") is format_boxed


# ----------------------------------------------------------------------------- eval and a short run


@pytest.mark.slow
def test_cli_eval_on_math500_gives_pass_at_1_and_k_and_maj(hub, tmp_path, capsys) -> None:
    from nanogrpo.cli import main

    out = tmp_path / "ev.json"
    rc = main(["eval", "--model", "embedded", "--data", "math500", "--k", "3", "--n", "4", "--out", str(out),
               "rollout.max_new_tokens=8", "rewards.workers=0", "data.max_prompt_tokens=300"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"pass@1", "pass@3", "maj@3", "accuracy", "format_rate"} <= set(printed)
    assert printed["n"] == 4 and printed["k"] == 3 and printed["pass@1"] == printed["accuracy"]
    assert printed["pass@3"] >= printed["pass@1"] and 0 <= printed["maj@3"] <= printed["pass@3"]
    assert hub[-1] == ("HuggingFaceH4/MATH-500", None, "test")
    recs = [json.loads(x) for x in out.with_suffix(".samples.jsonl").read_text().splitlines()]
    assert recs[2]["answer"] == "[-1,4)" and len(recs[0]["completions"]) == 3


def _math_file(tmp_path: Path) -> Path:
    """MATH-shaped rows the embedded model can answer: its arithmetic problems, with MATH's full
    solutions (the reference boxed at the end)."""
    from nanogrpo.demos.arithmetic.task import make_split

    path = tmp_path / "math_{split}.jsonl"
    for split in ("train", "test"):
        rows = make_split(split, 24)
        with open(str(path).replace("{split}", split), "w") as f:
            for i, r in enumerate(rows):
                f.write(json.dumps({"problem": r["question"], "level": "Level 1", "type": "Prealgebra",
                                    "solution": f"Counting gives $\\boxed{{{r['answer']}}}$.",
                                    "unique_id": f"{split}/{i}"}) + "\n")
    return path


@pytest.mark.slow
def test_two_step_run_on_a_math_shaped_file_with_the_r1_prompt(tmp_path) -> None:
    from nanogrpo.training.loop import train
    from nanogrpo.training.metrics import read_metrics
    from nanogrpo.training.prepare import prepare

    cfg = load_config(preset="demo", overrides=[
        f"data.source={json.dumps(str(_math_file(tmp_path)))}", "data.question_field=problem",
        "data.answer_field=solution", "data.prompt_template=r1_boxed", "data.max_prompt_tokens=300",
        "rewards.functions=[\"correctness\", \"format_boxed\", \"format\"]", "rewards.workers=0",
        "train.steps=2", "rollout.prompts_per_step=8", "grpo.group_size=4", "rollout.max_new_tokens=56",
        "eval.every=2", "eval.n=6", "eval.k=2", f"train.out={json.dumps(str(tmp_path / 'run'))}",
        "train.save_every=2"])
    run = prepare(cfg)
    assert run.rows[0]["answer"] == run.rows[0]["answer_raw"].split("{")[1].split("}")[0]
    root = train(run)
    metrics = list(read_metrics(root / "metrics.jsonl"))
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2
    assert any(m["reward_std"] > 0 for m in steps)  # rewards differ within the batch: there is signal
    assert all("reward/format_boxed" in m and "reward/correctness" in m for m in steps)
    evals = [m for m in metrics if "eval/pass@2" in m]
    assert evals and {"eval/pass@1", "eval/maj@2", "eval/accuracy"} <= set(evals[-1])
    prompt = json.loads((root / "eval" / "step_2.samples.jsonl").read_text().splitlines()[0])
    assert prompt["answer"].isdigit()


# ----------------------------------------------------------------------------- the shipped math configs

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MATH_CONFIGS = [CONFIGS / "math-qwen2.5-1.5b.toml", CONFIGS / "math-r1-qwen3-1.7b.toml"]


def test_math_configs_train_on_competition_math_and_hold_out_math500() -> None:
    qwen25, qwen3 = (load_config(p) for p in MATH_CONFIGS)
    assert qwen25.model.path == "Qwen/Qwen2.5-1.5B" and qwen25.data.source == "math"
    assert qwen25.data.eval_source == "math500" and qwen25.data.prompt_template == "think_answer"
    assert qwen25.rewards.functions == ["correctness", "format"]
    assert qwen3.model.path == "Qwen/Qwen3-1.7B" and qwen3.data.eval_source == "math500"
    assert qwen3.data.prompt_template == "r1_boxed" and qwen3.data.user_template.endswith("\\boxed{}.")
    assert qwen3.rewards.functions == ["correctness", "format_boxed"] and not qwen3.rewards.truncated_correct


@pytest.mark.slow
@pytest.mark.parametrize("path", MATH_CONFIGS, ids=lambda p: p.name)
def test_math_config_trains_end_to_end_on_local_files(path, tmp_path) -> None:
    from nanogrpo.cli import main
    from nanogrpo.models.tiny import make_model, make_tokenizer
    from nanogrpo.training.metrics import read_metrics

    tok = make_tokenizer()
    make_model("tiny", tok, seed=1).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    rc = main(["train", "--config", str(path), "--model", str(tmp_path / "model"),
               "--data", str(_math_file(tmp_path)), "--out", str(out), "--steps", "2",
               "data.question_field=problem", "data.answer_field=solution",
               f"data.eval_source={json.dumps(str(SHAPED / 'math500.jsonl'))}", "data.max_prompt_tokens=2000",
               "rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "eval.every=2", "eval.n=3",
               "eval.max_new_tokens=8", "rewards.workers=0", "train.gradient_checkpointing=false"])
    assert rc == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["eval/n"] == 3
    first = json.loads((out / "eval" / "step_2.samples.jsonl").read_text().splitlines()[0])
    assert first["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"  # MATH-500's answer column, held out
