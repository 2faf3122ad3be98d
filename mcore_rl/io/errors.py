"""The failures a command expects, and how the CLI reports them.

Every error here is raised with a message that names the file, folder, flag or field at fault, in one line;
``mcore-rl`` prints it (exit 1, or 2 for :class:`UsageError`) without a traceback. Anything else reaching
the top is a bug and is reported as one.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input (a file, folder, config field or environment variable); the message names it.

    Each component's own input errors subclass it (``DataError``, ``TokenizerError``, ``ScorerError``,
    ``SamplingParamsError``, ``PlanError``, ``RolloutLayoutError``, ``ConvertError``, ``FieldError``), so
    that ``mcore-rl`` reports every one as ``error: ...`` (exit 1) and never as an internal error; a new
    error class for something the user gave belongs under it too. A ``ValueError`` still, for callers that
    catch that."""


class ConfigError(InputError):
    """A configuration that cannot be used (a run config, a model's ``config.json``); each line names one
    full dotted key or field (and the file or override it came from, when known) and, for a choice, the
    allowed values."""


class UsageError(InputError):
    """A command-line flag with a bad value (exit code 2, like argparse's own errors)."""


class UnsafeInputError(InputError):
    """An input that would make us run its code or read outside it (crafted pickle, escaping symlink)."""


class OutputError(InputError):
    """An output path we refuse to write (it would touch an input or a folder that is not ours)."""


class CheckpointIntegrityError(InputError):
    """A checkpoint file that is missing, truncated or altered since it was saved (its manifest or its own
    metadata says what it should be); the message names the file."""


class CheckpointSaveError(OutputError):
    """A checkpoint that could not be written (disk full, no permission): its partial folder was removed and
    the previous checkpoint is intact; the message names both."""


class Interrupted(BaseException):
    """A termination signal arrived; raised in the main thread so cleanup runs on the way out.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that ``except Exception`` blocks do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    def __reduce__(self) -> tuple[type, tuple[int]]:
        # Rebuilt from its signal number, not its message: torch.distributed gathers a rank's exception by
        # pickling it (a conversion interrupted inside a checkpoint save), and Interrupted(message) would fail.
        return (type(self), (self.signum,))


class Preempted(BaseException):
    """The run stopped on request (SIGTERM or SIGUSR1: a scheduler's preemption or time limit) at the end of a
    step, with a run checkpoint saved there: ``mcore-rl`` exits :data:`EXIT_PREEMPTED`, and the same command
    resumes it. A ``BaseException``, as :class:`Interrupted`: it ends the run through every ``finally``."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        import signal

        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; run checkpoint {checkpoint} saved; "
            "the same command resumes it"
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, str]]:
        return (type(self), (self.signum, self.step, self.checkpoint))


EXIT_PREEMPTED = 75
"""Exit code of a run stopped by :class:`Preempted` with its checkpoint saved (``EX_TEMPFAIL`` of
sysexits.h: try again later). ``launch/ray_on_slurm.sbatch`` requeues the job on it."""


def note(message: str) -> None:
    """One informational line on stderr (what a command did on the user's behalf, e.g. a cleanup)."""
    import sys

    print(f"mcore-rl: note: {message}", file=sys.stderr, flush=True)
