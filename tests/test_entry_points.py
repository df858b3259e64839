"""The demos found by their entry points (nanogrpo.entry_points): the shipped demos are found through
package metadata, a third party's package registers its own task the same way, and a missing or broken
registration is one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nanogrpo import entry_points
from nanogrpo.config import DataConfig, config_from, presets
from nanogrpo.data import load_rows
from nanogrpo.errors import DataError, InstallError, ModelError
from nanogrpo.models.source import resolve_model_path

REPO = Path(__file__).resolve().parent.parent
DEMOS = REPO / "nanogrpo" / "demos"

FAKE_TASK = '''
def make_split(split, n):
    return [{"question": f"{split} {i}?", "answer": str(i)} for i in range(n)]
'''


def fake_package(root: Path, name: str, init: str, task: str | None = FAKE_TASK, entry: str | None = None,
                 files: dict[str, str] | None = None) -> Path:
    """A package ``name`` under ``root`` and its installed metadata (a dist-info registering it in the
    ``nanogrpo.demos`` group), as ``pip install`` of a third party's package would leave them."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    if task is not None:
        (pkg / "task.py").write_text(task)
    for rel, text in (files or {}).items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[nanogrpo.demos]\n{name} = {entry or name}\n")
    return pkg


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path for fake installed packages; their modules are forgotten afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        if name.split(".")[0].startswith("thirdparty"):
            del sys.modules[name]


def test_every_demo_folder_is_registered_and_provides_what_it_declares():
    """A demo folder left out of pyproject's entry points would be invisible: each is registered, and its
    preset, weights and task modules are where its constants say."""
    folders = sorted(p.name for p in DEMOS.iterdir() if (p / "__init__.py").is_file())
    demos = {d.name: d for d in entry_points.demos() if d.dist == "nanogrpo"}
    assert sorted(demos) == folders
    for name, d in demos.items():
        assert d.package == f"nanogrpo.demos.{name}" and d.folder == DEMOS / name
        assert d.preset is not None and d.preset_file.is_file(), name
        assert d.model is not None and (d.weights / "config.json").is_file(), name
        for source in d.sources:
            assert entry_points.task_module(source).__name__ == f"nanogrpo.demos.{name}.task"
    assert entry_points.preset_names() == ["demo", "demo-dialogue", "demo-distill", "demo-game", "demo-moe",
                                       "demo-rm", "demo-tools", "demo-vision"]
    assert entry_points.source_names() == ["arithmetic", "dialogue", "game", "multidigit", "vision"]
    assert entry_points.model_demo("embedded").name == "arithmetic"
    assert entry_points.model_demo("embedded-rm").name == "rm"
    assert entry_points.model_demo("embedded-moe").name == "moe"
    assert entry_points.model_demo("nothere") is None and entry_points.preset_file("nothere") is None
    assert entry_points.task_module("nothere") is None


def test_a_third_party_package_registers_its_own_task_preset_and_weights(site):
    """What a user's package does to add a task: an entry point in group ``nanogrpo.demos`` naming a
    package whose constants say what it serves. Data, models and config find it by name."""
    pkg = fake_package(site, "thirdparty_demo", '''
        PRESET = "demo-thirdparty"
        SOURCES = ("thirdparty-rows",)
        MODEL = "thirdparty-model"
        ''', files={"preset.toml": '[data]\nsource = "thirdparty-rows"\ngenerated_train_size = 3\n',
                    "weights/config.json": "{}", "weights/model.safetensors": ""})
    cfg = DataConfig(source="thirdparty-rows", generated_train_size=3, generated_eval_size=2)
    assert load_rows(cfg, "train") == [{"question": f"train {i}?", "answer": str(i)} for i in range(3)]
    assert [r["answer"] for r in load_rows(cfg, "test")] == ["0", "1"]
    assert "demo-thirdparty" in presets()
    loaded = config_from("demo-thirdparty")
    assert loaded.data.source == "thirdparty-rows" and loaded.data.generated_train_size == 3
    assert resolve_model_path("thirdparty-model") == str(pkg / "weights")
    (pkg / "weights" / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="python -m thirdparty_demo.build --out"):
        resolve_model_path("thirdparty-model")
    with pytest.raises(DataError, match=r"unknown data source 'nothere'.*arithmetic, .*thirdparty-rows"):
        load_rows(DataConfig(source="nothere"), "train")


@pytest.mark.parametrize("init, task, entry, match", [
    ('SOURCES = "rows"\n', FAKE_TASK, None, "SOURCES must be a tuple of names"),
    ('MODEL = "org/model"\n', FAKE_TASK, None, "MODEL must be a bare name"),
    ('PRESET = 3\n', FAKE_TASK, None, "PRESET must be a name"),
    ('raise RuntimeError("broken on purpose")\n', FAKE_TASK, None,
     "cannot be imported \\(RuntimeError: broken on purpose\\); fix it or uninstall thirdparty_bad"),
    ('SOURCES = ("arithmetic",)\n', FAKE_TASK, None,
     "nanogrpo.demos.arithmetic \\(nanogrpo\\) and thirdparty_bad \\(thirdparty_bad\\) both register the "
     "data source 'arithmetic'"),
    ('SOURCES = ("thirdparty-rows",)\n', None, None, "has no task module thirdparty_bad.task"),
    ('', FAKE_TASK, "thirdparty_bad:make_split", "name a package, not an object in it"),
], ids=["sources-str", "model-path", "preset-int", "import-fails", "duplicate", "no-task", "object"])
def test_a_broken_registration_is_one_line_naming_it(site, init, task, entry, match):
    fake_package(site, "thirdparty_bad", init, task, entry)
    with pytest.raises(InstallError, match=match) as e:
        entry_points.task_module("thirdparty-rows")
    assert "\n" not in str(e.value)


def _bare_python(code: str, tmp_path: Path, *path: Path) -> subprocess.CompletedProcess:
    """``code`` in a Python without site-packages or PYTHONPATH (``-I -S``), importing this tree's nanogrpo
    through a link (the repository's root may hold a ``nanogrpo.egg-info``), with only ``path`` besides."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "nanogrpo").symlink_to(REPO / "nanogrpo", target_is_directory=True)
    boot = f"import sys; sys.path[:0] = {[str(p) for p in (src, *path)]!r}; " + code
    return subprocess.run([sys.executable, "-I", "-S", "-c", boot], capture_output=True, text=True,
                          cwd=tmp_path)


RUN = ("from nanogrpo import entry_points\nfrom nanogrpo.errors import InstallError\n"
       "try:\n    entry_points.preset_names()\nexcept InstallError as e:\n    print(e)\n")


def test_a_source_tree_never_installed_says_to_pip_install(tmp_path):
    """Run from a checkout with no package metadata (no pip install), the registry knows no demo: the
    error says so and what to run, instead of 'unknown data source arithmetic'."""
    out = _bare_python(RUN, tmp_path / "a")
    assert out.returncode == 0, out.stderr
    assert "nanogrpo's package metadata is not installed" in out.stdout and "pip install -e ." in out.stdout
    stale = tmp_path / "old" / "nanogrpo-0.0.9.dist-info"  # installed before the demos registered themselves
    stale.mkdir(parents=True)
    (stale / "METADATA").write_text("Metadata-Version: 2.1\nName: nanogrpo\nVersion: 0.0.9\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\nnanogrpo = nanogrpo.cli:run\n")
    out = _bare_python(RUN, tmp_path / "b", tmp_path / "old")
    assert out.returncode == 0, out.stderr
    assert "nanogrpo 0.0.9's installed metadata registers no demos" in out.stdout, out.stdout
    assert "pip install -e ." in out.stdout
