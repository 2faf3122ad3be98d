"""``mcore-rl config show RECIPE [key=value ...]``: print the resolved run config as YAML."""

from __future__ import annotations

import argparse
import sys

from mcore_rl.config.loader import config_to_yaml, load_config
from mcore_rl.io.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print the resolved config (defaults, recipe chain, overrides)")
    show.add_argument("recipe", nargs="?", help="YAML recipe; omit for the schema defaults")
    show.add_argument("overrides", nargs="*", help="dotted.key=value overrides, applied in order")
    show.add_argument("--check-paths", action="store_true", help="also require data files and model folders")


def run(args: argparse.Namespace) -> int:
    recipe = args.recipe
    overrides = list(args.overrides)
    if recipe is not None and "=" in recipe:  # `config show k=v` without a recipe
        overrides.insert(0, recipe)
        recipe = None
    try:
        cfg = load_config(recipe, overrides, check_paths=args.check_paths)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(cfg))
    return 0
