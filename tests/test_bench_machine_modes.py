"""bench/bench_machine_modes.py's summary: the split by the 2-thread region probe and the correlations it
prints are computed from the timeline, not assumed."""

from __future__ import annotations

import pytest

from bench.bench_machine_modes import report


def test_the_split_follows_the_two_thread_probe(capsys: pytest.CaptureFixture[str]) -> None:
    # two modes: decode 55 ms with a 4.2 us region, 75 ms with 5.8 us; the 1-thread op does not move
    rows = [(55.0, 4.2, 4.6), (56.0, 4.1, 4.7), (75.0, 5.8, 4.6), (77.0, 5.9, 4.7), (54.0, 4.3, 4.6)]
    report(rows)
    out = capsys.readouterr().out
    assert "near (2-thread region below the middle): 3 iterations, decode median 55.0 ms (spread 3.7%)" in out
    assert "apart: 2 iterations, decode median 76.0 ms (spread 2.7%)" in out
    assert "correlation of decode with the 2-thread region +0.99, with the 1-thread op +0.25" in out
