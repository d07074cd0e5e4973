"""The recipes (run configs) and the accelerate launch configs (`accelerate/`), the one copy of each.

A checkout shows them here, at the top; the wheel ships this folder inside the package as
`selfspec.configs` (pyproject.toml's `package-dir`), so that `selfspec train --config NAME` and
`selfspec recipes` find them from any directory (`selfspec.recipes`), and `--config configs/NAME.yaml`
works from a checkout.
"""
