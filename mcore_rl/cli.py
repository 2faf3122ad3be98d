"""``mcore-rl`` command line: one subcommand per tool; each lives next to its component and registers here.

Subcommands import their (heavy) modules only when run, so ``mcore-rl --help`` stays instant. Every
expected failure (an :class:`~mcore_rl.io.errors.InputError`: a config key, a data file, a tokenizer, a
scorer; a disk that is full) ends in one line on stderr naming the file or field; ``--debug`` adds the
traceback. Exit codes:

- 0: done (a finished run run again: nothing to do);
- 1: an error, in one line (a worker lost more than ``trainer.max_restarts`` times, a hung phase, a checkpoint
  that cannot be written with ``trainer.on_save_failure=stop``: all 1);
- 2: a bad flag (as argparse's own);
- 75: ``train`` stopped by SIGTERM or SIGUSR1 (a scheduler's preemption or time limit) at the end of a step,
  with a run checkpoint saved: run the same command again to resume (``launch/ray_on_slurm.sbatch`` requeues
  the job on it);
- ``128 + signum``: interrupted by a signal at once (SIGINT, SIGHUP, a second SIGTERM or SIGUSR1; SIGTERM or
  SIGUSR1 outside a training run's RL steps), partial output removed.

The console holds the progress bars and results: each Ray rank's own output goes to
``<logging.log_dir>/workers/<Class>_rank<k>.log`` and Ray's INFO lines are off; ``--verbose`` (any position,
or ``MCORE_RL_VERBOSE=1``) keeps both live on the console.
``key=value`` overrides may come before or after a flag (``train RECIPE --in-process k=v``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from types import ModuleType

from mcore_rl.io.errors import EXIT_PREEMPTED, Interrupted, Preempted

# subcommand -> module providing ``add_arguments(parser)`` and ``run(args) -> int``, and its one-line help.
SUBCOMMANDS = {
    "convert": ("mcore_rl.convert.cli", "convert checkpoints between Hugging Face and megatron-core formats"),
    "config": ("mcore_rl.config.cli", "show the resolved run config of a recipe with key=value overrides"),
    "plan": ("mcore_rl.planner.cli", "per-GPU memory of a run's phases, whether it fits, a layout that does"),
    "train": ("mcore_rl.trainer.cli", "an RL run (GRPO and kin, SFT warm start) from a recipe, on Ray"),
    "sft": ("mcore_rl.trainer.sft_cli", "supervised fine-tuning from a recipe, on the RL run's engines"),
    "dpo": ("mcore_rl.dpo.cli", "a DPO run (sigmoid, cDPO, robust, IPO, hinge) from a recipe, SPMD ranks"),
    "eval": ("mcore_rl.trainer.eval_cli", "greedy accuracy, pass@k and mean reward of a model on verl data"),
    "data": ("mcore_rl.data.cli", "prepare a local GSM8K or MATH copy as verl-format parquet"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-rl", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (any position)")
    parser.add_argument(
        "--verbose", action="store_true", help="Ray's and every rank's own output live on the console"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MCORE_RL_DEBUG", "") not in ("", "0")
    if "--verbose" in argv:
        # read by the Ray start (controller.resources) and the worker spec (trainer.build), both in this process
        # or inherited by the Ray workers it starts
        os.environ["MCORE_RL_VERBOSE"] = "1"
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints usage / the unknown-command error and exits
        return 2
    module, args = parse_command(argv)
    _quiet_expected_warnings()
    from mcore_rl.io.signals import raise_on_signals

    with raise_on_signals():
        try:
            return int(module.run(args) or 0)
        except SystemExit:
            raise
        except BaseException as err:  # torch's CheckpointException is a BaseException too
            return _report(f"mcore-rl {argv[0]}", err, debug)


def parse_command(argv: list[str]) -> tuple[ModuleType, argparse.Namespace]:
    """The subcommand module of ``argv[0]`` and its parsed arguments (nothing is run). Positionals and flags
    may be intermixed, so ``key=value`` overrides can follow a flag; a bad flag exits 2 with argparse's
    usage line."""
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"mcore-rl {argv[0]}", description=help_text)
    module.add_arguments(parser)
    try:
        return module, parser.parse_intermixed_args(argv[1:])
    except TypeError:  # argparse cannot intermix sub-commands (convert's directions): they take flags only
        return module, parser.parse_args(argv[1:])


def _quiet_expected_warnings() -> None:
    """Without CUDA, megatron warns at import that Transformer-Engine and Apex are absent: expected on a CPU
    machine, and eight lines of it would bury a command's one-line error. With CUDA the warning stays."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def _report(prog: str, err: BaseException, debug: bool) -> int:
    """One line on stderr for a failure, and its exit code; the traceback too with ``--debug``."""
    from mcore_rl.io.errors import InputError, UsageError
    from mcore_rl.parallel.layout import LayoutError

    if debug:
        traceback.print_exception(err)
    cause = getattr(err, "cause", None)  # a worker's own error (controller.WorkerError), as itself
    if isinstance(cause, InputError) and not isinstance(err, InputError):
        prog = f"{prog}: rank {getattr(err, 'rank', '?')}"
        err = cause
    if type(err).__name__ == "CheckpointException":  # torch's: the rank's own failure, as itself
        from mcore_rl.io.checkpoint_read import checkpoint_failure

        err = checkpoint_failure(err) or err
    if isinstance(err, Preempted):
        line, code = f"{prog}: {err}", EXIT_PREEMPTED
    elif isinstance(err, Interrupted):
        line, code = f"{prog}: {err}; partial output removed", 128 + err.signum
    elif isinstance(err, KeyboardInterrupt):
        line, code = f"{prog}: interrupted; partial output removed", 130
    elif getattr(err, "kind", None) in ("died", "hung"):  # controller.WorkerError: a lost or hung rank
        line, code = f"{prog}: error: {err}", 1
    elif isinstance(err, (InputError, LayoutError)):
        # 1 for every input error, so an unknown key exits alike from `config show` and `train` (README);
        # 2 is a bad flag's, as argparse's own. (`plan` keeps 2 for bad input: its 1 means "does not fit".)
        line, code = f"{prog}: error: {err}", 2 if isinstance(err, UsageError) else 1
    elif isinstance(err, OSError):
        line, code = f"{prog}: error: {_os_error(err)}", 1
    else:
        hint = "" if debug else " (run with --debug for the traceback)"
        line, code = f"{prog}: internal error: {type(err).__name__}: {err}{hint}", 1
    print(" ".join(line.split()), file=sys.stderr, flush=True)  # one line, whatever the message holds
    return code


def _os_error(err: OSError) -> str:
    """``path: reason`` for the file the system refused (the real cause, not a guess about the file)."""
    names = " -> ".join(str(n) for n in (err.filename, err.filename2) if n is not None)
    reason = err.strerror or str(err)
    return f"{names}: {reason}" if names else reason


if __name__ == "__main__":
    sys.exit(main())
