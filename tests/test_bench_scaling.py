"""bench/bench_scaling.py's pure parts: the sweeps, the growth against each sweep's first point (as a ratio,
in seconds added, and the compute limit's own), the flags where ours is worse than TRL's, and the table, on a
hand-written record."""

from __future__ import annotations

import pytest

from bench.bench_scaling import (
    Point,
    growth_lines,
    markdown_table,
    parse_ints,
    rows_from_record,
    side_times,
    sweep_points,
)


def _step_json(ours_s: float, trl_s: float, limit_s: float | None = None) -> dict:
    side = {"ours": ours_s, "trl": trl_s}
    sides = {k: {"step_s": {"median": v, "min": v, "max": v}} for k, v in side.items()}
    if limit_s is None:  # a record from before the limits were kept
        return {"sides": sides}
    for record in sides.values():
        record["compute_limit_percent"] = 100 * limit_s / record["step_s"]["median"]
    return {"sides": sides, "limits": {"compute_s": limit_s}}


def _record() -> dict:
    # (new tokens, samples) -> (ours s, TRL s, compute limit s); 128 x 8 lies on both sweeps, measured once
    seconds = {(32, 8): (1.0, 2.0, 0.8), (128, 8): (3.0, 8.0, 2.4), (512, 8): (14.0, 24.0, 11.2)}
    seconds |= {(128, 4): (2.0, 4.0, None), (128, 16): (6.0, 15.0, 4.8)}
    points = [{"new_tokens": t, "n": n, "step_json": _step_json(*s)} for (t, n), s in seconds.items()]
    sweeps = {
        name: [[p.new_tokens, p.n] for p in ps]
        for name, ps in sweep_points([32, 128, 512], 8, [4, 8, 16], 128).items()
    }
    return {"settings": {"model": "tiny", "rounds": 1}, "sweeps": sweeps, "points": points}


def test_growth_is_against_each_sweeps_first_point_and_flags_faster_growth() -> None:
    rows = rows_from_record(_record())
    lengths = rows["new_tokens"]
    assert [r.point for r in lengths] == [Point(32, 8), Point(128, 8), Point(512, 8)]
    assert [r.ours_growth for r in lengths] == [1.0, 3.0, 14.0]
    assert [r.trl_growth for r in lengths] == [1.0, 4.0, 12.0]
    assert [r.grows_faster(0.0) for r in lengths] == [False, False, True]
    assert not lengths[2].grows_faster(0.2)  # 14 < 12 x 1.2
    assert [r.ours_added_s for r in lengths] == [0.0, 2.0, 13.0]
    assert [r.adds_more(0.0) for r in lengths] == [False, False, False]  # 13 s added against TRL's 22
    assert [r.limit_growth for r in lengths] == pytest.approx([1.0, 3.0, 14.0])
    assert lengths[1].ours.limit_percent == pytest.approx(80.0)
    samples = rows["samples"]
    assert [r.ours_growth for r in samples] == [1.0, 1.5, 3.0]
    assert [r.trl_growth for r in samples] == [1.0, 2.0, 3.75]
    assert samples[1].ratio == pytest.approx(8.0 / 3.0)
    assert [r.limit_growth for r in samples] == [None, None, None]  # the first point has no limit
    assert samples[2].adds_more(0.0) is False and samples[2].trl_added_s == 11.0


def test_a_side_that_adds_more_seconds_is_flagged() -> None:
    record = _record()
    record["points"][2]["step_json"] = _step_json(30.0, 24.0, 11.2)  # 512 x 8: ours +29 s, TRL +22 s
    row = rows_from_record(record)["new_tokens"][2]
    assert row.adds_more(0.0) and row.adds_more(0.3) and not row.adds_more(0.4)


def test_table_has_a_row_per_sweep_point_and_marks_the_flag() -> None:
    table = markdown_table(rows_from_record(_record()), tolerance=0.0)
    lines = table.splitlines()
    assert len(lines) == 2 + 6  # header, separator, 3 + 3 points
    assert lines[4] == (
        "| new tokens per response | 512 tokens x 8 samples | 14.000, 80% | 24.000, 47% | 1.71x | 14.00x "
        "| 14.00x | 12.00x | +13.00 / +22.00 | **yes** | no |"
    )
    assert "| 4.000 | 2.00x | - |" in lines[5]  # 128 x 4: no limit recorded


def test_growth_lines_give_the_seconds_each_side_added() -> None:
    lines = growth_lines(rows_from_record(_record()), tolerance=0.0)
    assert lines[2] == (
        "    512: ours 14.00x, TRL 12.00x (limit 14.00x)  OURS GROWS FASTER; added: ours +13.000s, TRL +22.000s  ok"
    )
    assert len(lines) == 2 * 3  # a heading and two points per sweep


def test_bad_input_names_the_field() -> None:
    assert parse_ints("4,8,16", "--samples") == [4, 8, 16]
    with pytest.raises(ValueError, match="--samples"):
        parse_ints("8,4", "--samples")
    with pytest.raises(ValueError, match="--lengths"):
        parse_ints("32,x", "--lengths")
    with pytest.raises(ValueError, match=r"sides\.trl\.step_s"):
        side_times({"sides": {"ours": {"step_s": {"median": 1, "min": 1, "max": 1}}}})
