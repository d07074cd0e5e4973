"""Command-line handling shared by the recipes in train/: --config, a.b=value overrides, --resume, --force.

    cfg, args = parse_recipe_args("Self-speculative fine-tune.", "configs/demo_finetune.yaml")

A bad config or override ends the process with one line on stderr (exit status 1), no traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..config import ConfigError, RunConfig, load_config


def parse_recipe_args(description: str, default_config: str, argv: list[str] | None = None
                      ) -> tuple[RunConfig, argparse.Namespace]:
    """The run config a recipe's command line describes, and the parsed flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config,
                        help=f"YAML run config (default {default_config})")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last save_state in output_dir")
    parser.add_argument("--force", action="store_true",
                        help="replace a previous run in output_dir (pretrain.py: retrain even if a model "
                             "trained with this config is there)")
    parser.add_argument("overrides", nargs="*", help="field overrides such as optim.max_steps=100")
    # intermixed: overrides may stand on both sides of a flag (`a=1 --force b=2`)
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    return cfg, args
