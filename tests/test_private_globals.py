"""No test or tool assigns a private module-level name of a selfspec module.

The rule, checked on the syntax of every file under tests/ and tools/: no assignment (`=`, augmented,
annotated, `del`), no `setattr`/`delattr` (builtin or pytest's `monkeypatch`, a dotted
"selfspec.x._name" string included), and no call of any other helper with (module, "_name") as its
first two arguments (a patching helper), whose target is a name with one leading underscore on an
object that is a selfspec module: `fast._X = ...`, `monkeypatch.setattr(kernels, "_x", ...)`. What a
test or tool needs to change goes through a public switch (`kernels.using`, `fast.kernels_up_to`,
`kernels.wrapped`) or a public name. Allowed: reading private names, patching public module names,
and private attributes of classes and instances (`monkeypatch.setattr(generator, "_cache", ...)`).
A module is a name bound by an import (inside functions too) or an attribute chain from one, whose
dotted path is a file or package under selfspec/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "tools").rglob("*.py")])
READS = {"getattr", "hasattr"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_selfspec_module(dotted: str | None, root: Path = ROOT) -> bool:
    if not dotted or dotted.split(".")[0] != "selfspec":
        return False
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds (anywhere in the file) -> the dotted path it stands for."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:  # `import a.b.c` binds `a`
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def assignments_to_private_globals(source: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, what) for every assignment to a private module-level name of a selfspec module."""
    tree = ast.parse(source)
    aliases = _aliases(tree)

    def module_of(node) -> str | None:
        dotted = _dotted(node, aliases)
        return dotted if _is_selfspec_module(dotted, root) else None

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in [t for top in targets for t in ast.walk(top)]:  # tuples, starred, nested
            if isinstance(target, ast.Attribute) and _is_private(target.attr) and module_of(target.value):
                found.append((node.lineno, f"{module_of(target.value)}.{target.attr}"))
            elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute)
                  and target.value.attr == "__dict__" and module_of(target.value.value)):
                found.append((node.lineno, f"{module_of(target.value.value)}.__dict__[...]"))
        if not isinstance(node, ast.Call) or _callee(node) in READS or not node.args:
            continue
        first, second = node.args[0], node.args[1] if len(node.args) > 1 else None
        if (isinstance(second, ast.Constant) and isinstance(second.value, str) and _is_private(second.value)
                and module_of(first)):
            found.append((node.lineno, f"{module_of(first)}.{second.value}"))
        elif (_callee(node) in ("setattr", "delattr") and isinstance(first, ast.Constant)
              and isinstance(first.value, str) and "." in first.value):
            owner, _, name = first.value.rpartition(".")
            if _is_private(name) and _is_selfspec_module(owner, root):
                found.append((node.lineno, first.value))
    return sorted(found)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_test_or_tool_assigns_a_private_global_of_a_selfspec_module(path):
    found = assignments_to_private_globals(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} assigns private selfspec globals (use a public switch): " \
                      f"{found}"


@pytest.mark.parametrize("source, found", [
    ("from selfspec.model import fast\nfast._X = 1", [(2, "selfspec.model.fast._X")]),
    ("import selfspec.model.fast as f\nf._X += 1", [(2, "selfspec.model.fast._X")]),
    ("import selfspec.model.kernels\nselfspec.model.kernels._built = None",
     [(2, "selfspec.model.kernels._built")]),
    ("def t(monkeypatch):\n    from selfspec.model import kernels\n"
     "    monkeypatch.setattr(kernels, '_built', 1)", [(3, "selfspec.model.kernels._built")]),
    ("def t(monkeypatch):\n    monkeypatch.setattr('selfspec.model.fast._Y', 0)",
     [(2, "selfspec.model.fast._Y")]),
    ("from selfspec import data\nsetattr(data.packing, '_token_stream', None)",
     [(2, "selfspec.data.packing._token_stream")]),
    ("from selfspec.model import kernels\nwith replaced(kernels, '_built', f):\n    pass",
     [(2, "selfspec.model.kernels._built")]),
    ("from selfspec.model import fast\nfast.__dict__['_X'] = 1", [(2, "selfspec.model.fast.__dict__[...]")]),
    # allowed: reads, public names, classes and instances, other packages' modules
    ("from selfspec.model import fast\nx = fast._X\ny = getattr(fast, '_X')", []),
    ("from selfspec.model import kernels\nkernels.few_rows_linear = None", []),
    ("from selfspec.model.fast import FastLlamaBlocks\nFastLlamaBlocks._x = 1", []),
    ("def t(monkeypatch, generator):\n    monkeypatch.setattr(generator, '_cache', None)\n"
     "    generator._x = 1", []),
    ("import torch\ntorch._x = 1\nmonkeypatch.setattr('torch.utils._x', 1)", []),
])
def test_the_rule_finds_each_form_of_assignment_and_only_those(source, found):
    assert assignments_to_private_globals(source) == found
