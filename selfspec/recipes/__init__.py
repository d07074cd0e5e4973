"""The shipped recipes: YAML run configs installed with the package, found by name from any directory.

They live in the checkout's top-level configs/ folder, which the package installs as `selfspec.configs`.

    selfspec recipes                          # each recipe's name and purpose
    selfspec train --config smollm2-135m_chat # a shipped recipe by name
    selfspec train --config my_recipe.yaml    # or a path: the user's own
    accelerate launch --config_file "$(selfspec recipes --path accelerate/ddp)" -m selfspec train ...

A recipe's first line is a comment that names its purpose; `base: other.yaml` inside a recipe is a path
relative to the recipe's own file, so a user's copy of a shipped recipe keeps working beside it.
Pure standard library: `selfspec.config` resolves `--config` through `find`.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


def _recipe_dir() -> Path:
    """Where the recipes are: the installed `selfspec.configs` (a wheel's copy, or an editable install's
    mapping onto configs/), else a checkout's configs/ beside the package (the source tree on PYTHONPATH)."""
    spec = importlib.util.find_spec("selfspec.configs")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).resolve().parent
    return Path(__file__).resolve().parents[2] / "configs"


RECIPE_DIR = _recipe_dir()


@dataclass(frozen=True)
class Recipe:
    """One shipped YAML file: `name` is its path under the recipe directory without `.yaml`."""

    name: str
    path: Path

    @property
    def purpose(self) -> str:
        """The recipe's first line: a comment that says what it trains, on what hardware."""
        first = self.path.read_text().split("\n", 1)[0]
        return first.lstrip("#").strip().rstrip(".")


def shipped() -> list[Recipe]:
    """Every shipped recipe, training recipes first, then the accelerate launch configs."""
    paths = sorted(RECIPE_DIR.glob("*.yaml")) + sorted(RECIPE_DIR.glob("accelerate/*.yaml"))
    return [Recipe(p.relative_to(RECIPE_DIR).with_suffix("").as_posix(), p) for p in paths]


def find(name_or_path: str | Path) -> Path | None:
    """The file `--config` means: an existing path as given, else the shipped recipe of that name
    (`.yaml` optional), else None."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = path.as_posix().removesuffix(".yaml")
    return next((r.path for r in shipped() if r.name == name), None)


def closest(name: str) -> list[str]:
    """Shipped names that look like `name` (for an error message's 'did you mean')."""
    return difflib.get_close_matches(name.removesuffix(".yaml"), [r.name for r in shipped()], n=2)
