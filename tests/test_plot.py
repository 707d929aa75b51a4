"""deggs.plot: metrics.jsonl to a PNG, and the deggs-plot command.

These tests do not skip without matplotlib: the test extra installs it, and a drawing
test that silently skipped would prove nothing.
"""

from __future__ import annotations

import builtins
import json
import struct
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deggs import plot as plotting
from deggs.plot import PlotError, collect_panels, plot, plot_main, saturation_share

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEP_TOKENS = 4096


def record(step: int, **extra) -> dict:
    """A record with the keys the coordinator's _metrics writes, plus EXTRA."""
    return {
        "step": step,
        "tokens": (step + 1) * STEP_TOKENS,
        "loss": 5.0 - 0.1 * step,
        "sum_loss": 123456 - step,
        "step_time_s": 0.5 + 0.01 * step,
        "updates_total": 1000 + step,
        "updates_min": 10,
        "updates_max": 40 - step,
        "transmissions": 8,
        "tokens_per_s": STEP_TOKENS / (0.5 + 0.01 * step),
        "lr": 0.01 * 0.9**step,
        "bytes_sent": 1 << 20,
        "bytes_received": 1 << 16,
        "time": 1.7e9 + step,
        **extra,
    }


def write_metrics(directory: Path, records: list[dict], tail: bytes = b"") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    (directory / "metrics.jsonl").write_bytes(lines + tail)
    return directory


def run_records(n: int = 8) -> list[dict]:
    """N steps; validation on every third; health from step 2 on (not on the first two)."""
    records = []
    for step in range(n):
        extra: dict[str, object] = {}
        if step % 3 == 2:
            extra.update(
                val_loss=5.2 - 0.1 * step,
                val_bits_per_token=(5.2 - 0.1 * step) / 0.693,
                val_bits_per_byte=1.9 - 0.01 * step,
            )
        if step >= 2:
            extra["health"] = {
                "layers.0.attn.qkv": {"saturation": 0.01 * step, "mean_abs": 30.0},
                "layers.0.mlp.up": 0.02 * step,
            }
        records.append(record(step, **extra))
    return records


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which must come first."""
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def assert_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert 10_000 < len(data) < 5_000_000, len(data)
    width, height = png_size(data)
    assert 800 <= width <= 3000 and 300 <= height <= 3000, (width, height)
    return width, height


def hide_matplotlib_by_sys_modules(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def hide_matplotlib_by_import(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


# --- drawing --------------------------------------------------------------------------------


def test_plot_writes_a_png_beside_the_metrics(tmp_path, caplog):
    save = write_metrics(tmp_path / "run-a", run_records())
    with caplog.at_level("INFO", logger="deggs.plot"):
        out = plot(save)
    assert out == save / "metrics.png"
    width, height = assert_png(out)
    assert (width, height) == (1200, 3 * 360)  # 5 panels: 3 rows of 2
    assert any("wrote" in r.getMessage() and "8 steps" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl", "metrics.png"]  # no temp


def test_plot_to_an_explicit_path_and_replaces_an_old_file(tmp_path):
    save = write_metrics(tmp_path / "run", run_records(4))
    out = tmp_path / "elsewhere" / "m.png"
    out.parent.mkdir()
    out.write_bytes(b"old")
    assert plot(str(save), str(out)) == out
    assert_png(out)
    assert not (save / "metrics.png").exists()
    assert [p.name for p in out.parent.iterdir()] == ["m.png"]


def test_old_style_records_plot_without_val_or_health(tmp_path):
    """Only the keys the coordinator writes today: four panels, two rows."""
    save = write_metrics(tmp_path / "old", [record(s) for s in range(5)])
    assert [p.title for p in collect_panels([record(s) for s in range(5)])] == [
        "loss",
        "throughput",
        "weights changed per step",
        "learning rate",
    ]
    assert png_size((plot(save)).read_bytes()) == (1200, 2 * 360)


def test_torn_and_repeated_lines_are_read_as_read_metrics_reads_them(tmp_path):
    records = [record(0), record(1, loss=9.0), record(1), record(2)]
    save = write_metrics(tmp_path / "torn", records, tail=b'{"step": 3, "loss": 4.')
    assert_png(plot(save))
    loss = collect_panels(records[:1] + records[2:])[0].series[0]
    assert loss.ys == [5.0, 4.9, 4.8]


def test_a_single_step_plots(tmp_path):
    assert_png(plot(write_metrics(tmp_path / "one", [record(0)])))


def test_an_unwritable_out_path_is_a_plot_error(tmp_path):
    save = write_metrics(tmp_path / "run", run_records(3))
    with pytest.raises(PlotError, match="cannot write"):
        plot(save, tmp_path / "missing-dir" / "m.png")
    with pytest.raises(PlotError, match=r"cannot write .*\.xyz"):
        plot(save, tmp_path / "m.xyz")
    assert not list(tmp_path.glob("*.xyz"))


def test_other_formats_follow_the_suffix(tmp_path):
    save = write_metrics(tmp_path / "run", run_records(3))
    assert plot(save, tmp_path / "m.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_a_failed_draw_leaves_the_old_image_whole(tmp_path, monkeypatch):
    save = write_metrics(tmp_path / "run", run_records(3))
    (save / "metrics.png").write_bytes(b"old image")
    from matplotlib.figure import Figure

    def broken(*args, **kwargs):
        raise RuntimeError("renderer failed")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(RuntimeError, match="renderer failed"):
        plot(save)
    assert (save / "metrics.png").read_bytes() == b"old image"
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl", "metrics.png"]


def test_many_matrices_plot_with_a_trimmed_legend(tmp_path):
    health = {f"layers.{i}.mlp.up": 0.001 * i for i in range(40)}
    records = [record(s, health=health) for s in range(3)]
    (panel,) = [p for p in collect_panels(records) if p.title.startswith("saturation")]
    assert len(panel.series) == 40
    assert_png(plot(write_metrics(tmp_path / "big", records)))


# --- errors ---------------------------------------------------------------------------------


def test_an_empty_dir_has_no_metrics(tmp_path):
    with pytest.raises(PlotError, match=f"no metrics in {tmp_path}"):
        plot(tmp_path)
    assert not (tmp_path / "metrics.png").exists()


def test_only_torn_lines_is_no_metrics(tmp_path):
    write_metrics(tmp_path, [], tail=b'{"step": 0, "lo')
    with pytest.raises(PlotError, match="no metrics in"):
        plot(tmp_path)


def test_a_missing_dir_is_a_plot_error(tmp_path):
    with pytest.raises(PlotError, match="is not a directory"):
        plot(tmp_path / "nope")


def test_records_with_nothing_to_draw(tmp_path):
    write_metrics(tmp_path, [{"step": 0}, {"step": 1, "loss": None}])
    with pytest.raises(PlotError, match=r"no plottable metrics .*\(2 records\)"):
        plot(tmp_path)


@pytest.mark.parametrize("hide", [hide_matplotlib_by_sys_modules, hide_matplotlib_by_import])
def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, hide):
    save = write_metrics(tmp_path, run_records(3))
    hide(monkeypatch)
    with pytest.raises(PlotError) as info:
        plot(save)
    assert "pip install 'deggs[plot]'" in str(info.value)
    assert "matplotlib" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    assert not (save / "metrics.png").exists()


# --- what gets drawn (no matplotlib needed) -------------------------------------------------


def test_panels_skip_absent_and_non_numeric_values():
    records = [
        record(0),
        record(1, val_loss=4.0, tokens_per_s=None, lr=float("nan")),
        {"step": 2, "tokens": 3 * STEP_TOKENS, "loss": "n/a", "val_loss": 3.9},
        record(3, updates_max=True, health="not a dict"),
    ]
    panels = {p.title: p for p in collect_panels(records)}
    assert list(panels) == ["loss", "throughput", "weights changed per step", "learning rate"]
    training, validation = panels["loss"].series
    assert training.xs == [STEP_TOKENS, 2 * STEP_TOKENS, 4 * STEP_TOKENS]
    assert (validation.xs, validation.ys, validation.style) == (
        [2 * STEP_TOKENS, 3 * STEP_TOKENS],
        [4.0, 3.9],
        "markers",
    )
    assert panels["throughput"].series[0].xs == [0, 3]
    assert panels["weights changed per step"].series[0].xs == [0, 1]  # a bool is no count
    assert panels["learning rate"].series[0].xs == [0, 3]


def test_health_panel_one_series_per_matrix():
    panels = collect_panels(run_records(6))
    health = panels[-1]
    assert health.title == "saturation share per matrix"
    assert {s.label: (s.xs, s.ys) for s in health.series} == {
        "layers.0.attn.qkv": ([2, 3, 4, 5], [0.02, 0.03, 0.04, 0.05]),
        "layers.0.mlp.up": ([2, 3, 4, 5], [0.04, 0.06, 0.08, 0.1]),
    }


def test_health_as_the_coordinator_writes_it_gives_saturation_and_entropy_panels(tmp_path):
    def health(step):  # 30 matrices; matrix i loses entropy as the steps go by
        return {
            f"layers.{i}.w_up": {
                "mean": 0.1,
                "std": 9.0,
                "saturation": 0.001 * i,
                "entropy": 5 - 0.001 * i * step,
            }
            for i in range(30)
        }

    records = [record(s, health=health(s)) for s in range(0, 150, 50)]
    saturation, entropy = collect_panels(records)[-2:]
    assert saturation.title == "saturation share per matrix" and not saturation.low_first
    assert entropy.title == "bit entropy per matrix" and entropy.low_first and entropy.ymin == 0
    assert entropy.series[29].label == "layers.29.w_up"
    assert entropy.series[29].xs == [0, 50, 100]
    assert entropy.series[29].ys == [5 - 0.001 * 29 * step for step in (0, 50, 100)]
    assert_png(plot(write_metrics(tmp_path / "run", records)))


def test_saturation_share_forms():
    assert saturation_share(0.25) == 0.25
    assert saturation_share({"mean_abs": 3.0, "saturated": 0.5}) == 0.5
    assert saturation_share({"saturation": None, "saturation_share": 0.1}) == 0.1
    assert saturation_share({"mean_abs": 3.0}) is None
    assert saturation_share(None) is None
    assert saturation_share(True) is None
    assert saturation_share(float("inf")) is None


# --- the command ----------------------------------------------------------------------------


def test_command_prints_the_path_written(tmp_path):
    save = write_metrics(tmp_path / "run", run_records(4))
    result = CliRunner().invoke(plot_main, [str(save)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(save / "metrics.png")
    assert_png(save / "metrics.png")


def test_command_out_option(tmp_path):
    save = write_metrics(tmp_path / "run", run_records(4))
    out = tmp_path / "fig.png"
    result = CliRunner().invoke(plot_main, [str(save), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out)
    assert_png(out)


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_command_help(flag):
    result = CliRunner().invoke(plot_main, [flag])
    assert result.exit_code == 0
    assert "SAVE_DIR" in result.output and "--out" in result.output


def test_command_error_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(plot_main, [str(tmp_path)])
    assert result.exit_code == plotting.EXIT_BAD_INPUT == 2
    assert result.output.splitlines() == [f"deggs-plot: error: no metrics in {tmp_path}"]


def test_command_missing_matplotlib(tmp_path, monkeypatch):
    save = write_metrics(tmp_path, run_records(3))
    hide_matplotlib_by_sys_modules(monkeypatch)
    result = CliRunner().invoke(plot_main, [str(save)])
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith("deggs-plot: error: plotting needs matplotlib")
    assert line.endswith("pip install 'deggs[plot]'")


def test_bits_per_token_is_the_loss_axis_when_the_records_have_it():
    records = [record(s, bits_per_token=8.0 - s, val_bits_per_token=7.5) for s in range(3)]
    loss = collect_panels(records)[0]
    assert loss.ylabel == "bits per token"
    assert [s.ys for s in loss.series] == [[8.0, 7.0, 6.0], [7.5, 7.5, 7.5]]
    old = collect_panels([record(s) for s in range(3)])[0]  # older files: the integer loss
    assert old.ylabel == "loss (1/16 units)" and old.series[0].ys == [5.0, 4.9, 4.8]


def test_a_resumed_step_has_no_weights_changed_point():
    records = [record(0), record(1), record(2, resumed=True, updates_max=0), record(3)]
    (updates,) = [p for p in collect_panels(records) if p.title == "weights changed per step"]
    assert updates.series[0].xs == [0, 1, 3]


def test_a_health_series_of_one_point_is_drawn_with_a_marker(tmp_path, monkeypatch):
    """A run under 50 steps has its health at step 0 only: one point, which a line alone
    would not show."""
    drawn = []
    figure_cls, canvas_cls = plotting._import_matplotlib()
    from matplotlib.axes import Axes

    real = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((self.get_title(), kwargs.get("marker")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    records = [record(0, health={"embedding": {"saturation": 0.0, "entropy": 5.0}})]
    records += [record(s) for s in range(1, 30)]
    assert_png(plot(write_metrics(tmp_path, records)))
    assert ("saturation share per matrix", "o") in drawn
    assert ("bit entropy per matrix", "o") in drawn
    assert ("throughput", None) in drawn  # 30 points: a line
