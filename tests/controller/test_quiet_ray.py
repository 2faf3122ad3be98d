"""The console stays quiet by default: Ray's notice that its local cluster uses token authentication (the
secure default) is dropped, its warning that authentication is off is not; ``--verbose`` keeps both."""

from __future__ import annotations

import logging

import pytest

from mcore_rl.controller import resources

AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _records(message: str) -> list[str]:
    record = logging.LogRecord(AUTH_LOGGER, logging.WARNING, __file__, 1, message, None, None)
    return [record.getMessage()] if logging.getLogger(AUTH_LOGGER).filter(record) else []


def test_only_the_secure_default_notice_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger(AUTH_LOGGER)
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.delenv("MCORE_RL_VERBOSE", raising=False)
    monkeypatch.setattr("ray.init", lambda **kwargs: None)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr(resources, "register_tensor_transport", lambda: None)
    resources.init_ray(resources.RayConfig(num_cpus=1))
    resources.init_ray(resources.RayConfig(num_cpus=1))
    assert len(logger.filters) == 1, logger.filters
    assert _records("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=...") == []
    off = "Token authentication is disabled for this Ray cluster. Anyone with network access ..."
    assert _records(off) == [off]


def test_verbose_keeps_every_ray_line(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger(AUTH_LOGGER)
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setenv("MCORE_RL_VERBOSE", "1")
    monkeypatch.setattr("ray.init", lambda **kwargs: None)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    monkeypatch.setattr(resources, "register_tensor_transport", lambda: None)
    resources.init_ray(resources.RayConfig(num_cpus=1))
    assert logger.filters == []
