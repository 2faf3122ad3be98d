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


class Interrupted(BaseException):
    """A termination signal arrived; raised in the main thread so cleanup runs on the way out.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that ``except Exception`` blocks do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


def note(message: str) -> None:
    """One informational line on stderr (what a command did on the user's behalf, e.g. a cleanup)."""
    import sys

    print(f"mcore-rl: note: {message}", file=sys.stderr, flush=True)
