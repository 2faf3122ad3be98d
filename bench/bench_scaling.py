"""How the GRPO step's cost grows with work (issue 33, item 5): step time against response length and
against samples per prompt, ours and TRL's, one fresh ``bench.bench_grpo_step`` process per point.

Two sweeps: new tokens per response (``--lengths``, default 32,128,512) at ``--n`` samples per prompt
(default 8), and samples per prompt (``--samples``, default 4,8,16) at ``--new-tokens`` (default 128). Each
point runs in its own process, so no allocator state or thread placement carries from one point to the next,
and the points run one after another, never two at once: each side's timing needs the whole machine. A point
that lies on both sweeps (128 tokens x 8 samples by default) is measured once and used in both.

Growth, two ways, each flagged where ours is worse than TRL's by more than ``--tolerance``:
- as a ratio, ours(point) / ours(first point of its sweep) against TRL(point) / TRL(first point) (equivalently:
  the ratio TRL/ours at that point below the one at the sweep's first point);
- in seconds, what each side's step added since the sweep's first point (the cost of the added work).
The two disagree where the sides' fixed costs differ: a step at its compute limit grows as the FLOPs do, while
one with large fixed per-step costs grows less in ratio for more added seconds. So the table also gives the
compute limit's own growth (the step's matmul FLOPs at the rates measured at each point) and each side's
share of its limit.

Everything goes under ``--out`` (default bench/out/scaling), named with the run's timestamp so that no run
overwrites another's: scaling-STAMP.json (the settings and each point's full bench_grpo_step JSON and report),
scaling-STAMP.md (the table) and scaling-STAMP.png (two log-log panels, the ratio written at each point).
``--replot FILE.json`` rebuilds the table and the plot from an earlier run's JSON without measuring.

    python -m bench.bench_scaling [--model realistic] [--rounds 1] [--threads 2]

The README's run: ``--bench-args="--sides-in-turn --micro-batch-tokens 9216"`` (our steps first with our host
cache kept between them, as ``mcore-rl train`` keeps it, then returned before TRL's process starts, so that
the two fit one after the other at 512 new tokens on 24 GiB; our update in micro-batches of at most the 128 x 8
batch's tokens, as ``algorithm.ppo_max_token_len_per_gpu`` would split it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).parents[1]
SIDES = ("ours", "trl")
# sweep name -> (axis label, the fixed quantity's label); a point's x is its new tokens or its samples
SWEEPS = {
    "new_tokens": ("new tokens per response", "samples per prompt"),
    "samples": ("samples per prompt", "new tokens"),
}


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured workload: ``new_tokens`` per response, ``n`` samples per prompt."""

    new_tokens: int
    n: int

    def x(self, sweep: str) -> int:
        """The swept quantity of this point."""
        return self.new_tokens if sweep == "new_tokens" else self.n

    def fixed(self, sweep: str) -> int:
        """The quantity held fixed along ``sweep``."""
        return self.n if sweep == "new_tokens" else self.new_tokens


@dataclasses.dataclass(frozen=True)
class SideTimes:
    """One side's step seconds over a point's rounds, and its median step's share of the compute limit
    (None in records that lack it)."""

    median_s: float
    min_s: float
    max_s: float
    limit_percent: float | None = None


@dataclasses.dataclass(frozen=True)
class GrowthRow:
    """One point of a sweep, against the sweep's first point."""

    point: Point
    ours: SideTimes
    trl: SideTimes
    ours_growth: float  # ours(point) / ours(first point), medians
    trl_growth: float  # TRL(point) / TRL(first point), medians
    ours_added_s: float  # ours(point) - ours(first point), medians
    trl_added_s: float  # TRL(point) - TRL(first point), medians
    limit_growth: float | None = None  # the step's compute limit at the point over at the first point
    limit_s: float | None = None  # the step's compute limit at the point

    @property
    def ratio(self) -> float:
        """TRL / ours step time: above 1, ours is faster."""
        return self.trl.median_s / self.ours.median_s

    def grows_faster(self, tolerance: float) -> bool:
        """Whether our step time grew faster than TRL's from the first point by more than ``tolerance``."""
        return self.ours_growth > self.trl_growth * (1 + tolerance)

    def adds_more(self, tolerance: float) -> bool:
        """Whether our step added more seconds than TRL's since the first point by more than ``tolerance``."""
        return self.ours_added_s > self.trl_added_s * (1 + tolerance)


def side_times(step_json: dict[str, Any]) -> dict[str, SideTimes]:
    """The step seconds per side in one ``bench_grpo_step --json`` file (this and :func:`compute_limit_s` are
    the places that know its layout).

    Expects ``{"sides": {"ours": {"step_s": {"median": s, "min": s, "max": s}, "compute_limit_percent": p},
    "trl": {...}}, ...}`` (the percentage optional).
    """
    times = {}
    for side in SIDES:
        try:
            record = step_json["sides"][side]
            step = record["step_s"]
            percent = record.get("compute_limit_percent")
            times[side] = SideTimes(
                float(step["median"]),
                float(step["min"]),
                float(step["max"]),
                None if percent is None else float(percent),
            )
        except (KeyError, TypeError, AttributeError) as missing:
            raise ValueError(f"bench_grpo_step JSON: sides.{side}.step_s has no {missing}") from None
    return times


def compute_limit_s(step_json: dict[str, Any]) -> float | None:
    """The step's compute limit in one ``bench_grpo_step --json`` file (``limits.compute_s``), if it has one."""
    limit = step_json.get("limits", {}).get("compute_s")
    return None if limit is None else float(limit)


def parse_ints(text: str, flag: str) -> list[int]:
    """``"32,128,512"`` -> ``[32, 128, 512]``; a sweep needs at least one positive value, in rising order."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1 or values != sorted(set(values)):
        raise ValueError(f"{flag}: want rising positive integers, got {text!r}")
    return values


def sweep_points(lengths: list[int], n: int, samples: list[int], new_tokens: int) -> dict[str, list[Point]]:
    """The points of each sweep, in sweep order (the first is the growth baseline)."""
    return {
        "new_tokens": [Point(length, n) for length in lengths],
        "samples": [Point(new_tokens, s) for s in samples],
    }


def growth_rows(
    points: list[Point],
    times: dict[Point, dict[str, SideTimes]],
    limits: dict[Point, float | None] | None = None,
) -> list[GrowthRow]:
    """Each point of one sweep with both sides' growth since the sweep's first point (and the compute
    limit's, where ``limits`` has the point's and the first point's)."""
    first, limits = times[points[0]], limits or {}
    first_limit = limits.get(points[0])
    rows = []
    for point in points:
        ours, trl, limit = times[point]["ours"], times[point]["trl"], limits.get(point)
        rows.append(
            GrowthRow(
                point,
                ours,
                trl,
                ours.median_s / first["ours"].median_s,
                trl.median_s / first["trl"].median_s,
                ours.median_s - first["ours"].median_s,
                trl.median_s - first["trl"].median_s,
                None if limit is None or first_limit is None else limit / first_limit,
                limit,
            )
        )
    return rows


def _seconds(times: SideTimes) -> str:
    text = f"{times.median_s:.3f}"
    if times.min_s != times.max_s:  # several rounds: their spread (one round has none to show)
        text += f" ({times.min_s:.3f}-{times.max_s:.3f})"
    return text if times.limit_percent is None else f"{text}, {times.limit_percent:.0f}%"


def _growth(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown_table(rows_by_sweep: dict[str, list[GrowthRow]], tolerance: float) -> str:
    """Both sweeps as one markdown table; growth is against each sweep's first point, each side's seconds
    with its share of the compute limit where the record has it."""
    lines = [
        "| sweep | point | ours s | TRL s | TRL/ours | limit growth | ours growth | TRL growth "
        "| added s, ours / TRL | ours grows faster | ours adds more s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for sweep, rows in rows_by_sweep.items():
        for row in rows:
            name = f"{row.point.new_tokens} tokens x {row.point.n} samples"
            faster = "**yes**" if row.grows_faster(tolerance) else "no"
            more = "**yes**" if row.adds_more(tolerance) else "no"
            lines.append(
                f"| {SWEEPS[sweep][0]} | {name} | {_seconds(row.ours)} | {_seconds(row.trl)} | {row.ratio:.2f}x "
                f"| {_growth(row.limit_growth)} | {row.ours_growth:.2f}x | {row.trl_growth:.2f}x "
                f"| {row.ours_added_s:+.2f} / {row.trl_added_s:+.2f} | {faster} | {more} |"
            )
    return "\n".join(lines)


def growth_lines(rows_by_sweep: dict[str, list[GrowthRow]], tolerance: float) -> list[str]:
    """One line per point after each sweep's first: both growths as ratios beside the compute limit's, and
    the seconds each side added, each with its verdict (a side with a smaller fixed cost per step grows
    faster in ratio for the same added seconds, so neither form alone tells the whole story)."""
    lines = []
    for sweep, rows in rows_by_sweep.items():
        axis, fixed = SWEEPS[sweep]
        first = rows[0]
        lines.append(f"{axis} (at {first.point.fixed(sweep)} {fixed}), growth since {first.point.x(sweep)}:")
        for row in rows[1:]:
            ratio = "OURS GROWS FASTER" if row.grows_faster(tolerance) else "ok"
            added = "OURS ADDS MORE" if row.adds_more(tolerance) else "ok"
            limit = "" if row.limit_growth is None else f" (limit {row.limit_growth:.2f}x)"
            lines.append(
                f"  {row.point.x(sweep):>5}: ours {row.ours_growth:.2f}x, TRL {row.trl_growth:.2f}x{limit}  {ratio}"
                f"; added: ours {row.ours_added_s:+.3f}s, TRL {row.trl_added_s:+.3f}s  {added}"
            )
    return lines


def plot(rows_by_sweep: dict[str, list[GrowthRow]], path: Path, title: str, tolerance: float) -> None:
    """Two log-log panels of step time, one per sweep, both sides (and the step's compute limit where the
    record has it), TRL/ours written at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, len(rows_by_sweep), figsize=(6 * len(rows_by_sweep), 4.5), squeeze=False)
    for ax, (sweep, rows) in zip(axes[0], rows_by_sweep.items(), strict=True):
        axis, fixed = SWEEPS[sweep]
        xs = [row.point.x(sweep) for row in rows]
        ax.plot(xs, [row.ours.median_s for row in rows], "o-", label="ours")
        ax.plot(xs, [row.trl.median_s for row in rows], "s--", label="TRL")
        if all(row.limit_s is not None for row in rows):
            ax.plot(xs, [row.limit_s for row in rows], ":", color="gray", label="compute limit")
        for x, row in zip(xs, rows, strict=True):  # the ratio sits in the gap it measures (log midpoint)
            color = "red" if row.grows_faster(tolerance) else "black"
            gap_middle = (row.ours.median_s * row.trl.median_s) ** 0.5
            ax.annotate(
                f"{row.ratio:.2f}x",
                (x, gap_middle),
                textcoords="offset points",
                xytext=(4, 0),
                va="center",
                fontsize=8,
                color=color,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        # plain seconds at 1-2-3-5 steps: the default log labels read "6 x 10^0"
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.margins(x=0.15)
        ax.set_xlabel(axis)
        ax.set_ylabel("step time (s)")
        ax.set_title(
            f"at {rows[0].point.fixed(sweep)} {fixed}; labels: TRL/ours, red where ours grew faster",
            fontsize=10,
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_point(point: Point, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh ``bench_grpo_step`` process at ``point``: its JSON, and its printed report."""
    with tempfile.TemporaryDirectory() as scratch:
        json_path = Path(scratch) / "step.json"
        cmd = [sys.executable, "-m", "bench.bench_grpo_step", "--model", args.model]
        cmd += ["--new-tokens", str(point.new_tokens), "--n", str(point.n), "--rounds", str(args.rounds)]
        cmd += ["--threads", str(args.threads), "--baseline", "trl", "--no-always", "--json", str(json_path)]
        cmd += shlex.split(args.bench_args)
        try:
            done = subprocess.run(
                cmd, cwd=REPO, capture_output=True, text=True, timeout=args.point_timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            sys.exit(f"point {point}: bench_grpo_step ran past --point-timeout-s {args.point_timeout_s}")
        if done.returncode != 0 or not json_path.exists():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
            sys.exit(f"point {point}: bench_grpo_step exited {done.returncode}:\n{shlex.join(cmd)}\n{tail}")
        step_json = json.loads(json_path.read_text())
    return {"new_tokens": point.new_tokens, "n": point.n, "step_json": step_json, "report": done.stdout}


def measure(args: argparse.Namespace, sweeps: dict[str, list[Point]]) -> dict[str, Any]:
    """Every distinct point of ``sweeps``, one after another; the run's record as scaling.json holds it."""
    unique = list(dict.fromkeys(p for points in sweeps.values() for p in points))
    measured = []
    for i, point in enumerate(unique, 1):
        start = time.perf_counter()
        record = run_point(point, args)
        times = side_times(record["step_json"])
        print(
            f"[{i}/{len(unique)}] {point.new_tokens} tokens x {point.n} samples: ours "
            f"{times['ours'].median_s:.3f}s, TRL {times['trl'].median_s:.3f}s "
            f"({time.perf_counter() - start:.0f}s wall)",
            flush=True,
        )
        measured.append(record)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "replot")}
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, check=False
    )
    settings["git"] = commit.stdout.strip()
    settings["time"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    sweep_record = {name: [[p.new_tokens, p.n] for p in points] for name, points in sweeps.items()}
    return {"settings": settings, "sweeps": sweep_record, "points": measured}


def rows_from_record(record: dict[str, Any]) -> dict[str, list[GrowthRow]]:
    """The growth rows of each sweep in a scaling.json record."""
    times = {Point(p["new_tokens"], p["n"]): side_times(p["step_json"]) for p in record["points"]}
    limits = {Point(p["new_tokens"], p["n"]): compute_limit_s(p["step_json"]) for p in record["points"]}
    sweeps = {name: [Point(*p) for p in points] for name, points in record["sweeps"].items()}
    return {name: growth_rows(points, times, limits) for name, points in sweeps.items() if points}


def _stamped(out: Path) -> Path:
    """``out/scaling-STAMP``, a stem no earlier run has used."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem, k = out / f"scaling-{stamp}", 1
    while any(stem.with_suffix(ext).exists() for ext in (".json", ".md", ".png")):
        k += 1
        stem = out / f"scaling-{stamp}-{k}"
    return stem


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=("realistic", "tiny"), default="realistic")
    parser.add_argument("--lengths", default="32,128,512", help="new tokens per response, at --n samples")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt of the length sweep")
    parser.add_argument("--samples", default="4,8,16", help="samples per prompt, at --new-tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens of the samples sweep")
    parser.add_argument("--rounds", type=int, default=1, help="bench_grpo_step rounds per point")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--tolerance", type=float, default=0.0, help="flag a point only where ours grows faster by more"
    )
    parser.add_argument("--bench-args", default="", help="more bench_grpo_step arguments, e.g. '--prompts 4'")
    parser.add_argument("--point-timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench/out/scaling")
    parser.add_argument("--replot", type=Path, help="an earlier run's scaling-*.json: table and plot only")
    args = parser.parse_args()
    try:
        args.lengths = parse_ints(args.lengths, "--lengths")
        args.samples = parse_ints(args.samples, "--samples")
    except ValueError as bad:
        parser.error(str(bad))
    return args


def main() -> None:
    args = _parse()
    if args.replot is not None:
        record = json.loads(args.replot.read_text())
    else:
        record = measure(args, sweep_points(args.lengths, args.n, args.samples, args.new_tokens))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = _stamped(args.out)
    rows = rows_from_record(record)
    table = markdown_table(rows, args.tolerance)
    settings = record["settings"]
    rounds = f"{settings['rounds']} round{'s' if settings['rounds'] > 1 else ''} per point"
    title = f"GRPO step time, {settings['model']} model, ours vs TRL ({rounds}, medians)"
    if args.replot is None:
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    growth = "\n".join(growth_lines(rows, args.tolerance))
    stem.with_suffix(".md").write_text(f"{title}\n\n{table}\n\n```\n{growth}\n```\n")
    plot(rows, stem.with_suffix(".png"), title, args.tolerance)
    print(table)
    print(growth)
    written = (".md", ".png") if args.replot is not None else (".json", ".md", ".png")
    print(f"wrote {', '.join(str(stem.with_suffix(e)) for e in written)}")


if __name__ == "__main__":
    main()
