"""``mcore-rl`` command line: one subcommand per tool; each lives next to its component and registers here.

Subcommands import their (heavy) modules only when run, so ``mcore-rl --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module providing ``add_arguments(parser)`` and ``run(args) -> int``, and its one-line help.
SUBCOMMANDS = {
    "demo": ("mcore_rl.demo", "the tiny CPU demo run (see README)"),
    "convert": ("mcore_rl.convert.cli", "convert checkpoints between Hugging Face and megatron-core formats"),
    "config": ("mcore_rl.config.cli", "show the resolved run config of a recipe with key=value overrides"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints usage / the unknown-command error and exits
        return 2
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"mcore-rl {argv[0]}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
