"""A stand-in subcommand for the process tests: writes an output folder through OutputFolder, slowly.

``--hold-s``: seconds to wait after writing, before committing (a signal arrives meanwhile);
``--go FILE``: wait until FILE exists before committing (two writers commit together);
``--die-mid-commit``: the process dies (os._exit) right after the previous output was moved aside.
Registered into ``mcore_rl.cli.SUBCOMMANDS`` by the test's subprocess, so it runs through ``cli.main``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from mcore_rl.io.output import OutputFolder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True)
    parser.add_argument("--payload", default="new")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--go", default=None)
    parser.add_argument("--die-mid-commit", action="store_true")


def run(args: argparse.Namespace) -> int:
    output = OutputFolder.plan(args.out, overwrite=args.overwrite, kind="test")
    staging = output.begin()
    try:
        with open(os.path.join(staging, "payload.txt"), "w") as f:
            f.write(args.payload)
        print(f"staging {staging}", flush=True)
        time.sleep(args.hold_s)
        while args.go is not None and not os.path.exists(args.go):
            time.sleep(0.01)
        if args.die_mid_commit:
            move_aside = output._move_aside

            def die_after(old: str) -> None:
                move_aside(old)
                os._exit(9)  # what SIGKILL between the two renames leaves

            output._move_aside = die_after  # type: ignore[method-assign]
        output.commit()
    except BaseException:
        output.abort()
        raise
    print("committed", flush=True)
    return 0


if __name__ == "__main__":
    from mcore_rl import cli

    cli.SUBCOMMANDS["slow-write"] = ("tests.io.slow_writer", "test writer")
    # That filter is for megatron's CPU warnings, and deciding on it imports torch: 1.5 s of each of the
    # tests' 7 writer processes, which import neither (main's signal and error handling stay as they are).
    cli._quiet_expected_warnings = lambda: None
    sys.exit(cli.main(sys.argv[1:]))
