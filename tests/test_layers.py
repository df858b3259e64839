"""The house rules of the package's imports, read from the source (``ast``), so they hold for code
that is never run by the other tests:

- **no import circles** between modules, counting every import: module level, inside functions,
  and ``if TYPE_CHECKING:`` blocks alike (a circle that only typing sees is still one in the design);
- **no import up the layers**: each top-level part of ``nanogrpo`` may import its own modules and the
  parts of lower layers, never a part of its own layer or of a higher one;
- **the library imports no demo**: the demos are examples over the library, as a user's package is;
  data, models and config find them by name through their entry points (package metadata), never by import.

The layers, lowest first (README, "The source tree"):

    errors
    entry_points                             the demos found by name: package metadata (entry points)
    algo, http_limits                        the algorithm's pure functions, HTTP bodies read with a cap
                                             (by clients of every layer above)
    batch                                    the wire record (its images' tensors: algo.vision)
    config                                   (which names the algorithm's variants)
    console, hub, grading, tools, transfer,  the screen, asking the HF hub, answer grading, the tool
    watch                                    sandbox, weights to vLLM servers (vLLM's weight-transfer
                                             engines), the run monitor's rules (over metric rows)
    envs                                     multi-turn environments: the interface, loading, calling
    data                                     datasets and prompts (may read answers with grading)
    models, moe                              loading, the embedded models and their warm starts; mixtures of
                                             experts' routers (routes recorded, replayed)
    rewards                                  running rewards: functions, reward models, judges
    engines                                  generation engines: token ids in, ids and log-probs out
    episodes                                 episodes with environments and agent programs (over engines)
    rollout                                  what makes a training batch: groups, tool turns, scores
    evaluation                               evaluation with the training rewards
    training                                 the trainer, its update step, checkpoints, logs
    serve, report, launch                    split mode, plots (each over training); the vLLM servers'
                                             command line
    demos                                    the demos' constants and tasks (rows made in code): found
                                             through their entry points, imported by nothing below
    bench, demos.programs                    benchmarks (they run the demos); the demos' builders and
                                             environments (anything in a demo's folder but its task)
    api                                      the public functions (nanogrpo.train, ...)
    cli                                      the command line, a thin layer over api
    __init__                                 the package: lazy names from api

A package's ``__init__`` re-exporting its submodules (``from nanogrpo.data.sources import
load_rows``) is no circle: ``from nanogrpo.data import sources`` imports the module
``nanogrpo.data.sources``, and is counted as that.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import nanogrpo

PKG = Path(nanogrpo.__file__).parent

LAYERS = [
    {"errors"},
    {"entry_points"},
    {"algo", "http_limits"},
    {"batch"},
    {"config"},
    {"console", "hub", "grading", "tools", "transfer", "watch"},
    {"envs"},
    {"data"},
    {"models", "moe"},
    {"rewards"},
    {"engines"},
    {"episodes"},
    {"rollout"},
    {"evaluation"},
    {"training"},
    {"serve", "report", "launch"},
    {"demos"},
    {"bench", "demos.programs"},
    {"api"},
    {"cli"},
    {"__init__"},
]
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = ["nanogrpo", *path.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (its ``source``) imports, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:  # a submodule by name counts as that module
                sub = f"{module}.{a.name}"
                targets.add(sub if sub in known else module)
    edges = set()
    for t in targets:
        while t and t not in known:  # "nanogrpo.x.y.attr" -> the module it names
            t = t.rpartition(".")[0]
        if t and t != name:
            edges.add(t)
    return edges


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """``module -> modules of nanogrpo it imports``."""
    mods = _modules()
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", set(mods))
            for name, path in mods.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[1:2] == ["demos"] and len(parts) > 3 and parts[3] != "task":
        return "demos.programs"  # a demo's builder or environment sits over the trainer; its task, below data
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = _part(src), _part(dst)
            if a != b and LAYER[b] >= LAYER[a]:
                bad.append(f"{src} -> {dst} ({a} is layer {LAYER[a]}, {b} layer {LAYER[b]})")
    return sorted(bad)


LIBRARY = ("data", "models", "config", "grading", "rewards", "engines", "episodes", "rollout", "algo",
           "training", "transfer", "serve", "envs", "watch", "entry_points")
"""The parts that find the demos by name (:mod:`nanogrpo.entry_points`) and must never import one."""


def demo_imports(graph: dict[str, set[str]], sources: dict[str, str]) -> list[str]:
    """``A imports B`` for each module of a :data:`LIBRARY` part that imports a demo module, by an
    import statement (``graph``) or by its name in a string (``importlib.import_module("nanogrpo.demos.x")``,
    read from ``sources``)."""
    bad = []
    for src in sorted(graph):
        if _part(src) not in LIBRARY:
            continue
        named = demo_names_in(sources[src]) if src in sources else []
        for dst in sorted(set(graph[src]) | set(named)):
            if dst == "nanogrpo.demos" or dst.startswith("nanogrpo.demos."):
                bad.append(f"{src} imports {dst}")
    return bad


def demo_names_in(source: str) -> list[str]:
    """Strings that are a demo submodule's whole dotted name (what ``importlib.import_module`` takes); a
    docstring that mentions one is prose, not a name."""
    pattern = re.compile(r"nanogrpo\.demos(\.\w+)+")  # the package alone is also the entry points' group
    return sorted({node.value for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and pattern.fullmatch(node.value)})


def test_the_library_imports_no_demo():
    """data, models, config and the layers around them name no demo module: the demos register in package
    metadata and are found by name (issue: they were imported by data/sources.py, models/, config/)."""
    mods = _modules()
    sources = {name: path.read_text() for name, path in mods.items() if _part(name) in LIBRARY}
    assert demo_imports(import_graph(), sources) == []


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _modules()}
    assert parts <= set(LAYER), f"parts without a layer in LAYERS: {sorted(parts - set(LAYER))}"


def test_no_import_circles():
    assert find_cycles(import_graph()) == []


def test_no_import_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_walker_sees_what_it_must():
    """The walker is not blind: imports inside functions, under TYPE_CHECKING, relative ones and
    submodules named in a ``from`` are edges; a circle or an upward import made of them is found."""
    known = {"nanogrpo", "nanogrpo.cli", "nanogrpo.serve", "nanogrpo.serve.state", "nanogrpo.serve.server",
             "nanogrpo.serve.routes", "nanogrpo.data", "nanogrpo.data.sources"}
    src = ("from typing import TYPE_CHECKING\n"
           "import json\n"
           "if TYPE_CHECKING:\n    from nanogrpo.serve.server import ServerState\n"
           "from . import state\n"
           "def f():\n    from nanogrpo.cli import main\n"
           "class C:\n    def g(self):\n        import nanogrpo.data.sources\n")
    assert imports_of(src, "nanogrpo.serve.routes", False, known) == {
        "nanogrpo.serve.server", "nanogrpo.serve.state", "nanogrpo.cli", "nanogrpo.data.sources"}
    reexport = "from nanogrpo.data import load_rows"
    assert imports_of(reexport, "nanogrpo.cli", False, known) == {"nanogrpo.data"}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    fake = {"nanogrpo.serve.server": {"nanogrpo.cli"}, "nanogrpo.cli": set()}
    assert upward_imports(fake) == ["nanogrpo.serve.server -> nanogrpo.cli (serve is layer 15, cli layer 19)"]
    graph = import_graph()
    assert "nanogrpo.engines.fast.cached_session" in graph["nanogrpo.engines.fast.engine"]
    assert "nanogrpo.demos.arithmetic.task" in graph["nanogrpo.demos.tools.task"]  # not the package __init__
    assert demo_imports({"nanogrpo.data.sources": {"nanogrpo.demos.game.task", "nanogrpo.errors"},
                         "nanogrpo.bench.variants": {"nanogrpo.demos.arithmetic"}}, {}) == [
        "nanogrpo.data.sources imports nanogrpo.demos.game.task"]
    named = 'import importlib\ndef f():\n    return importlib.import_module("nanogrpo.demos.game.task")\n'
    assert demo_names_in(named) == ["nanogrpo.demos.game.task"]
    assert demo_names_in('"""See :mod:`nanogrpo.demos.game.task`."""\nX = f"nanogrpo.demos.{1}"\n') == []


def test_import_nanogrpo_is_cheap():
    """``import nanogrpo`` loads no torch, transformers or numpy (the public names load on first use).
    Its cost is the import's CPU time (2-3 ms here; importing torch alone takes over a second): on a
    shared machine the wall clock also counts the time other processes hold the cores, and disk waits."""
    code = ("import sys, time; t = time.process_time(); import nanogrpo; dt = time.process_time() - t; "
            "heavy = [m for m in ('torch', 'transformers', 'numpy', 'pydantic', 'yaml') "
            "if m in sys.modules]; "
            "print(heavy, dt)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    heavy, dt = out.rsplit(" ", 1)
    assert heavy == "[]", heavy
    assert float(dt) < 0.5, dt
