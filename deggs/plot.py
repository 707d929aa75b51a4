"""Plot a run's metrics.jsonl (deggs-plot SAVE_DIR): one PNG with a panel per figure.

Panels, each drawn only when some record has the data for it:

- loss against tokens: the training and the validation loss in bits per token where the
  records have them (bits_per_token, val_bits_per_token), else the integer loss (loss,
  val_loss); validation, written on some steps only, as markers;
- tokens/s against step;
- weights changed per step (updates_max) against step, but not at a resumed step (its
  workers reported that update before the restart);
- learning rate (lr) against step;
- saturation share per matrix against step, from the records' "health" dict;
- bit entropy per matrix against step, from the same dict.

A record's "health" maps a matrix name to either its saturation share (a number) or a
dict of figures in which the share is the first of SATURATION_KEYS present and the bit
entropy is "entropy". Keys that are absent, null, or not finite numbers are skipped
record by record, so older and newer metrics files both plot. A series of a few points
(the health of a short run: once every 50 steps) is drawn with markers, so it shows.

Matplotlib is optional (pip install 'deggs[plot]'); it is imported only when plotting, and
drawn through the Agg canvas directly, so pyplot's global state and the interactive
backend are never touched.
"""

from __future__ import annotations

import io
import logging
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .files import read_metrics, write_atomic

log = logging.getLogger(__name__)

DEFAULT_NAME = "metrics.png"
INSTALL_HINT = "pip install 'deggs[plot]'"
# Where a matrix's health entry is a dict: the first of these that holds a number.
SATURATION_KEYS = ("saturation", "saturation_share", "saturated", "saturated_share", "sat")
MAX_LEGEND = 12  # matrices named in the health panel's legend (the most saturated ones)
FEW_POINTS = 20  # a series this short gets markers: a line through one point shows nothing
EXIT_BAD_INPUT = 2  # as deggs.cli: a user's mistake, or a refusal that retrying cannot fix


class PlotError(RuntimeError):
    """A plot that cannot be made; the message says why, in one line."""


@dataclass
class Series:
    label: str
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    style: str = "line"  # "line" or "markers" (sparse values, such as validation)


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    ymin: float | None = None  # a fixed lower limit (shares start at 0)
    legend: bool = True
    low_first: bool = False  # a trimmed legend names the lowest series, not the highest


def _number(value: Any) -> float | None:
    """VALUE as a finite float, or None (absent, null, bool, text, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def _series(
    records: Iterable[Mapping[str, Any]],
    x_key: str,
    y_key: str,
    label: str,
    style: str = "line",
) -> Series:
    s = Series(label, style=style)
    for r in records:
        x, y = _number(r.get(x_key)), _number(r.get(y_key))
        if x is not None and y is not None:
            s.xs.append(x)
            s.ys.append(y)
    return s


def saturation_share(entry: Any) -> float | None:
    """A matrix's saturation share from its health entry (a number, or a dict of figures)."""
    if isinstance(entry, Mapping):
        for key in SATURATION_KEYS:
            share = _number(entry.get(key))
            if share is not None:
                return share
        return None
    return _number(entry)


def bit_entropy(entry: Any) -> float | None:
    """A matrix's bit entropy from its health entry (only a dict of figures has one)."""
    return _number(entry.get("entropy")) if isinstance(entry, Mapping) else None


def _health_series(records: Iterable[Mapping[str, Any]], figure=saturation_share) -> list[Series]:
    by_matrix: dict[str, Series] = {}
    for r in records:
        step, health = _number(r.get("step")), r.get("health")
        if step is None or not isinstance(health, Mapping):
            continue
        for name, entry in health.items():
            value = figure(entry)
            if value is not None:
                s = by_matrix.setdefault(str(name), Series(str(name)))
                s.xs.append(step)
                s.ys.append(value)
    return list(by_matrix.values())


def collect_panels(records: list[dict]) -> list[Panel]:
    """The panels that RECORDS have data for, in drawing order; pure (no matplotlib)."""
    bits = any(_number(r.get("bits_per_token")) is not None for r in records)
    train, val, unit = (
        ("bits_per_token", "val_bits_per_token", "bits per token")
        if bits
        else ("loss", "val_loss", "loss (1/16 units)")
    )
    updated = [r for r in records if not r.get("resumed")]
    panels = [
        Panel(
            "loss",
            "tokens",
            unit,
            [
                _series(records, "tokens", train, "training (mean of the perturbed members)"),
                _series(records, "tokens", val, "validation (unperturbed)", style="markers"),
            ],
        ),
        Panel("throughput", "step", "tokens/s", [_series(records, "step", "tokens_per_s", "")]),
        Panel(
            "weights changed per step",
            "step",
            "updates (max over workers)",
            [_series(updated, "step", "updates_max", "")],
            ymin=0,
        ),
        Panel("learning rate", "step", "lr", [_series(records, "step", "lr", "")]),
    ]
    health = _health_series(records)
    if health:
        panels.append(
            Panel("saturation share per matrix", "step", "share saturated", health, ymin=0)
        )
    entropy = _health_series(records, bit_entropy)
    if entropy:  # a matrix whose entropy falls uses fewer of its 256 values
        panels.append(
            Panel("bit entropy per matrix", "step", "bits", entropy, ymin=0, low_first=True)
        )
    kept = []
    for p in panels:
        p.series = [s for s in p.series if s.xs]
        if p.series:
            kept.append(p)
        else:
            log.debug("no data for the %s panel", p.title)
    return kept


def _import_matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), or PlotError naming the extra to install."""
    try:
        import matplotlib  # noqa: F401  (first, so that a missing package is seen here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotError(f"plotting needs matplotlib ({e}): {INSTALL_HINT}") from e
    return Figure, FigureCanvasAgg


def _draw_panel(ax: Any, panel: Panel) -> None:
    ax.set_title(panel.title)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    series = panel.series
    named = set()
    if len(series) > MAX_LEGEND:  # name only the most telling: most saturated, least entropy
        if panel.low_first:
            ranked = sorted(series, key=lambda s: min(s.ys))
        else:
            ranked = sorted(series, key=lambda s: max(s.ys), reverse=True)
        named = {id(s) for s in ranked[:MAX_LEGEND]}
    for s in series:
        label = s.label if (not named or id(s) in named) else "_nolegend_"
        if s.style == "markers":
            ax.plot(s.xs, s.ys, "o", markersize=4, label=label)
        else:
            marker = "o" if len(s.xs) <= FEW_POINTS else None
            width = 0.9 if len(series) > 2 else 1.2
            ax.plot(s.xs, s.ys, marker=marker, markersize=3, linewidth=width, label=label)
    if panel.ymin is not None:
        ax.set_ylim(bottom=panel.ymin)
    if panel.legend and any(s.label for s in series):
        which = "lowest" if panel.low_first else "top"
        title = f"{which} {MAX_LEGEND} of {len(series)}" if named else None
        ax.legend(fontsize="small", title=title, title_fontsize="small", ncol=1 + (len(series) > 6))


def plot(save_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Draw SAVE_DIR's metrics.jsonl into OUT_PATH (default SAVE_DIR/metrics.png).

    The file is written atomically (the old one, if any, stays whole until the new one
    replaces it); its format follows OUT_PATH's suffix (png, or any other matplotlib
    writes). Raises PlotError for no metrics, missing matplotlib, or a file it cannot write.
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        raise PlotError(f"{save_dir} is not a directory")
    records = read_metrics(save_dir)
    if not records:
        raise PlotError(f"no metrics in {save_dir}")
    out = Path(out_path) if out_path is not None else save_dir / DEFAULT_NAME
    panels = collect_panels(records)
    if not panels:
        raise PlotError(f"no plottable metrics in {save_dir} ({len(records)} records)")
    figure_cls, canvas_cls = _import_matplotlib()
    fig = figure_cls(figsize=(12, 3.6 * math.ceil(len(panels) / 2)), layout="constrained")
    canvas = canvas_cls(fig)
    fmt = out.suffix.lstrip(".").lower() or "png"
    if fmt not in canvas.get_supported_filetypes():
        raise PlotError(f"cannot write {out}: matplotlib does not write .{fmt} files")
    axes = fig.subplots(math.ceil(len(panels) / 2), 2, squeeze=False).ravel()
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    name = save_dir.resolve().name or str(save_dir)
    done = records[-1]["step"] + 1  # a record is its step's; the model is then at the next
    fig.suptitle(f"{name}: {done} step{'' if done == 1 else 's'} trained")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=100)
    try:
        write_atomic(out, buffer.getvalue())
    except OSError as e:
        raise PlotError(f"cannot write {out}: {e.strerror or e}") from e
    log.info("wrote %s (%d steps, %d panels)", out, len(records), len(panels))
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("save_dir", type=click.Path())
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="image to write (default: SAVE_DIR/metrics.png)",
)
def plot_main(save_dir, out):
    """Plot SAVE_DIR's metrics.jsonl: loss, throughput, weights changed, learning rate,
    and the model health's saturation and bit entropy per matrix."""
    try:
        path = plot(save_dir, out)
    except PlotError as e:
        click.echo(f"deggs-plot: error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    click.echo(str(path))
