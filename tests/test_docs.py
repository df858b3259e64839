"""The documentation cannot rot: every code block of README.md and docs/ runs here in short form or says
why not; config blocks load; the source tree names files that exist; the configuration reference lists
every key; no section of the old README was lost; the site builds with ``mkdocs build --strict``.

How blocks are sorted and shortened: tests/docs_blocks.py (its table is printed in docs/contributing.md).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest

from tests.docs_blocks import (
    MARK,
    ROOT,
    SUBSTITUTIONS,
    Runner,
    blocks,
    commands,
    documents,
    kind,
    load_data,
    tree_paths,
)

ALL = [(d, b) for d in documents() for b in blocks(d)]

# The headings of the README as it stood before the documentation site (1,417 lines, 2026-12-02), and
# the page that holds each now. A heading may move; it may not disappear.
OLD_README_HEADINGS = {
    "What it does": "docs/design.md",
    "The source tree": "docs/design.md",
    "Using it": "docs/quickstart.md",
    "Using it from Python": "docs/guides/python.md",
    "Policy-optimisation variants (`grpo.*`, `rollout.correction`)": "docs/guides/variants.md",
    "The update schedule, decided": "docs/guides/variants.md",
    "Ready configs (`configs/`)": "docs/reference/ready-configs.md",
    "Competition math: LaTeX answers, MATH, MATH-500, AIME": "docs/guides/competition-math.md",
    "Rewards from models: reward models and LLM judges": "docs/guides/rewards.md",
    "Tools: multi-turn rollouts with a sandboxed Python interpreter": "docs/guides/tools-and-multi-turn.md",
    "Split mode: server, rollout workers and trainer as separate processes": "docs/guides/split-mode.md",
    "vLLM (`rollout.engine=vllm`)": "docs/guides/vllm.md",
    "Model families": "docs/reference/model-families.md",
    "Training at scale": "docs/guides/lora-and-memory.md",
    "Figures": "docs/figures.md",
    "Not yet measured (needs a GPU session)": "docs/unmeasured.md",
    # the figures, each a bold paragraph title then
    "The demo learns": "docs/figures.md",
    "The demo learns with vLLM": "docs/figures.md",
    "Rewards from models": "docs/figures.md",
    "Exact resume": "docs/figures.md",
    "The rewards grade as a careful grader does": "docs/figures.md",
    "Competition-math answers are graded at least as well as math_verify alone": "docs/figures.md",
    "GRPO step vs TRL": "docs/figures.md",
    "Qwen3 beside Qwen2, same benches": "docs/figures.md",
    "Rollout engine": "docs/figures.md",
    "Rollout engines with vLLM": "docs/figures.md",
    "Parity with TRL's own code": "docs/figures.md",
    "The variants learn": "docs/figures.md",
    "What the variants cost the default": "docs/figures.md",
    "No truncated-support bias": "docs/figures.md",
    "Loss-path memory": "docs/figures.md",
    "Split mode": "docs/figures.md",
    "Split mode at scale, exactly once": "docs/figures.md",
    "The demo learns from a learned reward": "docs/figures.md",
    "The tool demo learns to use the tool": "docs/figures.md",
}


def _headings(path) -> set[str]:
    return {m[1].strip() for m in re.finditer(r"^#{1,6} (.+?)(?: \{#[^}]*\})?$", path.read_text(), re.M)}


def test_no_section_of_the_old_readme_is_lost():
    missing = [f"{h!r} (expected in {page})" for h, page in OLD_README_HEADINGS.items()
               if h not in _headings(ROOT / page)]
    assert not missing, "headings of the old README no longer in the docs: " + "; ".join(missing)


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    links = re.findall(r"\]\(((?:docs/)[^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into the docs"
    assert not [link for link in links if not (ROOT / link).exists()]


def test_readme_answers_a_newcomers_four_questions():
    """From the README alone: your own reward, your own dataset, a different loss, several GPUs."""
    text = (ROOT / "README.md").read_text()
    for page in ("docs/guides/rewards.md", "docs/guides/own-model-and-data.md", "docs/guides/variants.md",
                 "docs/guides/several-gpus.md"):
        assert f"]({page}" in text, page


CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_the_cpu_only_torch_command_is_a_real_one_and_the_same_everywhere():
    """The quickstart had `--index-url <PyTorch CPU index>`, a placeholder (issue 50): the README and the
    quickstart give the command itself, the same one, and no page keeps a placeholder index."""
    for page in ("README.md", "docs/quickstart.md"):
        assert CPU_TORCH in (ROOT / page).read_text(), page
    placeholders = [str(d.relative_to(ROOT)) for d in documents()
                    if re.search(r"index-url\s+<", d.read_text())]
    assert not placeholders, placeholders


def test_the_first_run_s_time_comes_with_the_shared_cpu_remedy():
    """Issue 50: 160 s on a quiet 2-core CPU, 4.2x the CPU under load; the newcomer reads the remedy where
    the README and the quickstart say how long the demo takes."""
    for page in ("README.md", "docs/quickstart.md"):
        text = (ROOT / page).read_text()
        assert "2026-12-05" in text and "OMP_NUM_THREADS=1 nanogrpo train" in text, page
        assert "98 s" not in text and "2–4 minutes" not in text, page


@pytest.mark.parametrize("doc_block", ALL, ids=[b.where for _, b in ALL])
def test_every_block_runs_here_or_says_why_not(doc_block):
    _, b = doc_block
    k = kind(b)
    assert k != "unrunnable", (
        f"{b.where}: a ```{b.lang or '(no language)'} block this test cannot run; make it runnable "
        f"(tests/docs_blocks.py: nanogrpo train|eval|report|serve|rollout, Python, config files) or put "
        f"'*Not run here: <why>.*' on the line before its fence")
    if k == "python":
        compile(b.text, b.where, "exec")
    elif k == "data":
        load_data(b)
    elif k == "text":
        bad = [line for line in b.text.splitlines() if re.match(r"\s*(\$ |nanogrpo |pip |python )", line)]
        assert not bad, f"{b.where}: commands in a text block (make it a bash block): {bad}"
        paths = tree_paths(b.text)
        if paths:
            gone = [p for p in paths if not (ROOT / p).exists()]
            assert not gone, f"{b.where}: the tree names missing files: {gone}"


def test_the_marks_are_counted():
    """Both counts, for the report; a mark says why (not just that) a block is not run."""
    marked = [b for _, b in ALL if b.mark]
    run = [b for _, b in ALL if kind(b) in ("shell", "python")]
    assert len(run) >= 15 and marked
    assert all(len(b.mark) > len("*Not run here: .*") + 10 for b in marked)


def test_every_mark_is_one_line():
    """A mark wrapped over two lines is not a mark: its block would run. Say so where it is written."""
    bad = [f"{path}:{i}" for path in documents() for i, line in enumerate(path.read_text().splitlines(), 1)
           if line.lstrip().startswith("*Not run here") and not MARK.match(line)]
    assert not bad, f"a '*Not run here: <why>.*' mark must be one line: {bad}"


def test_the_design_tree_has_every_top_level_part():
    tree = next(p for _, b in ALL if b.path.name == "design.md" and (p := tree_paths(b.text)))
    parts = {f"nanogrpo/{p.name}" + ("/" if p.is_dir() else "") for p in (ROOT / "nanogrpo").iterdir()
             if not p.name.startswith("__") or p.name == "__init__.py"}
    missing = sorted(p for p in parts if not any(t.startswith(p) for t in tree))
    assert not missing, f"not in docs/design.md's tree: {missing}"


def _reference():
    path = ROOT / "docs/scripts/config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def reference():
    """The generator module and its text (made once: it reads every config class's source)."""
    ref = _reference()
    return ref, ref.markdown()


def test_the_committed_config_reference_is_the_code_s(reference):
    """docs/reference/config.md holds the generated reference (a reader of the repository finds it, not a
    placeholder filled only when the site is built; issue 44): it must be what the code generates now."""
    ref, md = reference
    page = ROOT / "docs" / ref.PAGE
    text = page.read_text()
    assert ref.filled(text, md) == text, (f"{page} is stale (a config key or its docstring changed): run "
                                          "python docs/scripts/config_reference.py --write")
    assert "### `grpo.group_size` {#grpo.group_size}" in text


@pytest.mark.slow  # over 0.4 s on the 2-core machine: the full suite runs it
def test_the_config_reference_lists_every_key_with_its_meaning(reference):
    from nanogrpo.config import Config

    ref, md = reference

    def accepted(cls, prefix=""):
        for name, info in cls.model_fields.items():
            if hasattr(info.annotation, "model_fields"):
                yield from accepted(info.annotation, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    keys = list(accepted(Config))
    assert len(keys) > 150
    assert not [k for k in keys if f"### `{k}` {{#{k}}}" not in md]
    no_doc = [key for key, _, owner in ref.keys() if key.rsplit(".", 1)[1] not in ref.field_docs(owner)]
    assert not no_doc, f"config keys without a docstring under them (DESIGN §6): {no_doc}"
    # a value read from the code, not written by hand: a default and a bound
    assert "### `grpo.group_size` {#grpo.group_size}\n\n**type** `int` (≥ 2) · **default** `8`" in md
    assert '**type** `"auto" | "plain"`' in md


def test_the_substitution_table_is_the_one_the_docs_show():
    page = (ROOT / "docs/contributing.md").read_text()
    for what, becomes, _why in SUBSTITUTIONS:
        assert f"| {what} | {becomes} |" in page, what


def test_shell_commands_are_parsed_as_a_shell_would():
    cmds = commands("OMP_NUM_THREADS=1 nanogrpo train --steps 2 \\\n"
                    "    'rewards.functions=[\"a\",\"b\"]'  # c\n"
                    "nanogrpo serve --port 8471 &\npip install x && nanogrpo train")
    assert [c.argv for c in cmds] == [["nanogrpo", "train", "--steps", "2", 'rewards.functions=["a","b"]'],
                                      ["nanogrpo", "serve", "--port", "8471"], ["pip", "install", "x"],
                                      ["nanogrpo", "train"]]
    assert cmds[0].env == {"OMP_NUM_THREADS": "1"} and cmds[1].background and not cmds[2].background


@pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs not installed (pip install -e '.[docs]'); .ci/run builds the site")
@pytest.mark.slow  # ~2.5 s; .ci/run builds the site strict as well
def test_the_site_builds_strict(tmp_path):
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    r = subprocess.run(build,
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert 'id="grpo.loss"' in page and 'id="train.backend"' in page


RUNNABLE = [d for d in documents() if any(kind(b) in ("shell", "python") for b in blocks(d))]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUNNABLE, ids=[str(d.relative_to(ROOT)) for d in RUNNABLE])
def test_the_examples_run(doc, tmp_path):
    """Every block of the page, in order, in a directory of its own: files first written by the page's
    titled blocks, commands in their short form (tests/docs_blocks.py, SUBSTITUTIONS)."""
    runner = Runner(tmp_path)
    for b in blocks(doc):
        if kind(b) != "marked":
            runner.block(b)


def test_a_documented_command_that_fails_fails_the_test(tmp_path):
    """The runner is not a formality: a command that exits non-zero (a typo in a key) is an error naming
    the page and line, and a broken Python block too."""
    from tests.docs_blocks import Block

    runner = Runner(tmp_path)
    bad = Block(ROOT / "docs/quickstart.md", 7, "bash", None, "nanogrpo train grpo.grop_size=3", None)
    with pytest.raises(AssertionError, match=r"(?s)docs/quickstart.md:7: .*exited with 2.*'group_size'"):
        runner.block(bad)
    code = "import nanogrpo\nnanogrpo.no_such_function()"
    with pytest.raises(AssertionError, match=r"(?s)README.md:9: .*exited with 1.*'no_such_function'"):
        runner.block(Block(ROOT / "README.md", 9, "python", None, code, None))
