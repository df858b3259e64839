"""The code blocks of README.md and docs/: found, sorted by what can be done with them, and run in short form.

Every fenced block is one of:

- **marked**: the line before its fence (blank lines aside) is ``*Not run here: <why>.*``: shown, not run;
- **shell** (``bash``/``sh``/``shell``): every command is one this module runs (``nanogrpo train | eval |
  report | serve | rollout`` and a few file commands), run through ``nanogrpo.cli.main`` in this process;
  a command ending in ``&`` runs in a process of its own until the block's other commands are done;
- **python**: run as a script of its own (with ``title="x.py"``: written as that file, then executed);
- **data** (``toml``/``yaml``/``json``/``jsonl``): parsed; a config (its top-level keys are config
  sections) is loaded as a ``Config``; with ``title=...`` also written as that file for later commands;
- **text**: output, diagrams, trees (a source tree is checked against the repository).

Anything else (a ``bash`` block with ``pip install`` or ``torchrun``, a block without a language) is
**unrunnable**: tests/test_docs.py fails on it unless it carries the mark. The short forms are in
``SUBSTITUTIONS`` (the table docs/contributing.md shows).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARK = re.compile(r"^\s*\*Not run here: .+\.\*\s*$")
SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
DATA = {"toml", "yaml", "yml", "json", "jsonl"}
TEXT = {"text"}
NANOGRPO_COMMANDS = {"train", "eval", "report", "serve", "rollout"}
FILE_COMMANDS = {"ls", "cat", "head", "tail", "mkdir", "cp", "echo"}

# what the test changes in a documented command, and why (docs/contributing.md prints this table)
SHORT = {"train.steps": 2, "rollout.prompts_per_step": 4, "grpo.group_size": 4, "rollout.max_new_tokens": 40,
         "eval.n": 8, "train.save_every": 0, "model.cpu_linear": "torch"}
SUBSTITUTIONS = [
    ("`nanogrpo train`, `serve`, `rollout`",
     "`... " + " ".join(f"{k}={v}" for k, v in SHORT.items()) + "` appended",
     "a run of seconds: 2 steps of 4 prompts x 4 samples, 40 new tokens, 8 held-out problems, no timing of "
     "the CPU's linears; the last override wins, so `--steps N` and the documented keys are replaced"),
    ("`nanogrpo train --resume RUN ...`", "the same, with `train.steps` = RUN's newest checkpoint + 1",
     "a resume that trains one step more than the run it continues"),
    ("`nanogrpo eval ...`", "`--n 4 eval.max_new_tokens=40` appended", "4 problems, short answers"),
    ("`--model RUN/checkpoints/step_N` when `step_N` does not exist", "RUN's newest checkpoint",
     "the short run stopped at step 2"),
    ("`--model ./my-model` (any path naming `my-model`) when it does not exist",
     "a tiny random-init Qwen2 with a character-level tokenizer saved there",
     "your model, offline and small"),
    ("port `8471` (`--port 8471`, `http://127.0.0.1:8471`)", "a free port",
     "other jobs on the machine may hold 8471"),
    ("Python: `nanogrpo.train(config, ...)`", "`config` with the overrides of the first row",
     "the same short run"),
    ("Python: `nanogrpo.evaluate(...)`", "`n` at most 8", "8 problems"),
]


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    title: str | None
    text: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """README.md and every page of docs/ (docs/scripts/ holds code, not pages)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md")
                  if "scripts" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m["fence"], len(m["indent"]), m["info"].strip()
        lang = info.split()[0].lower() if info else ""
        title = re.search(r'title="([^"]+)"', info)
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and set(lines[j].strip()) == {fence[0]}):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        out.append(Block(path, i + 1, lang, title[1] if title else None, "\n".join(body),
                         prev.strip() if MARK.match(prev) else None))
        i = j + 1
    return out


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    background: bool


def commands(text: str) -> list[Command]:
    """A shell block's commands: continuation lines joined, comments dropped, ``&&`` chains split,
    leading ``NAME=value`` assignments kept as the environment, a trailing ``&`` as background."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.split("\n"):
        tokens = shlex.split(line, comments=True)
        background = bool(tokens) and tokens[-1] == "&"
        tokens = tokens[:-1] if background else tokens
        part: list[str] = []
        for tok in [*tokens, "&&"]:
            if tok != "&&":
                part.append(tok)
                continue
            env = {}
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                k, v = part.pop(0).split("=", 1)
                env[k] = v
            if part:
                out.append(Command(part, env, background))
            part = []
    return out


def runnable(cmd: Command) -> bool:
    a = cmd.argv
    return (a[0] == "nanogrpo" and len(a) > 1 and a[1] in NANOGRPO_COMMANDS) or a[0] in FILE_COMMANDS


def kind(b: Block) -> str:
    """marked | shell | python | data | text | unrunnable (what tests/test_docs.py does with the block)."""
    if b.mark:
        return "marked"
    if b.lang in SHELL:
        cmds = commands(b.text)
        return "shell" if cmds and all(runnable(c) for c in cmds) else "unrunnable"
    if b.lang in PYTHON:
        return "python"
    if b.lang in DATA:
        return "data"
    if b.lang in TEXT:
        return "text"
    return "unrunnable"


# ------------------------------------------------------------------------------ checks without running


def load_data(b: Block):
    """Parse a data block; a config (top-level keys are config sections) is validated as a Config."""
    from nanogrpo.config import Config

    if b.lang == "jsonl":
        return [json.loads(line) for line in b.text.splitlines() if line.strip()]
    if b.lang == "json":
        return json.loads(b.text)
    if b.lang == "toml":
        import tomllib

        data = tomllib.loads(b.text)
    else:
        import yaml

        data = yaml.safe_load(b.text)
    if isinstance(data, dict) and data and set(data) <= set(Config.model_fields):
        return Config.from_dict(data)
    return data


TREE_LINE = re.compile(r"^(?P<indent> *)(?P<names>[\w.\-/ ,]+?)(?: {2,}.*)?$")


def tree_paths(text: str) -> list[str] | None:
    """The paths a source-tree block names (``nanogrpo/`` at the top, two spaces per level), or None
    when the block is not a tree."""
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines or not lines[0].rstrip().endswith("/") or " " in lines[0].strip():
        return None
    stack: list[tuple[int, str]] = []
    out = []
    for line in lines:
        m = TREE_LINE.match(line)
        if not m or not re.fullmatch(r"[\w.\-/]+(, [\w.\-/]+)*", m["names"].strip()):
            continue  # a comment's continuation line
        depth = len(m["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parent = "".join(name for _, name in stack)
        for name in m["names"].strip().split(", "):
            out.append(parent + name)
        if m["names"].strip().endswith("/") and "," not in m["names"]:
            stack.append((depth, m["names"].strip()))
    return out


# ------------------------------------------------------------------------------ running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _newest_checkpoint(run: Path) -> Path | None:
    ckpts = [p for p in (run / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return max(ckpts, key=lambda p: int(p.name.split("_")[1])) if ckpts else None


def _tiny_model(where: Path) -> None:
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model("tiny", tok, seed=0).save_pretrained(where)
    tok.save_pretrained(where)


def short_argv(argv: list[str], cwd: Path, port: int) -> list[str]:
    """The short form of a documented command (``SUBSTITUTIONS``)."""
    a = [re.sub(r"(127\.0\.0\.1|localhost):8471\b", f"127.0.0.1:{port}", x) for x in argv]
    a = [str(port) if x == "8471" and i and a[i - 1] == "--port" else x for i, x in enumerate(a)]
    if a[0] != "nanogrpo":
        return a
    for i, x in enumerate(a[:-1]):
        if x == "--model":
            target = cwd / a[i + 1]
            if "my-model" in a[i + 1] and not target.exists():
                _tiny_model(target)
            m = re.fullmatch(r"(.+)/checkpoints/step_\d+", a[i + 1])
            if m and not target.exists() and (cwd / m[1]).is_dir():
                newest = _newest_checkpoint(cwd / m[1])
                if newest is not None:
                    a[i + 1] = str(newest.relative_to(cwd))
    sub = a[1]
    if sub == "train" and "--resume" in a:
        run = cwd / a[a.index("--resume") + 1]
        newest = _newest_checkpoint(run)
        steps = (int(newest.name.split("_")[1]) if newest else 0) + 1
        short = [f"{k}={v}" for k, v in SHORT.items() if k != "train.steps"]
        return _with(a, [], short + [f"train.steps={steps}"])
    if sub == "serve":  # its relay's files in the example's directory, not the user's cache
        return _with(a, ["--weights-dir", "relay"], [f"{k}={v}" for k, v in SHORT.items()])
    if sub in ("train", "rollout"):
        return _with(a, [], [f"{k}={v}" for k, v in SHORT.items()])
    if sub == "eval":
        return _with(a, ["--n", "4"], ["eval.max_new_tokens=40"])
    return a


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _with(a: list[str], flags: list[str], overrides: list[str]) -> list[str]:
    """``a`` with ``flags`` (replacing the documented ones of the same name) and ``overrides`` added: flags
    first, then every ``key=value`` together (argparse takes the positional overrides as one run), the
    added ones last so that they win."""
    named = set(flags[::2])
    head, rest, docs_flags, docs_overrides, i = a[:2], a[2:], [], [], 0
    while i < len(rest):
        tok = rest[i]
        boolean = tok in ("-v", "--verbose", "--access-log", "--overwrite")
        takes_value = tok.startswith("-") and not boolean and i + 1 < len(rest)
        if takes_value:
            if tok not in named:
                docs_flags += rest[i:i + 2]
            i += 2
        elif OVERRIDE.match(tok):
            docs_overrides.append(tok)
            i += 1
        else:
            docs_flags.append(tok)
            i += 1
    return head + docs_flags + flags + docs_overrides + overrides


PRELUDE = f'''
import nanogrpo
import nanogrpo.api as _api

_SHORT = {SHORT!r}


def _short_train(config=None, **kw):
    if kw.get("resume") is None:
        config = _api.as_config(config, _SHORT)
    return _api.train(config, **kw)


def _short_evaluate(model, **kw):
    kw["n"] = min(kw.get("n") or 8, 8)
    return _api.evaluate(model, **kw)


nanogrpo.train, nanogrpo.evaluate = _short_train, _short_evaluate
'''


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "NANOGRPO_DOCS_TEST": "1"}


def _listing(cwd: Path) -> dict[str, int]:
    return {str(p.relative_to(cwd)): p.stat().st_size for p in cwd.rglob("*") if p.is_file()}


class Runner:
    """Runs one document's blocks in order in its own directory. A command already run with the same
    argv from a directory holding the same files (another page's copy of the same example) is not run
    again: the files it wrote are copied."""

    cache: dict[str, tuple[Path, list[str]]] = {}

    def __init__(self, cwd: Path):
        self.cwd = cwd
        (cwd / "configs").symlink_to(ROOT / "configs")
        self.port = free_port()

    def block(self, b: Block, timeout: float = 900) -> None:
        k = kind(b)
        if b.title:
            target = self.cwd / b.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.text + "\n")
        if k == "data":
            load_data(b)
        elif k == "python":
            code = f"import runpy; runpy.run_path({b.title!r})" if b.title else PRELUDE + "\n" + b.text
            self._run([sys.executable, "-c", code], {}, b, timeout)
        elif k == "shell":
            self._shell(b, timeout)

    def _shell(self, b: Block, timeout: float) -> None:
        background = []
        try:
            for cmd in commands(b.text):
                argv = short_argv(cmd.argv, self.cwd, self.port)
                if cmd.background:  # a server or a worker: its own process, ended with the block
                    if argv[0] == "nanogrpo":
                        argv = [sys.executable, "-m", "nanogrpo.cli", *argv[1:]]
                    background.append(subprocess.Popen(argv, cwd=self.cwd, env={**env(), **cmd.env},
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                else:
                    self._run(argv, cmd.env, b, timeout)
        finally:
            for p in background:
                p.kill()
                p.wait()

    def _run(self, argv: list[str], extra_env: dict[str, str], b: Block, timeout: float) -> None:
        before = _listing(self.cwd)
        key = hashlib.sha256(json.dumps([argv, extra_env, sorted(before.items())]).encode()).hexdigest()
        if key in Runner.cache:
            src, files = Runner.cache[key]
            for f in files:
                (self.cwd / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / f, self.cwd / f)
            return
        if argv[0] == "nanogrpo":
            code, output = _nanogrpo(argv[1:], self.cwd, extra_env)
        else:
            r = subprocess.run(argv, cwd=self.cwd, env={**env(), **extra_env}, capture_output=True, text=True,
                               timeout=timeout)
            code, output = r.returncode, r.stdout + r.stderr
        if code != 0:
            raise AssertionError(f"{b.where}: `{shlex.join(argv)}` exited with {code}:\n{output[-3000:]}")
        after = _listing(self.cwd)
        Runner.cache[key] = (self.cwd, [f for f, size in after.items() if before.get(f) != size])


def _nanogrpo(argv: list[str], cwd: Path, extra_env: dict[str, str]) -> tuple[int, str]:
    """``nanogrpo ARGV`` run by the console script's own function (``nanogrpo.cli.main``) in this process,
    in ``cwd``: the same code as the command, without paying a fresh interpreter's imports (~4 s of CPU)
    for each of the documentation's thirty commands. Returns the exit code and what it printed."""
    import contextlib
    import io

    from nanogrpo.cli import main

    saved_env, saved_cwd, out = dict(os.environ), os.getcwd(), io.StringIO()
    os.environ.update({"HF_HUB_OFFLINE": "1", **extra_env})
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(list(argv))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue()
