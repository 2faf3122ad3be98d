"""The one error type of run configuration."""

from __future__ import annotations

from mcore_rl.io.errors import InputError


class ConfigError(InputError):
    """A run configuration that cannot be used; each line names one full dotted key (and the file or
    override it came from, when known) and, for a choice, the allowed values."""
