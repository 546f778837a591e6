"""The import layers of DESIGN.md "Layout and layers": no module imports one from a layer above
its own, not even inside a function, and no modules import each other in a circle.

Imports are read from the source (every `import` statement, wherever it sits); nothing is run.
`from a.b import c` counts as importing `a.b.c` when that is a module, else `a.b`, and also
`a.b` itself (the package's `__init__` runs), as Python does.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "posttrain"

# Top layer first; a name is a sub-package or top-level module of posttrain. A module imports
# its own layer or lower ones only; what two siblings both need moves down a layer.
LAYERS = (
    {"cli", "__main__"},
    {"methods", "demo"},
    {"train", "rl", "envs", "eval", "curate", "aot", "_sweep_report", "config_docs"},
    {"losses", "sampling", "rewards", "data", "lora", "serve"},
    {"models", "_flops", "_collectives"},
    {"parallel", "config", "paths", "errors", "testing"},
)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: pathlib.Path, name: str):
    """`(dotted name, line)` of everything `path` imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def import_graph(root: pathlib.Path) -> dict[str, dict[str, int]]:
    """{module: {module of this package it imports: line}}."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_names(path, name):
            while target and target not in files:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
    return graph


def layer(module: str, layers=LAYERS) -> int | None:
    """The layer index of a module (None for the root package itself)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((i for i, names in enumerate(layers) if parts[1] in names), -1)


def violations(root: pathlib.Path, layers=LAYERS) -> list[str]:
    """Every upward import, module without a layer, and circle of modules, as messages."""
    graph = import_graph(root)
    problems = []
    for name, edges in graph.items():
        own = layer(name, layers)
        if own == -1:
            problems.append(f"{name} is in no layer: add its package to LAYERS (and DESIGN.md)")
            continue
        for target, line in edges.items():
            theirs = layer(target, layers)
            if own is None and target != name:
                problems.append(f"{name}:{line} imports {target}: the root package imports none")
            elif theirs is not None and theirs != -1 and theirs < own:
                problems.append(f"{name}:{line} imports {target}, a layer above")
    problems += [f"circle: {' -> '.join(c)}" for c in circles(graph)]
    return problems


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle through each group of modules that import each other (Tarjan's strongly
    connected components), as the path `a -> b -> ... -> a`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_path(graph, group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph, group: set[str]) -> list[str]:
    """A circle inside `group`: follow edges from its first module until one repeats."""
    path = [min(group)]
    while True:
        step = min(w for w in graph[path[-1]] if w in group)
        if step in path:
            return [*path[path.index(step) :], step]
        path.append(step)


def test_posttrain_imports_only_down_and_without_circles():
    assert violations(ROOT) == []


def private_imports(root: pathlib.Path) -> list[str]:
    """`path:line imports name` of every import of another package's private module: a module
    `posttrain.X._y` (one leading underscore, not a dunder) imported from outside package
    `posttrain.X`, at any depth of the importing module's code. Package `__init__`s are the
    public API; what they do not export is private."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    found = set()
    for name, path in files.items():
        for target, line in imported_names(path, name):
            while target and target not in files:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            parts = target.split(".")
            private = len(parts) >= 3 and parts[2].startswith("_") and not parts[2].startswith("__")
            if private and name.split(".")[:2] != parts[:2]:
                found.add((str(path.relative_to(root.parent)), line, target))
    return [f"{path}:{line} imports {target}" for path, line, target in sorted(found)]


def test_no_package_imports_another_packages_private_module():
    assert private_imports(ROOT) == []


def test_a_synthetic_tree_with_private_imports_fails(tmp_path):
    """The check itself: absolute, relative, `from package import _module` and in-function
    imports of another package's private module are each reported; a package's own private
    modules, public names and dunder modules are not."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "__main__.py": "from posttrain.cli import main\n",
            "cli/__init__.py": "from posttrain.cli._main import main\n",
            "cli/_main.py": "def main():\n    from posttrain.train._run import run\n",
            "train/__init__.py": "from posttrain.train._run import run\n",
            "train/_run.py": "from ..data._formats import f\nfrom posttrain.data import load\n",
            "rl/_loss.py": "from posttrain.data import _formats\nimport posttrain.train._run\n",
            "rl/__init__.py": "from posttrain.rl._loss import loss\nfrom posttrain import __main__",
            "data/__init__.py": "from posttrain.data._formats import encode\n\ndef load(): ...\n",
            "data/_formats.py": "from . import _io\n",
            "data/_io.py": "",
        },
    )
    assert private_imports(root) == [
        "posttrain/cli/_main.py:2 imports posttrain.train._run",
        "posttrain/rl/_loss.py:1 imports posttrain.data._formats",
        "posttrain/rl/_loss.py:2 imports posttrain.train._run",
        "posttrain/train/_run.py:1 imports posttrain.data._formats",
    ]


def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "posttrain"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_synthetic_tree_with_each_kind_of_violation_fails(tmp_path):
    """The check itself: an upward import hidden in a function, a relative one, a circle of
    siblings through a package `__init__`, and a package with no layer are each reported."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "cli/__init__.py": "from posttrain.train import run\n",
            "train/__init__.py": "from posttrain.train._run import run\n",
            "train/_run.py": "def run():\n    from posttrain.cli import main\n",
            "eval/__init__.py": "from ..models import forward\nfrom posttrain.train import run\n",
            "models/__init__.py": "def f():\n    from .. import eval\n",
            "rl/__init__.py": "import posttrain.eval\n",
            "rl/_loss.py": "from posttrain import models\n",
            "train/_eval.py": "from posttrain.rl import x\n",
            "widgets/__init__.py": "",
        },
    )
    problems = violations(root)
    assert "posttrain.train._run:2 imports posttrain.cli, a layer above" in problems
    assert "posttrain.models:2 imports posttrain.eval, a layer above" in problems
    assert "posttrain.widgets is in no layer: add its package to LAYERS (and DESIGN.md)" in (
        problems
    )
    circles_found = [p for p in problems if p.startswith("circle")]
    assert circles_found == [
        "circle: posttrain.cli -> posttrain.train -> posttrain.train._run -> posttrain.cli",
        "circle: posttrain.eval -> posttrain.models -> posttrain.eval",
    ]
    # Same-layer and downward imports, relative or not, are fine.
    assert not any(p.startswith(("posttrain.rl", "posttrain.eval:", "posttrain.train._eval"))
                   for p in problems)  # fmt: skip
    assert len(problems) == 5


PKG, SANDBOX = "posttrain.rewards", "posttrain.rewards.sandbox"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import posttrain.rewards.sandbox as sandbox\n", {SANDBOX}),
        ("from posttrain.rewards import sandbox\n", {PKG, SANDBOX}),
        ("from posttrain.rewards import RewardPool\n", {PKG}),
        ("from . import sandbox\n", {PKG, SANDBOX}),
        ("from .sandbox import run\n", {SANDBOX}),
        ("def f():\n    if x:\n        import posttrain.rewards\n", {PKG}),
    ],
)
def test_what_counts_as_an_import(tmp_path, source, expected):
    root = _tree(
        tmp_path,
        {"__init__.py": "", "rewards/__init__.py": "", "rewards/sandbox.py": "",
         "rewards/_code.py": source},
    )  # fmt: skip
    assert set(import_graph(root)["posttrain.rewards._code"]) == expected


# Every loss function the methods train with, and the module where it lives.
LOSSES = {
    "train/_losses.py": ("sft_loss", "dpo_loss", "reference_logps"),
    "train/_reward.py": ("reward_model_loss",),
    "rewards/_reward_model.py": ("reward_scores",),
    "rl/_loss.py": ("rl_loss", "sequence_log_probs"),
}
_LORA = re.compile(r"lora|adapter|quantiz", re.IGNORECASE)


def lora_mentions(path: pathlib.Path, functions) -> list[str]:
    """`function:line name` of every identifier, argument or keyword inside `functions` (or
    the whole module when None) that names LoRA, adapters or quantisation."""
    tree = ast.parse(path.read_text(), str(path))
    scopes = [tree] if functions is None else [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in functions
    ]  # fmt: skip
    found = []
    for scope in scopes:
        for node in ast.walk(scope):
            names = {
                ast.Name: lambda n: [n.id],
                ast.Attribute: lambda n: [n.attr],
                ast.arg: lambda n: [n.arg],
                ast.keyword: lambda n: [n.arg or ""],
                ast.alias: lambda n: [n.name],
            }.get(type(node), lambda n: [])(node)
            found += [f"{getattr(scope, 'name', path.name)}:{node.lineno} {name}"
                      for name in names if _LORA.search(name)]  # fmt: skip
    return found


def test_no_loss_function_mentions_lora(tmp_path):
    """A `posttrain.lora.Policy` runs the trained model for every loss: none of them knows
    whether it trains full weights or adapters on a frozen, possibly quantised base."""
    found = []
    for file, names in LOSSES.items():
        source = (ROOT / file).read_text()
        assert all(f"def {n}(" in source for n in names), file  # (the list is current)
        found += lora_mentions(ROOT / file, names)
    for path in sorted((ROOT / "losses").glob("*.py")):
        found += lora_mentions(path, None)
    assert found == []
    # The check itself: a loss that takes a LoRA config is caught.
    probe = tmp_path / "probe.py"
    probe.write_text("def sft_loss(model_config, lora=None):\n    return wrap(lora, None, {})\n")
    assert lora_mentions(probe, ("sft_loss",)) == ["sft_loss:1 lora", "sft_loss:2 lora"]


def user_private_imports(paths, base: pathlib.Path) -> list[str]:
    """`path:line imports name` of every import of a private posttrain module (`posttrain.X._y`,
    or `from posttrain.X import _y`) in scripts and notebooks (their code cells, IPython's `%`
    and `!` lines left out): they use posttrain as a user does, through the public names."""
    found = []
    for path in paths:
        if path.suffix == ".ipynb":
            cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
            lines = [line for c in cells for line in "".join(c["source"]).splitlines()]
            source = "\n".join("" if line.lstrip()[:1] in "%!" else line for line in lines)
        else:
            source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "posttrain" and any(
                    p.startswith("_") and not p.startswith("__") for p in parts[1:]
                ):
                    found.append(f"{path.relative_to(base)}:{node.lineno} imports {name}")
    return found


def test_notebooks_and_benchmarks_use_only_public_names():
    repo = ROOT.parent
    paths = sorted([*repo.glob("notebooks/*.ipynb"), *repo.glob("benchmarks/*.py")])
    assert len(paths) > 10
    profiler = "benchmarks/decode_profile.py:"  # times the engine's device step itself
    found = [f for f in user_private_imports(paths, repo) if not f.startswith(profiler)]
    assert found == []


def test_a_private_import_in_a_script_or_notebook_is_found(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("from posttrain.sampling._engine import Engine\n"
                      "from posttrain.data import load\n"
                      "from posttrain.rl import _loss\n"
                      "import posttrain.models._config\n")  # fmt: skip
    book = tmp_path / "n.ipynb"
    cell = {
        "cell_type": "code",
        "source": ["import os\n", "from posttrain.demo._shapes import f\n"],
    }
    book.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": ["x"]}, cell]}))
    assert user_private_imports([script, book], tmp_path) == [
        "bench.py:1 imports posttrain.sampling._engine.Engine",
        "bench.py:3 imports posttrain.rl._loss",
        "bench.py:4 imports posttrain.models._config",
        "n.ipynb:2 imports posttrain.demo._shapes.f",
    ]
