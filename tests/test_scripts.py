"""run-workers.sh and the small command-line tools."""

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from sync import wait_until
from tiny import tiny_config

from deggs.data import DataError, load_decoding, load_tokens, save_decoding

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "count, visible, devices",
    [(["3"], None, [0, 1, 2]), ([], "5,7", [5, 7])],
    ids=["a count", "an inherited CUDA_VISIBLE_DEVICES"],
)
def test_run_workers_starts_one_worker_per_gpu_and_stops_them(tmp_path, count, visible, devices):
    fake = tmp_path / "fake-worker"
    # It says it is up once its TERM trap is set; then it runs until it is stopped (the
    # `sleep 0.1` is its idle loop, which lets the trap run within 0.1 s of a TERM).
    fake.write_text(
        '#!/usr/bin/env bash\ntrap "echo stopped; exit 0" TERM\n'
        'echo "gpu=$CUDA_VISIBLE_DEVICES threads=$OMP_NUM_THREADS,$NUMBA_NUM_THREADS args=$*"\n'
        "while true; do sleep 0.1; done\n"
    )
    fake.chmod(0o755)
    pools = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in pools}
    env["DEGGS_WORKER"] = str(fake)
    env["OMP_NUM_THREADS"] = "5"  # the caller's choice is kept; NUMBA's is the share
    if visible is not None:  # a Slurm job's GPUs, say
        env["CUDA_VISIBLE_DEVICES"] = visible
    n = len(devices)
    proc = subprocess.Popen(
        ["bash", ROOT / "run-workers.sh", "10.0.0.7", *count, "--", "--port", "999"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # a group of its own, to clean up on failure
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen = []

    def all_up():  # every worker has said it is up (and has its trap), and the script too
        while not lines.empty():
            seen.append(lines.get())
        return sum("] gpu=" in line for line in seen) == n and any(
            line.startswith(f"started {n} workers") for line in seen
        )

    try:
        wait_until(all_up, 20, lambda: f"{n} workers up; output so far: {seen}")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        reader.join(timeout=20)  # to the end of the output: its sed stages may outlive it
        assert not reader.is_alive(), "run-workers.sh's output never ended"
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # no fake worker outlives a failed test
        raise
    while not lines.empty():
        seen.append(lines.get())
    out = "".join(seen)
    share = max(1, len(os.sched_getaffinity(0)) // n)  # the cores, split between them
    for gpu in devices:
        assert f"[gpu {gpu}] gpu={gpu} threads=5,{share} args=10.0.0.7 --port 999" in out
    assert out.count("stopped") == n


def test_run_workers_rejects_a_bad_gpu_count():
    result = subprocess.run(
        ["bash", ROOT / "run-workers.sh", "host", "two"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "positive integer" in result.stderr
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3"}
    result = subprocess.run(
        ["bash", ROOT / "run-workers.sh", "host", "4"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2 and "CUDA_VISIBLE_DEVICES lists 2 GPUs" in result.stderr


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "deggs", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_print_arch_totals():
    out = run_cli("print-arch", "--config", ROOT / "config.toml").stdout
    assert "Total Parameters: 5778944" in out and "W_Q" in out


def test_prepare_bytes_and_bpe(tmp_path):
    text = tmp_path / "text.txt"
    from deggs.prepare import default_corpus

    text.write_text(default_corpus()[:30000])
    result = run_cli(
        "prepare", text, "--vocab-size", "256", "--val-fraction", "0", "--out", tmp_path / "bytes"
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "bytes" / "input.bin").read_bytes() == text.read_bytes()
    result = run_cli(
        "prepare", text, "--vocab-size", "300", "--val-fraction", "0", "--out", tmp_path / "bpe"
    )
    assert result.returncode == 0, result.stderr
    pieces = load_decoding(tmp_path / "bpe" / "decoding.bin")
    ids = np.fromfile(tmp_path / "bpe" / "input.bin", "<u4")
    assert len(pieces) == 300 and ids.max() < 300
    assert b"".join(pieces[i] for i in ids) == text.read_bytes()  # lossless round trip
    result = run_cli("prepare", text, "--vocab-size", "100000", "--out", tmp_path / "big")
    assert result.returncode == 2 and "smaller vocab" in result.stderr


def test_prepare_default_corpus_is_real_text(tmp_path):
    result = run_cli("prepare", "--vocab-size", "256", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "input.bin").read_bytes().decode()
    assert len(text) > 100_000 and "statement" in text


CFG = tiny_config(model=dict(vocab_size=300), sampling=dict(prompt_tokens=4))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x01\x00\x00", "not a whole number of 4-byte tokens"),
        (
            np.arange(20, dtype="<u4").tobytes() + (300).to_bytes(4, "little"),
            "token 300 at index 20",
        ),
        (np.arange(8, dtype="<u4").tobytes(), r"8 tokens, fewer than seq_len \+ 1 = 9"),
    ],
)
def test_bad_input_bin_is_refused_with_the_reason(tmp_path, content, message):
    (tmp_path / "input.bin").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_tokens(tmp_path / "input.bin", CFG)


def test_missing_input_bin(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokens(tmp_path / "input.bin", CFG)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x02\x00", "too short"),
        (
            (2).to_bytes(4, "little") + (1).to_bytes(4, "little") + b"a",
            "ends before the length of token 1",
        ),
        ((1).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"ab", "claims 5 bytes"),
        ((1).to_bytes(4, "little") + (1).to_bytes(4, "little") + b"ab", "1 bytes left over"),
    ],
)
def test_bad_decoding_bin_is_refused_with_the_reason(tmp_path, content, message):
    (tmp_path / "decoding.bin").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_decoding(tmp_path / "decoding.bin")


def test_decoding_round_trip(tmp_path):
    save_decoding(tmp_path / "d.bin", [b"a", b"", b"\xff\x00"])
    assert load_decoding(tmp_path / "d.bin") == [b"a", b"", b"\xff\x00"]


def test_worker_cli_reports_bad_data_without_a_traceback(tmp_path):
    (tmp_path / "input.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "c.toml").write_text("[model]\nvocab_size = 300\n")
    result = run_cli(
        "worker",
        "127.0.0.1",
        "--port",
        "1",
        "--config",
        tmp_path / "c.toml",
        "--data-dir",
        tmp_path,
        "--backend",
        "cpu",
    )
    assert result.returncode == 2
    assert "not a whole number of 4-byte tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_workers_help_exits_0_and_no_host_exits_2():
    help_ = subprocess.run(
        ["bash", ROOT / "run-workers.sh", "--help"], capture_output=True, text=True
    )
    assert help_.returncode == 0 and help_.stdout.startswith("usage:")
    bare = subprocess.run(["bash", ROOT / "run-workers.sh"], capture_output=True, text=True)
    assert bare.returncode == 2 and "usage:" in bare.stderr


@pytest.mark.slow
def test_scaling_runs_one_and_two_workers_with_equal_losses(tmp_path):
    """scripts/scaling.sh: a coordinator and N workers (here CPU workers on loopback) for
    each N, then scripts/scaling.py's table, every step's loss equal across the runs."""
    from tiny import toml_of

    config = tmp_path / "tiny.toml"
    config.write_text(toml_of(tiny_config(training=dict(population_size=32, chunk_size=8))))
    data = tmp_path / "data"
    data.mkdir()
    np.random.default_rng(3).integers(0, 256, 5000).astype(np.uint8).tofile(data / "input.bin")
    env = dict(
        os.environ,
        STEPS="30",  # a step takes ~30 ms: room for a worker that starts late
        CONFIG=str(config),
        RUNS=str(tmp_path / "runs"),
        WORKER_OPTIONS="--backend cpu --threads 1",
        PYTHON=sys.executable,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    proc = subprocess.Popen(
        ["bash", ROOT / "scripts/scaling.sh", data, "1", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own: on a timeout, all of it is stopped
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    assert proc.returncode == 0, out + err
    lines = out.strip().splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        str(tmp_path / "runs/gpus1"),
        str(tmp_path / "runs/gpus2"),
    ]
    assert "1 workers" in lines[0] and "2 workers" in lines[1], lines
    assert all(line.endswith("losses equal to the first run's: True") for line in lines), lines


def test_scaling_refuses_bad_counts_and_a_coordinator_that_fails_at_once(tmp_path):
    (tmp_path / "input.bin").write_bytes(bytes(100))
    script = ["bash", ROOT / "scripts/scaling.sh", tmp_path]
    for counts, message in [([], "usage:"), (["1", "1"], "each GPU count once"), (["x"], "x")]:
        bad = subprocess.run([*script, *counts], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    env = dict(
        os.environ,
        CONFIG=str(tmp_path / "missing.toml"),
        RUNS=str(tmp_path / "runs"),
        PYTHON=sys.executable,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    failed = subprocess.run([*script, "1"], env=env, capture_output=True, text=True, timeout=30)
    assert failed.returncode == 1 and "did not start" in failed.stderr, failed.stderr
    assert "missing.toml" in failed.stderr  # the log's last lines say why


def test_scaling_report_compares_step_times_and_losses():
    import scaling  # scripts/ is on the path (conftest.py)

    def run(step_s, losses, workers=2):
        # the first 5 steps slow (compiles), which the report must leave out
        times = np.cumsum([10.0] * 5 + [step_s] * (len(losses) - 5))
        return [
            dict(
                step=s,
                tokens=(s + 1) * 10**6,
                time=float(times[s]),
                sum_loss=loss,
                workers={f"w{i}": {"idle_s": 0.01 * (i + 1)} for i in range(workers)},
            )
            for s, loss in enumerate(losses)
        ]

    one = run(1.0, range(9))
    runs = {"a": one, "b": run(0.5, range(9)), "c": run(0.5, [9] * 9)}
    lines = scaling.report(runs, [2, 2, 2])
    assert lines[0] == (
        "a: 2 workers, 1.000 s a step, 1.00 M tokens/s, 1.00x, idlest worker 0.020 s a step, "
        "losses equal to the first run's: True"
    )
    assert "0.500 s a step, 2.00 M tokens/s, 2.00x" in lines[1] and lines[1].endswith("True")
    assert lines[2].endswith("False")
    with pytest.raises(ValueError, match="b: 2 workers a step, 4 asked for"):
        scaling.report(runs, [2, 4, 2])
    with pytest.raises(ValueError, match="a: 6 steps recorded"):
        scaling.summary("a", one[:6])
    # a worker that joins at step 3 (still compiling before): timed from step 3 + 5, past
    # the slow steps after it joined (counted from step 0, the median would be 3 s)
    late = run(0.5, range(13))
    for r, t in zip(late, np.cumsum([10.0] * 5 + [3.0] * 5 + [0.5] * 3), strict=True):
        r["time"] = float(t)
    for r in late[:3]:
        r["workers"] = {"w0": r["workers"]["w0"]}
    assert scaling.summary("late", late)["workers"] == 2
    assert scaling.summary("late", late)["step_s"] == 0.5
    with pytest.raises(ValueError, match=r"at least 10 needed \(all 2 workers served from"):
        scaling.summary("late", late[:9])


@pytest.mark.parametrize(
    "choice", [["--qkv", "qkv_rope"], ["--head", "head_loss"], ["--timeline"], ["-D", "UP_ROWS=64"]]
)
def test_bench_refuses_gpu_options_for_the_cpu_backend(choice):
    import bench
    from click.testing import CliRunner

    result = CliRunner().invoke(bench.main, ["--config", str(ROOT / "config.toml"), *choice])
    assert result.exit_code == 2
    assert "--head, --qkv, --timeline and -D are for --backend gpu" in result.output


def test_bench_reports_the_int8_rate_and_its_share(tmp_path):
    """A CPU run of the tiny config: the step's int8 operations a second; a share only for
    a card whose dense int8 rate the table knows."""
    import json

    import bench
    from click.testing import CliRunner
    from tiny import TINY, toml_of

    config = tmp_path / "tiny.toml"
    config.write_text(toml_of(TINY))
    args = ["--config", str(config), "--members", "4", "--repeats", "1", "--updates", "0"]
    result = CliRunner().invoke(bench.main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[-1])
    assert record["int8_tops"] > 0 and "int8_share" not in record  # a CPU: no rate known
    assert bench.int8_rate("NVIDIA H100 80GB HBM3") == 1979
    assert bench.int8_rate("NVIDIA H100 PCIe") == 1513 and bench.int8_rate("a CPU") is None


def test_bench_trains_first_on_a_token_file(tmp_path):
    """--train-first N trains N whole steps on --data before timing: the losses it
    records are those of a trainer's first N steps on that file."""
    import json

    import bench
    from click.testing import CliRunner
    from tiny import TINY, toml_of

    from deggs.numerics.backend import make_backend
    from deggs.numerics.es import Trainer
    from deggs.runtime.steps import LOSS_SCALE

    config, data = tmp_path / "tiny.toml", tmp_path / "input.bin"
    config.write_text(toml_of(TINY))
    tokens = np.random.default_rng(4).integers(0, 40, 5000).astype(TINY.token_dtype)
    data.write_bytes(tokens.tobytes())
    args = ["--config", config, "--members", "4", "--repeats", "1", "--updates", "0"]
    args += ["--steps", "1", "--data", data, "--train-first", "2"]
    result = CliRunner().invoke(bench.main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.splitlines()[-1])
    trainer = Trainer(make_backend(TINY, "cpu"))
    step_tokens = TINY.training.population_size * TINY.model.seq_len * LOSS_SCALE
    losses = [sum(r.sum_loss for r in trainer.train_step(tokens)) / step_tokens for _ in range(2)]
    assert record["data"] == str(data)
    assert record["trained_losses"] == [round(x, 4) for x in losses]


# --- the vocabulary said once, modes, and a port in use ----------------------------------


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """Data prepared with --vocab-size 300 (a byte-level BPE), as deggs-prepare writes it."""
    from deggs.config import load_config
    from deggs.prepare import default_corpus, prepare

    out = tmp_path_factory.mktemp("bpe")
    prepare(default_corpus()[:200_000], 300, out, cfg=load_config("small"))
    return out


def coordinator_cli(*args, cwd):
    """deggs-coordinator's command line in this process, stopped before it would serve."""
    from click.testing import CliRunner

    from deggs.cli import coordinator_main

    # --max-steps 0 ends it at once; a short retry_max_s, its wait for reconnecting workers
    tail = ["--max-steps", "0", "--set", "worker.retry_max_s=0.1"]
    with contextlib.chdir(cwd):
        return CliRunner().invoke(coordinator_main, [*map(str, args), *tail])


def test_the_coordinator_takes_the_vocabulary_from_the_data(bpe_data, tmp_path):
    result = coordinator_cli(
        "--config", "small", "--data-dir", bpe_data, "--port", 0, "--save-dir", "run", cwd=tmp_path
    )
    assert result.exit_code == 0, result.output
    assert f"vocab_size 300 (uint32 tokens) from {bpe_data / 'meta.json'}" in result.output
    from deggs.runtime.checkpoint import saved_config

    assert saved_config(tmp_path / "run").model.vocab_size == 300


@pytest.mark.parametrize(
    "source, said",
    [("file", "{file} sets model.vocab_size = 512"), ("set", "--set model.vocab_size=512 sets")],
)
def test_a_vocabulary_said_twice_and_differently_is_an_error_naming_both(
    bpe_data, tmp_path, source, said
):
    file = tmp_path / "mine.toml"
    file.write_text("[model]\nvocab_size = 512\n")
    args = ["--config", file] if source == "file" else ["--set", "model.vocab_size=512"]
    result = coordinator_cli(*args, "--data-dir", bpe_data, "--port", 0, cwd=tmp_path)
    assert result.exit_code == 2, result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"deggs-coordinator: error: {bpe_data / 'meta.json'} says ")
    assert "vocab_size 300" in message and said.format(file=file) in message


def test_a_data_dir_without_meta_json_is_an_error(tmp_path):
    result = coordinator_cli("--config", "small", "--data-dir", tmp_path, cwd=tmp_path)
    assert result.exit_code == 2
    assert f"{tmp_path / 'meta.json'} not found: --data-dir takes" in result.output


def test_a_port_in_use_suggests_port_0(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = coordinator_cli(
            "--config", "small", "--host", "127.0.0.1", "--port", port, "--save-dir", "run",
            cwd=tmp_path,
        )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--port 0 picks a free port" in result.output.strip().splitlines()[-1]
    # Nothing written: a retry with another config is not refused for this run's config.json.
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mode):
    code = (
        "import os, sys; from deggs.files import write_atomic; "
        f"os.umask({umask}); write_atomic(sys.argv[1], b'x')"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], timeout=60)
    assert done.returncode == 0
    assert (tmp_path / "f").stat().st_mode & 0o777 == mode


def test_power_samples_are_read_and_averaged_over_a_window():
    """scripts/power.py reads nvidia-smi's CSV lines (a line cut short, or a field such
    as [N/A], is left out) and averages the power and clock between two instants."""
    import datetime

    import power

    t0 = datetime.datetime(2026, 11, 27, 15, 0, 0)
    at = lambda ms: t0 + datetime.timedelta(milliseconds=ms)
    stamp = lambda ms: at(ms).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    lines = [
        f"{stamp(0)}, 120.00, 1980, 40\n",
        f"{stamp(20)}, 690.00, 1700, 50\n",
        f"{stamp(40)}, [N/A], 1700, 50\n",
        f"{stamp(60)}, 700.00, 1800, 51\n",
        f"{stamp(80)}, 7",
    ]
    sampler = power.Sampler()
    sampler.samples = power.read_samples(lines)
    assert [s[1:] for s in sampler.samples] == [(120, 1980, 40), (690, 1700, 50), (700, 1800, 51)]
    start = t0.timestamp()
    card = sampler.mean(start + 0.01, start + 0.07)
    assert card == {"watts": 695.0, "sm_clock_mhz": 1750.0, "temperature_c": 51.0}
    assert sampler.mean(start + 1, start + 2) is None


def test_a_define_is_refused_unless_a_kernel_source_names_it():
    """-D (bench.py, kernels.py): a malformed value or a name no kernel mentions (a
    typo, which would compile the kernels unchanged) is a usage error."""
    import click
    import variants

    assert variants.parse_defines(["UP_ROWS=192", "HEAD_FOLD=0"]) == {
        "UP_ROWS": 192,
        "HEAD_FOLD": 0,
    }
    for bad, why in [
        ("UP_ROW=192", "no kernel source mentions UP_ROW"),
        ("=4", "no kernel source mentions"),
        ("UP_ROWS=big", "VALUE an integer"),
    ]:
        with pytest.raises(click.UsageError, match=why):
            variants.parse_defines([bad])


def test_power_sampler_without_nvidia_smi(monkeypatch):
    """Where nvidia-smi is missing the sampler has no samples, and says so with None."""
    import power

    monkeypatch.setattr(power, "_bus_id", lambda: "00000000:00:00.0")
    monkeypatch.setenv("PATH", "/nonexistent")
    with power.Sampler() as sampler:
        pass
    assert sampler.samples == [] and sampler.mean(0, 2e9) is None
