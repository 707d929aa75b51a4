#!/usr/bin/env python3
"""The scaling table of runs of one config on 1, 2, ... GPUs (scripts/scaling.sh).

    python scripts/scaling.py [--workers N,N,...] SAVE_DIR [SAVE_DIR ...]

Each SAVE_DIR is a run's save directory; the first is the baseline. With --workers, a
run whose steps had another number of workers than its N is an error (a worker that
crashed or found no GPU would otherwise show as a poor speed-up). A step's time is
the wall time from its record in metrics.jsonl to the next one's (its chunks, the
update every worker repeats, the round trips: all of it), the median past the first
5 steps (compiles, CUDA graph capture) from the first step every worker served in (a
worker that started late, still compiling or loading, is in no step before it). Prints
a line per run: workers, time a step, tokens/s, speed-up over the baseline, the idlest
worker's idle time a step, and whether every step's summed loss equals the baseline's
(it must: where a chunk is computed does not change the math).
"""

from __future__ import annotations

import statistics
import sys
from itertools import pairwise
from pathlib import Path

import click

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from deggs.files import read_metrics  # noqa: E402

SKIP = 5  # steps not timed


def summary(name: str, records: list[dict]) -> dict:
    """One run's figures from its metrics records: timed from SKIP steps past the first
    with all its workers, at least two steps."""
    everyone = max((len(r["workers"]) for r in records), default=0)
    start = SKIP + next((i for i, r in enumerate(records) if len(r["workers"]) == everyone), 0)
    if len(records) < start + 2:
        raise ValueError(
            f"{name}: {len(records)} steps recorded, at least {start + 2} needed "
            f"(all {everyone} workers served from step {start - SKIP})"
        )
    walls = [b["time"] - a["time"] for a, b in pairwise(records[start - 1 :])]
    step = statistics.median(walls)
    timed = records[start:]
    return dict(
        workers=statistics.median(len(r["workers"]) for r in timed),
        step_s=step,
        tokens_per_s=records[0]["tokens"] / step,  # step 0's record counts one step's
        idle_s=statistics.median(max(w["idle_s"] for w in r["workers"].values()) for r in timed),
        losses=[r["sum_loss"] for r in records],
    )


def report(runs: dict[str, list[dict]], workers: list[int] | None = None) -> list[str]:
    """A line per run (name: its records), against the first; workers: the count each
    run asked for."""
    figures = {name: summary(name, records) for name, records in runs.items()}
    for (name, f), n in zip(figures.items(), workers or [], strict=False):
        if f["workers"] != n:
            raise ValueError(f"{name}: {f['workers']:g} workers a step, {n} asked for")
    base = next(iter(figures.values()))
    return [
        f"{name}: {f['workers']:g} workers, {f['step_s']:.3f} s a step, "
        f"{f['tokens_per_s'] / 1e6:.2f} M tokens/s, {base['step_s'] / f['step_s']:.2f}x, "
        f"idlest worker {f['idle_s']:.3f} s a step, losses equal to the first run's: "
        f"{f['losses'] == base['losses']}"
        for name, f in figures.items()
    ]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workers", help="the workers each run asked for, comma-separated")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
def main(workers, dirs):
    counts = None
    if workers:
        try:
            counts = [int(n) for n in workers.split(",")]
        except ValueError:
            raise click.BadParameter(f"not a list of counts: {workers}") from None
        if len(counts) != len(dirs):
            raise click.BadParameter(f"{len(counts)} counts for {len(dirs)} runs")
    try:
        lines = report({d: read_metrics(d) for d in dirs}, counts)
    except ValueError as e:
        click.echo(f"scaling.py: {e}", err=True)
        sys.exit(1)
    click.echo("\n".join(lines))


if __name__ == "__main__":
    main()
