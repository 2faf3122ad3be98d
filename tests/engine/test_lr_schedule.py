"""The LR schedule (``engine/optim.py``, megatron's OptimizerParamScheduler) on resume: the checkpoint gives
the step count, the config the schedule. megatron's default took the checkpoint's warmup, horizon and decay
style beside the config's peak: a run resumed with more steps ran every added step at ``min_lr``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_rl.engine.optim import OptimConfig, lr_scheduler


def _schedule(optim: OptimConfig, total_steps: int):
    optimizer = SimpleNamespace(param_groups=[{"params": [], "wd_mult": 1.0}])
    engine = SimpleNamespace(optimizers=[optimizer], optimizer=optimizer)
    return lr_scheduler(engine, optim, total_steps), optimizer  # type: ignore[arg-type]


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        scheduler.step(1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def test_a_resume_keeps_the_step_and_takes_the_configs_schedule() -> None:
    first, _ = _schedule(OptimConfig(lr=1.0, lr_warmup_steps=2, lr_decay_style="linear"), total_steps=10)
    _lrs(first, first.optimizer, 5)
    longer = OptimConfig(lr=2.0, lr_warmup_steps=4, lr_decay_style="cosine")
    resumed, optimizer = _schedule(longer, total_steps=20)
    resumed.load_state_dict(first.state_dict())
    fresh, fresh_optimizer = _schedule(longer, total_steps=20)
    expected = _lrs(fresh, fresh_optimizer, 12)[5:]
    assert _lrs(resumed, optimizer, 7) == pytest.approx(expected)
    assert expected[-1] > 0.5  # step 12 of 20 is still decaying, not at min_lr


def test_an_unchanged_resume_continues_the_same_schedule() -> None:
    optim = OptimConfig(lr=1.0, lr_warmup_steps=2, lr_decay_style="cosine", min_lr=0.1)
    straight, optimizer = _schedule(optim, total_steps=10)
    expected = _lrs(straight, optimizer, 10)[4:]
    first, first_optimizer = _schedule(optim, total_steps=10)
    _lrs(first, first_optimizer, 4)
    resumed, resumed_optimizer = _schedule(optim, total_steps=10)
    resumed.load_state_dict(first.state_dict())
    assert _lrs(resumed, resumed_optimizer, 6) == pytest.approx(expected)
    assert expected[-1] == pytest.approx(0.1)
