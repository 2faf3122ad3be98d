"""``mcore-rl config show RECIPE [key=value ...]``: print the resolved run config as YAML.

The config is printed even when it could not run yet (``recipes/base.yaml`` sets no model and no data): the
rules that span sections are then listed on stderr as warnings and the exit status is 0; ``--check`` (and
``--check-paths``, which also requires the files and folders it names) makes them errors, as ``train`` would.
An unknown key or a bad value is always an error: exit status 1, as from ``train`` (every input error of
``mcore-rl`` exits 1; 2 is left to argparse's bad flags).
"""

from __future__ import annotations

import argparse
import sys

from mcore_rl.config.loader import config_to_yaml, load_config
from mcore_rl.config.validate import config_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # A positional, not a sub-parser: argparse cannot intermix a sub-parser's positionals with its flags, and
    # `config show RECIPE --check-paths k=v` must take the override after the flag.
    parser.add_argument(
        "action", choices=["show"], help="show: print the resolved config (defaults, recipe chain, overrides)"
    )
    parser.add_argument(
        "recipe",
        nargs="?",
        help="YAML recipe or a project recipe's name (base, demo_cpu); omit for the defaults",
    )
    parser.add_argument(
        "overrides", nargs="*", default=[], help="dotted.key=value overrides, applied in order"
    )
    parser.add_argument(
        "--check", action="store_true", help="fail (exit 1) when the config cannot run, instead of warning"
    )
    parser.add_argument(
        "--check-paths", action="store_true", help="--check, and also require data files and model folders"
    )


def run(args: argparse.Namespace) -> int:
    recipe = args.recipe
    overrides = list(args.overrides)
    if recipe is not None and "=" in recipe:  # `config show k=v` without a recipe
        overrides.insert(0, recipe)
        recipe = None
    strict = args.check or args.check_paths
    cfg = load_config(recipe, overrides, check_paths=args.check_paths, rules=strict)  # ConfigError: exit 1
    sys.stdout.write(config_to_yaml(cfg))
    sys.stdout.flush()
    problems = [] if strict else config_problems(cfg)
    if problems:
        lines = ["mcore-rl config: warning: a run would refuse this config (--check makes it an error):"]
        print("\n  ".join(lines + problems), file=sys.stderr)
    return 0
