"""Shared command-line handling for the recipes: --config, a.b=value overrides, --resume, clean errors."""

from __future__ import annotations

import argparse
import sys

from selfspec.config import ConfigError, RunConfig, load_config


def parse_args(description: str, default_config: str) -> tuple[RunConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help=f"YAML run config (default {default_config})")
    parser.add_argument("--resume", action="store_true", help="continue from the last save_state in output_dir")
    parser.add_argument("--force", action="store_true", help="train even if a matching model already exists")
    parser.add_argument("overrides", nargs="*", help="field overrides such as optim.max_steps=100")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    return cfg, args
