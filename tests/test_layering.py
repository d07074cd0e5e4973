"""Who may import whom inside `selfspec/` (docs/ARCHITECTURE.md): a module imports only its own floor or
lower ones. Every import counts, the ones inside functions too.

    4  cli, commands, demo, the package's __init__ and __main__
    3  evaluation/        (may use training/: train_cost times a training step), serving/
    2  training/          (never evaluation/: what both need lives below)
    1  agreement, data, checkpoint, decoding/
    0  config, model/, metrics, cpu, files, errors, cache, recipes/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "selfspec"
FLOORS = {"config": 0, "model": 0, "metrics": 0, "cpu": 0, "files": 0, "errors": 0, "cache": 0, "recipes": 0,
          "agreement": 1, "data": 1, "checkpoint": 1, "decoding": 1,
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


FILES = sorted(PACKAGE.rglob("*.py"))


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


def test_the_checker_sees_relative_absolute_and_lazy_imports(tmp_path):
    (tmp_path / "training").mkdir()
    module = tmp_path / "training" / "loop.py"
    module.write_text("from ..model import x\nfrom .early_exit import y\nimport selfspec.data\n"
                      "def f():\n    from ..evaluation.exits import z\n")
    assert imported_units(module, tmp_path) == {"model", "training", "data", "evaluation"}
    top = tmp_path / "cli.py"
    top.write_text("from . import checkpoint\nfrom .decoding import g\n")
    assert imported_units(top, tmp_path) == {"checkpoint", "decoding"}
