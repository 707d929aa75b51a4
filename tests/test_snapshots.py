"""Weight snapshots and state digests: the book's decisions, the files, and real runs.

The runs are test_cluster.py's: a coordinator and CPU worker processes on loopback
training a tiny model, whose every step's loss must equal an undisturbed run's however
the model reached a worker (a snapshot, a pruned history, a resync after a fault).
"""

import json
import os
import re
import socket
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import test_cluster as tc
from tiny import toml_of

from deggs.runtime import checkpoint as ckpt
from deggs.runtime import snapshot as snapshots
from deggs.runtime.digests import DigestBook
from deggs.runtime.export import ExportError, load_model, model_from_bytes, state_digest
from deggs.runtime.protocol import (
    Digest,
    JobRequest,
    ProtocolError,
    SnapshotHeader,
    SnapshotPart,
    SnapshotRequest,
    decode_message,
)

EVERY = 5  # snapshot and digest interval of the runs here
SNAP_CFG = tc.TINY_CFG.replace(
    coordinator=dict(snapshot_every_steps=EVERY, digest_every_steps=EVERY, keep_snapshots=2)
)
STEPS = 13
FLIPPER = Path(__file__).with_name("flip_worker.py")

A, B = b"\xaa" * 32, b"\xbb" * 32


# --- the digest book -------------------------------------------------------------------


WORKED = {"w1", "w2", "w3", "w4"}  # the reporters that scored a chunk of the step


def test_a_majority_agrees_and_the_minority_drifted():
    book = DigestBook()
    for who, digest in [("w1", A), ("w2", B), ("w3", A)]:
        assert book.report(5, who, digest, current=5) is None  # decided at the seal
    verdict = book.decide(5, WORKED)
    assert (verdict.agreed, verdict.reports, verdict.drifted) == (A, 3, {"w2": B})
    assert book.holders(5) == ["w1", "w3"]
    late = book.report(5, "w4", B, current=6)  # a late report is held to the agreed digest
    assert late is not None and late.drifted == {"w4": B} and late.agreed == A
    assert book.report(5, "w5", A, current=6) is None


def test_one_report_stands_alone():
    book = DigestBook()
    book.report(5, "w1", A, current=5)
    verdict = book.decide(5, WORKED)
    assert (verdict.agreed, verdict.drifted, verdict.split) == (A, {}, False)


def test_reporters_that_did_no_work_have_no_vote():
    """Connections that scored nothing of the step (strangers, without a secret) cannot
    outvote the workers that did: they are held to the workers' digest instead."""
    book = DigestBook()
    book.report(5, "w1", A, current=5)
    book.report(5, "w2", A, current=5)
    for idle in ("x1", "x2", "x3"):
        book.report(5, idle, B, current=5)
    verdict = book.decide(5, {"w1", "w2"})
    assert (verdict.agreed, verdict.reports, verdict.split) == (A, 2, False)
    assert verdict.drifted == {"x1": B, "x2": B, "x3": B}
    assert book.holders(5) == ["w1", "w2"]
    book.report(6, "x1", B, current=6)  # alone and idle: no decision at all
    assert book.decide(6, {"w1"}).agreed is None and 6 not in book.agreed


def test_a_split_stops_until_reports_made_again_agree():
    book = DigestBook()
    book.report(5, "w1", A, current=5)
    book.report(5, "w2", B, current=5)
    verdict = book.decide(5, WORKED)
    assert verdict.split and verdict.agreed is None and book.split_step == 5
    assert book.report(5, "w3", A, current=6) is None  # one report again: no majority yet
    resolved = book.report(5, "w4", A, current=6)
    assert resolved is not None and resolved.resolved and resolved.agreed == A
    assert book.split_step is None


def test_reports_of_old_undecided_steps_are_not_kept():
    book = DigestBook()
    assert book.report(3, "w1", A, current=9) is None
    assert book.pending == {}


# --- messages and files ---------------------------------------------------------------


def u64(n):
    return struct.pack(">Q", n)


def cluster_in(root: Path, cfg) -> tc.Cluster:
    root.mkdir(parents=True)
    return tc.Cluster(root, toml_of(cfg))


def test_snapshot_messages_have_their_layout():
    head = lambda opcode, n: b"JOBS\x01" + bytes([opcode]) + struct.pack(">I", n)
    assert Digest(7, A).encode() == head(11, 40) + u64(7) + A
    assert SnapshotRequest(5).encode() == head(12, 8) + u64(5)
    assert SnapshotHeader(5, 9, 100, B).encode() == head(13, 56) + u64(5) + u64(9) + u64(100) + B
    assert SnapshotPart(3, b"xyz").encode() == head(14, 11) + u64(3) + b"xyz"
    assert decode_message(14, u64(3) + b"xyz") == SnapshotPart(3, b"xyz")
    with pytest.raises(ProtocolError, match="DIGEST payload"):
        decode_message(11, u64(7) + A[:5])


def test_an_assembly_takes_its_parts_in_order_and_no_more():
    with pytest.raises(ProtocolError, match="announces a snapshot of 10 bytes"):
        snapshots.Assembly(SnapshotHeader(5, 0, 10, A), (100, 200), "w")
    assembly = snapshots.Assembly(SnapshotHeader(5, 0, 150, A), (100, 200), "w")
    with pytest.raises(ProtocolError, match="at 1, expected 0"):
        assembly.add(SnapshotPart(1, b"x"))
    assert not assembly.add(SnapshotPart(0, b"x" * 100))
    with pytest.raises(ProtocolError, match="more snapshot bytes"):
        assembly.add(SnapshotPart(100, b"x" * 51))
    assert assembly.add(SnapshotPart(100, b"x" * 50))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of STEPS steps with snapshots every EVERY steps and two workers, and the
    per-step losses of a one-worker run without snapshots (the undisturbed run)."""
    root = tmp_path_factory.mktemp("snapshots")
    plain = cluster_in(root / "plain", tc.TINY_CFG)
    snap = cluster_in(root / "snap", SNAP_CFG)
    try:
        coord = plain.coordinator(plain.root / "save", STEPS + 5)
        plain.worker(coord.port)
        plain.finish(coord)
        coord = snap.coordinator(snap.root / "save", STEPS)
        workers = [snap.worker(coord.port), snap.worker(coord.port, with_config=False)]
        out = snap.finish(coord)
        for worker in workers:
            assert tc.exit_code(worker) == 0, tc.log_of(worker)
    finally:
        plain.stop_all()
        snap.stop_all()
    return snap, tc.losses(plain.root / "save"), out


def test_snapshots_are_written_checked_and_kept(trained):
    snap, baseline, out = trained
    save = snap.root / "save"
    assert tc.losses(save) == {s: baseline[s] for s in range(STEPS)}
    assert sorted(snapshots.list_snapshots(save)) == [5, 10]
    model = load_model(snapshots.snapshot_path(save, 10))
    assert (model.step, model.seed) == (
        10,
        ckpt.read_checkpoint(ckpt.checkpoint_path(save, 10)).seed,
    )
    records = {r["step"]: r for r in ckpt.read_metrics(save)}
    assert records[10]["digest"] == state_digest(model).hex()
    assert records[10]["digest_reports"] == 2 and "drifted" not in records[10]
    assert "snapshot of step 10 written" in out


def test_a_snapshots_bytes_are_checked(trained):
    snap, _, _ = trained
    path = snapshots.snapshot_path(snap.root / "save", 10)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    with pytest.raises(ExportError, match="digest"):
        model_from_bytes(bytes(data), "flipped")
    model = model_from_bytes(path.read_bytes(), "whole")
    with pytest.raises(ExportError, match="digest .* is not the announced"):
        snapshots.check(path.read_bytes(), SNAP_CFG, "s", 10, bytes(32))
    with pytest.raises(ExportError, match="announced as step 5"):
        snapshots.check(path.read_bytes(), SNAP_CFG, "s", 5, state_digest(model))


def test_prune_keeps_the_newest_and_the_history_after_them(tmp_path):
    for step in (5, 10, 15):
        snapshots.snapshot_path(tmp_path, step).write_bytes(b"s")
    for step in range(1, 18):
        ckpt.checkpoint_path(tmp_path, step).write_bytes(b"c")
    (tmp_path / ckpt.MANIFEST_FILE).write_bytes(
        b"".join(
            ckpt._manifest_line(f"checkpoint_{step:08d}.bin", "0" * 64) for step in range(1, 18)
        )
    )
    gone = snapshots.prune(tmp_path, keep=2, history=True)
    assert sorted(snapshots.list_snapshots(tmp_path)) == [10, 15]
    assert sorted(ckpt.list_checkpoints(tmp_path)) == list(range(10, 18))
    assert len(gone) == 1 + 9
    assert sorted(ckpt.read_manifest(tmp_path)) == [
        f"checkpoint_{s:08d}.bin" for s in range(10, 18)
    ]


def test_a_fresh_worker_joins_from_the_snapshot_of_a_pruned_run(trained, tmp_path):
    """The history before the newest snapshot deleted: --load-dir resumes it, a fresh
    worker joins from the snapshot and trains on with the undisturbed run's losses, and
    an export of it equals, tensor for tensor, the unpruned run's."""
    snap, baseline, _ = trained
    save = snap.root / "save"
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    for path in save.iterdir():
        pruned.joinpath(path.name).write_bytes(path.read_bytes())
    for step, path in ckpt.list_checkpoints(pruned).items():
        if step < 10:
            path.unlink()
    snapshots.snapshot_path(pruned, 5).unlink()

    cluster = cluster_in(tmp_path / "resumed", SNAP_CFG)
    try:
        for source, name in ((save, "full.safetensors"), (pruned, "pruned.safetensors")):
            export = cluster.run("export", "--load-dir", source, "--out", tmp_path / name)
            assert export.returncode == 0, export.stdout
        full, cut = (
            load_model(tmp_path / "full.safetensors"),
            load_model(tmp_path / "pruned.safetensors"),
        )
        assert full.step == cut.step == STEPS
        for table in ("params", "overlays"):
            for key, value in getattr(full, table).items():
                assert np.array_equal(value, getattr(cut, table)[key]), key
        for key in full.state.m:
            assert np.array_equal(full.state.v[key], cut.state.v[key]), key

        coord = cluster.coordinator(tmp_path / "save2", STEPS + 4, load_dir=pruned)
        fresh = cluster.worker(coord.port)
        cluster.finish(coord)
        assert tc.exit_code(fresh) == 0, tc.log_of(fresh)
    finally:
        cluster.stop_all()
    log = tc.log_of(fresh)
    assert "loaded the snapshot of step 10" in log and "updated to step 11" in log, log
    assert "updated to step 3" not in log  # no replay from the start
    got = tc.losses(tmp_path / "save2")
    assert {s: got[s] for s in range(STEPS, STEPS + 4)} == {
        s: baseline[s] for s in range(STEPS, STEPS + 4)
    }


def test_a_reference_worker_is_refused_where_the_history_was_pruned(trained, tmp_path):
    snap, _, _ = trained
    # what a reference worker sends: a JOB_REQUEST from step 0, no HELLO
    coordinator, port = None, None
    cluster = cluster_in(tmp_path / "ref", SNAP_CFG)
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    for path in (snap.root / "save").iterdir():
        pruned.joinpath(path.name).write_bytes(path.read_bytes())
    snapshots.prune(pruned, keep=1, history=True)
    try:
        coordinator = cluster.coordinator(tmp_path / "save2", STEPS + 1, load_dir=pruned)
        port = coordinator.port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(JobRequest(SNAP_CFG.training.seed, 0).encode())
            assert sock.recv(100) == b""  # closed: a reference worker cannot read GOODBYE
        tc.wait_until(
            lambda: "history" in tc.log_of(coordinator) and "pruned" in tc.log_of(coordinator),
            "the refusal's log line",
            [coordinator],
            timeout=10,
        )
    finally:
        cluster.stop_all()


def test_a_flipped_weight_is_found_named_and_resynced(tmp_path):
    """Three workers, one of which flips a weight of its model when it reaches step 7
    (tests/flip_worker.py, a test-only wrapper): at the digest of step 10 it is named as
    drifted, rebuilds its model from the snapshot of step 5 and agrees again at 15."""
    cfg = SNAP_CFG.replace(training=dict(population_size=96, chunk_size=16))
    cluster = cluster_in(tmp_path / "run", cfg)
    try:
        coord = cluster.coordinator(tmp_path / "run" / "save", 17)
        honest = [cluster.worker(coord.port) for _ in range(2)]
        flipper = cluster.worker(
            coord.port, env={"DEGGS_TEST_FLIP_AT_STEP": "7"}, runner=[sys.executable, FLIPPER]
        )
        out = cluster.finish(coord)
        for worker in [*honest, flipper]:
            assert tc.exit_code(worker) == 0, tc.log_of(worker)
    finally:
        cluster.stop_all()
    flip_log = tc.log_of(flipper)
    assert "flipped a weight at step 7" in flip_log, flip_log
    records = {r["step"]: r for r in ckpt.read_metrics(tmp_path / "run" / "save")}
    # named at the seal of step 10, or at step 11 if its report came after that seal
    found = [r["drifted"] for r in records.values() if "drifted" in r]
    assert len(found) == 1 and list(found[0].values()) == [10], found
    (name,) = found[0]
    assert f"{name} drifted: its state at step 10" in out, out
    assert re.search(r"loaded the snapshot of step (5|10)", flip_log), flip_log
    assert out.count("drifted:") == 1  # it agrees at step 15
    assert records[15]["digest_reports"] == 3 and "drifted" not in records[15]
    assert os.path.exists(snapshots.snapshot_path(tmp_path / "run" / "save", 15))


def test_an_upload_that_breaks_the_rules_closes_only_that_connection(tmp_path, caplog):
    """At a snapshot step the first worker whose digest agreed is asked for its model; one
    that announces an impossible size is closed, the next one is asked, and its upload,
    checked against the agreed digest, becomes the snapshot file."""
    import asyncio

    import test_coordinator as tcoord
    from sync import async_wait_until

    from deggs.numerics.model import init_overlays, init_params
    from deggs.numerics.state import OptimizerState
    from deggs.runtime.export import Model, encode_model

    cfg = tcoord.SMALL.replace(
        model=tc.TINY_CFG.to_dict()["model"],
        coordinator=dict(snapshot_every_steps=1, digest_every_steps=1),
    )
    seed = tcoord.seed_of(1)
    model = Model(cfg, 1, seed, init_params(cfg), init_overlays(cfg), OptimizerState.zeros(cfg))
    data, digest = encode_model(model), state_digest(model)

    async def main():
        async with tcoord.coordinator(cfg, save_dir=tmp_path) as coord:
            a, b = await tcoord.Client.connect(coord), await tcoord.Client.connect(coord)
            await a.hello(cfg)
            await b.hello(cfg)
            await tcoord.train_step(a, 0)
            for client in (a, b):  # in this order: a is asked first
                await client.send(Digest(1, digest))
                await async_wait_until(
                    lambda c=client: (
                        f"127.0.0.1:{c.port}" in coord.replicas.book.pending.get(1, {})
                    ),
                    5,
                    "the digest to be taken",
                )
            await tcoord.train_step(a, 1, last=True)
            assert await a.recv() == SnapshotRequest(1)
            await a.send(SnapshotHeader(1, seed, 1 << 40, digest))
            assert await a.closed()
            assert await b.recv() == SnapshotRequest(1)
            for frame in snapshots.snapshot_frames(
                SnapshotHeader(1, seed, len(data), digest), data
            ):
                await b.send(frame)
            path = snapshots.snapshot_path(tmp_path, 1)
            await async_wait_until(path.exists, 10, "the snapshot file")
            assert path.read_bytes() == data
            assert coord.replicas.newest.step == 1
            assert (await b.request(2)).data_position == 0  # b trains on: a chunk of step 2

    caplog.set_level("INFO", logger="deggs")
    asyncio.run(asyncio.wait_for(main(), 30))
    assert "announces a snapshot of 1099511627776 bytes" in caplog.text
    assert "snapshot of step 1 written" in caplog.text


def test_rejoin_script_times_a_join_from_a_snapshot(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(toml_of(tc.TINY_CFG))
    script = Path(__file__).parents[1] / "scripts" / "rejoin.py"
    result = tc.subprocess.run(
        [sys.executable, script, "--config", config, "--every", "5", "--tail", "2", "10"],
        capture_output=True,
        text=True,
        env=tc.ENV,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    row = json.loads(result.stdout.splitlines()[-1])
    assert row["step"] == 12 and row["snapshot"] == 10 and row["first_chunk_s"] > 0
    assert "loaded the snapshot of step 10" in row["loaded"]
