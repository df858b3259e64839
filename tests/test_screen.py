"""What a run shows: nanogrpo's INFO as plain lines, WARNING only for what needs a person, one line
per checkpoint, third-party progress bars and retry warnings off unless ``-v`` (nanogrpo.console)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanogrpo.console import LineHandler, screen

ROOT = Path(__file__).resolve().parents[1]


def _state():
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as tf_logging

    lg = logging.getLogger("nanogrpo")
    return (list(lg.handlers), lg.level, lg.propagate, logging.getLogger("huggingface_hub").level,
            tf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled())


def _lines(text: str) -> list[str]:
    return [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]


def test_info_is_a_plain_line_and_warning_is_marked(capsys):
    log = logging.getLogger("nanogrpo.somewhere")
    with screen(own=True):
        log.info("rollout engine: fast (qwen2)")
        log.warning("reward %r raised", "mine")
        log.debug("not shown")
    with screen(verbose=True, own=True):
        log.debug("shown with -v")
    assert _lines(capsys.readouterr().err) == [
        "rollout engine: fast (qwen2)", "WARNING nanogrpo.somewhere: reward 'mine' raised",
        "DEBUG nanogrpo.somewhere: shown with -v"]


def test_screen_puts_everything_back():
    from transformers.utils import logging as tf_logging

    before = _state()
    with screen(own=True):
        inside = _state()
        assert any(isinstance(h, LineHandler) for h in inside[0])
        assert logging.getLogger("huggingface_hub").level == logging.ERROR  # retry chatter off
        assert not tf_logging.is_progress_bar_enabled()
        with screen(verbose=True):  # the CLI calling nanogrpo.train: the outer screen stands
            assert _state() == inside
    assert _state() == before
    with screen(verbose=True, own=True):
        assert tf_logging.is_progress_bar_enabled()  # -v: the libraries' own settings
        assert logging.getLogger("huggingface_hub").level == before[3]
    assert _state() == before


def test_transformers_progress_bars_are_off_on_the_screen(capsys):
    from transformers.utils import logging as tf_logging

    def bar() -> str:
        for _ in tf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        return capsys.readouterr().err

    with screen(own=True):
        assert "Loading weights" not in bar()
    with screen(verbose=True, own=True):
        assert "Loading weights" in bar()


def test_a_callers_own_logging_is_left_to_them(caplog):
    """A caller that set up logging (here pytest's handler on the root logger) gets nanogrpo's
    records through it, at INFO, and no handler of ours."""
    lg, root = logging.getLogger("nanogrpo"), logging.getLogger()
    level, root_level = lg.level, root.level
    lg.setLevel(logging.NOTSET)
    root.setLevel(logging.WARNING)
    try:
        with screen():
            assert not any(isinstance(h, LineHandler) for h in lg.handlers)
            assert lg.getEffectiveLevel() == logging.INFO  # the root says WARNING: ours still show
            logging.getLogger("nanogrpo.train").info("checkpoint runs/x/checkpoints/step_2")
        assert lg.level == logging.NOTSET
    finally:
        lg.setLevel(level)
        root.setLevel(root_level)
    assert "checkpoint runs/x/checkpoints/step_2" in caplog.text


def _train(tmp_path: Path, *flags: str, config: str = "demo") -> subprocess.CompletedProcess:
    """The demo (embedded model, arithmetic), cut to one small step (a checkpoint before it and after)."""
    cmd = [sys.executable, "-m", "nanogrpo.cli", *flags, "train", "--config", config,
           "--out", str(tmp_path / "run"), "--steps", "1", "rollout.prompts_per_step=4", "grpo.group_size=4",
           "rollout.max_new_tokens=32", "eval.every=1", "eval.n=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_demo_screen_is_quiet_and_v_brings_the_bars_back(tmp_path):
    out = _train(tmp_path / "quiet")
    said = _lines(out.stdout + out.stderr)
    for third_party in ("Loading weights", "Writing model shards", "Retrying", "huggingface_hub"):
        assert not any(third_party in ln for ln in said), third_party
    assert not any("WARNING" in ln or "Warning" in ln for ln in said), [ln for ln in said if "WARN" in ln]
    bars = [ln for ln in said if "%|" in ln]
    assert bars and all(ln.lstrip().startswith("nanogrpo") for ln in bars)  # our bar alone
    assert any(ln.startswith("rollout engine: ") for ln in said)  # information, as a plain line
    ckpts = sorted(p.name for p in (tmp_path / "quiet" / "run" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_0", "step_1"]
    saved = [ln.strip() for ln in said if ln.strip().startswith("checkpoint ")]
    assert saved == [f"checkpoint {tmp_path / 'quiet' / 'run' / 'checkpoints' / c}" for c in ckpts]
    assert out.stdout.strip().splitlines()[-1] == f"run directory: {tmp_path / 'quiet' / 'run'}"

    loud = _lines((lambda o: o.stdout + o.stderr)(_train(tmp_path / "loud", "-v")))
    assert any("Loading weights" in ln for ln in loud) and any("Writing model shards" in ln for ln in loud)


@pytest.mark.slow
def test_the_distillation_demo_says_each_start_line_once(tmp_path):
    """Its teacher computed as the trainer does and was evaluated by an engine picked quietly: the
    ``model.cpu_linear`` and ``rollout engine`` lines were printed twice (issue 50, item 8)."""
    said = _lines((lambda o: o.stdout + o.stderr)(_train(tmp_path, config="demo-distill")))
    for start in ("model.cpu_linear=auto: ", "rollout engine: "):
        assert sum(ln.startswith(start) for ln in said) == 1, [ln for ln in said if ln.startswith(start)]


def test_v_before_or_after_the_subcommand():
    from nanogrpo.cli import build_parser

    ap = build_parser()
    assert ap.parse_args(["-v", "train"]).verbose and ap.parse_args(["train", "-v"]).verbose
    assert ap.parse_args(["eval", "--model", "m", "--verbose"]).verbose
    assert not ap.parse_args(["train"]).verbose
