"""Who may import whom inside `selfspec/` (docs/ARCHITECTURE.md): a module imports only its own floor or
lower ones, and no module sits on an import cycle. Every import counts, the ones inside functions too.

    4  cli, commands, demo, the package's __init__ and __main__
    3  evaluation/        (may use training/: train_cost times a training step), serving/
    2  training/          (never evaluation/: what both need lives below)
    1  agreement, data, checkpoint, export, export_gguf, flags, backends/, decoding/
       (backends/ never imports decoding/)
    0  config, model/, metrics, cpu, files, errors, sampling, draft_loop, recipes/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "selfspec"
FLOORS = {"config": 0, "model": 0, "metrics": 0, "cpu": 0, "files": 0, "errors": 0, "sampling": 0,
          "draft_loop": 0, "recipes": 0,
          "agreement": 1, "data": 1, "checkpoint": 1, "export": 1, "export_gguf": 1, "backends": 1,
          "decoding": 1, "flags": 1,
          "training": 2, "evaluation": 3, "serving": 3, "cli": 4, "commands": 4, "demo": 4, "__init__": 4,
          "__main__": 4}


def unit_of(path: Path, root: Path = PACKAGE) -> str:
    """The floor unit a file belongs to: its folder under selfspec/, or its own name at the top."""
    return path.relative_to(root).with_suffix("").parts[0]


def imported_units(path: Path, root: Path = PACKAGE) -> set[str]:
    """The selfspec units that `path` imports (absolute `selfspec.x` and relative imports)."""
    tree = ast.parse(path.read_text())
    depth_of_file = len(path.relative_to(root).parts) - 1  # 0 for selfspec/x.py, 1 for selfspec/model/x.py
    units = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module] if node.module else []
                names = [n.split(".", 2)[1] for n in names if n.startswith("selfspec.")]
            else:
                up = node.level - 1  # `.` is the file's own folder
                if up > depth_of_file:
                    continue
                if up == depth_of_file:  # relative to selfspec/ itself
                    names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                else:  # inside the file's own subpackage
                    names = [path.relative_to(root).parts[0]]
            units.update(names)
        elif isinstance(node, ast.Import):
            units.update(a.name.split(".")[1] for a in node.names if a.name.startswith("selfspec."))
    return units


def module_of(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of a file under the package (a package's `__init__` is the package itself)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports, at the top or inside
    functions. `from x import y` counts the module x.y where there is one, else x (for a package, its
    `__init__`, which defines y); a package's `__init__` counts where it is named so, not as the parent
    that Python runs before each of its submodules."""
    files = {module_of(f, root): f for f in root.rglob("*.py")}

    def resolve(name: str) -> str | None:  # the longest prefix of `name` that is a module of the package
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # `.` is the file's own package, each further dot one package up
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets.update(resolve(f"{base}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
        graph[module] = targets - {None, module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of `graph` as [a, b, ..., a] (a imports b, ...), or None where there is none."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


FILES = sorted(PACKAGE.rglob("*.py"))
# evaluation/'s commands: they stand on its leaves (prompts, timing, costs, diagnosis...), not on each other
EVALUATION_COMMANDS = {f"selfspec.evaluation.{name}"
                       for name in ("benchmark", "sweep", "suite", "doctor", "roofline", "serve_load")}


def test_every_unit_has_a_floor():
    assert {unit_of(f) for f in FILES} <= set(FLOORS), {unit_of(f) for f in FILES} - set(FLOORS)


@pytest.mark.parametrize("path", FILES, ids=[str(f.relative_to(PACKAGE)) for f in FILES])
def test_imports_go_down_or_sideways(path):
    source = unit_of(path)
    for target in imported_units(path) - {source}:
        assert FLOORS[target] <= FLOORS[source], f"{path.relative_to(PACKAGE)} ({source}) imports {target}"


def test_training_and_evaluation_point_one_way():
    training = set().union(*(imported_units(f) for f in (PACKAGE / "training").glob("*.py")))
    evaluation = set().union(*(imported_units(f) for f in (PACKAGE / "evaluation").glob("*.py")))
    assert "evaluation" not in training
    assert "training" in evaluation  # train_cost times a training step: evaluation stands on training


def test_backends_run_passes_below_the_round():
    """The round (decoding/) imports the backends that run its passes, never the reverse: a backend
    knows the model (model/), the shared arithmetic (sampling) and the one draft loop it may capture
    (draft_loop), nothing of proposers, policies or rounds."""
    backends = set().union(*(imported_units(f) for f in (PACKAGE / "backends").rglob("*.py")))
    assert backends <= {"backends", "model", "sampling", "draft_loop", "errors", "cpu", "files"}, backends
    decoding = set().union(*(imported_units(f) for f in (PACKAGE / "decoding").glob("*.py")))
    assert "backends" in decoding


def test_the_checker_sees_relative_absolute_and_lazy_imports(tmp_path):
    (tmp_path / "training").mkdir()
    module = tmp_path / "training" / "loop.py"
    module.write_text("from ..model import x\nfrom .early_exit import y\nimport selfspec.data\n"
                      "def f():\n    from ..evaluation.exits import z\n")
    assert imported_units(module, tmp_path) == {"model", "training", "data", "evaluation"}
    top = tmp_path / "cli.py"
    top.write_text("from . import checkpoint\nfrom .decoding import g\n")
    assert imported_units(top, tmp_path) == {"checkpoint", "decoding"}


def test_no_module_sits_on_an_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_evaluations_commands_import_its_leaves_never_one_another():
    graph = import_graph()
    assert EVALUATION_COMMANDS <= set(graph)
    for module in sorted(m for m in graph if m.startswith("selfspec.evaluation.")):
        commands = sorted(graph[module] & EVALUATION_COMMANDS)
        assert not commands, f"{module} imports {commands}"


def test_the_cycle_finder_sees_imports_inside_functions(tmp_path):
    root = tmp_path / "selfspec"
    (root / "evaluation").mkdir(parents=True)
    (root / "__init__.py").write_text("from .evaluation import bench\n")
    (root / "evaluation" / "__init__.py").write_text("")
    (root / "evaluation" / "bench.py").write_text("from .doctor import summary\nfrom ..model import View\n")
    lazy = "def run():\n    from selfspec.evaluation.bench import go\n"  # inside a function
    (root / "evaluation" / "doctor.py").write_text(lazy)
    (root / "model.py").write_text("import selfspec.evaluation\n")
    graph = import_graph(root)
    assert graph == {"selfspec": {"selfspec.evaluation.bench"}, "selfspec.evaluation": set(),
                     "selfspec.evaluation.bench": {"selfspec.evaluation.doctor", "selfspec.model"},
                     "selfspec.evaluation.doctor": {"selfspec.evaluation.bench"},
                     "selfspec.model": {"selfspec.evaluation"}}
    assert find_cycle(graph) == ["selfspec.evaluation.bench", "selfspec.evaluation.doctor",
                                 "selfspec.evaluation.bench"]
    (root / "evaluation" / "doctor.py").write_text("def run():\n    from . import bench as _\n")
    assert find_cycle(import_graph(root)) == ["selfspec.evaluation.bench", "selfspec.evaluation.doctor",
                                              "selfspec.evaluation.bench"]
    (root / "evaluation" / "doctor.py").write_text("from ..model import x\n")
    assert find_cycle(import_graph(root)) is None
