"""Exported models (deggs.runtime.export): the safetensors file, resuming a replay from
it, its validation, and the deggs-export / deggs-generate --model commands."""

import io
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from tiny import tiny_config

from deggs.cli import _replay_run, export_main, generate_main
from deggs.data import detokenize, save_tokens
from deggs.numerics.cpu import CpuBackend
from deggs.numerics.es import Trainer
from deggs.numerics.sampling import prompt_window
from deggs.runtime.checkpoint import Checkpoint, save_checkpoint, save_config
from deggs.runtime.export import (
    FORMAT,
    MAX_HEADER_BYTES,
    ExportError,
    Model,
    expected_tensors,
    load_model,
    model_of,
    resume,
    save_model,
    trainer_from_model,
)
from deggs.runtime.replay import replay
from deggs.ternary import pack_trits

CFG = tiny_config(sampling=dict(prompt_tokens=4, generate_tokens=4))
# printable bytes, so that the prompt generate shows is the data itself
DATA = np.random.default_rng(1).integers(32, 127, 4000).astype(np.uint8)
STEPS = 3


def snapshot(trainer: Trainer) -> Model:
    """Copies of everything an export holds."""
    m = model_of(trainer)
    copy = lambda d: {k: np.array(v) for k, v in d.items()}
    state = type(m.state)(copy(m.state.m), copy(m.state.v), copy(m.state.acc))
    return Model(m.cfg, m.step, m.seed, copy(m.params), copy(m.overlays), state)


def assert_same(a: Model, b: Model) -> None:
    assert a.cfg == b.cfg and (a.step, a.seed) == (b.step, b.seed)
    for name, x, y in [
        ("params", a.params, b.params),
        ("overlays", a.overlays, b.overlays),
        ("m", a.state.m, b.state.m),
        ("v", a.state.v, b.state.v),
        ("acc", a.state.acc, b.state.acc),
    ]:
        assert x.keys() == y.keys(), name
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), f"{name} {k}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A save directory of STEPS steps trained in this process (config.json, checkpoints,
    input.bin), and the model after each step."""
    save_dir = tmp_path_factory.mktemp("run")
    save_config(save_dir, CFG)
    save_tokens(save_dir / "input.bin", DATA, CFG)
    trainer = Trainer(CpuBackend(CFG, threads=1))
    models = [snapshot(trainer)]
    for _ in range(STEPS):
        results = trainer.train_step(DATA)
        fitness = np.concatenate([r.fitness for r in results])
        save_checkpoint(save_dir, Checkpoint(trainer.step, trainer.seed, pack_trits(fitness)))
        models.append(snapshot(trainer))
    return save_dir, models


def export_at(run, step: int, path: Path) -> Path:
    save_dir, _ = run
    return save_model(path, replay(save_dir, Trainer(CpuBackend(CFG, threads=1)), until=step))


def test_an_export_round_trips(run, tmp_path):
    save_dir, models = run
    path = export_at(run, 2, tmp_path / "model.safetensors")
    loaded = load_model(path)
    assert_same(loaded, models[2])
    assert any(v.any() for v in loaded.state.m.values())  # the state is really there
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed
    # the file is the header and the tensors' bytes, nothing else
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert length % 8 == 0 and path.read_bytes()[8 + length - 1 : 8 + length] in (b" ", b"}")
    sizes = {
        k: np.prod(s) * (4 if d == "F32" else 1) for k, (d, s) in expected_tensors(CFG).items()
    }
    assert path.stat().st_size == 8 + length + sum(sizes.values())


def test_an_export_carries_the_vocabulary_files_it_is_given(run, tmp_path):
    trainer = trainer_from_model(run[1][1], "cpu")
    files = {"decoding.bin": b"\x02\0\0\0\1\0\0\0a\1\0\0\0b", "tokenizer.json": b"{}"}
    path = save_model(tmp_path / "m.safetensors", trainer, files=files)
    loaded = load_model(path)
    assert loaded.files == files
    assert_same(loaded, run[1][1])
    import safetensors.numpy  # any reader sees them as byte tensors

    tensors = safetensors.numpy.load_file(str(path))
    assert tensors["data/tokenizer.json"].tobytes() == b"{}"
    with pytest.raises(ExportError, match="cannot carry 'input.bin'"):
        save_model(tmp_path / "n.safetensors", trainer, files={"input.bin": b"x"})


def test_a_data_tensor_of_another_shape_is_refused(run, tmp_path):
    trainer = trainer_from_model(run[1][1], "cpu")
    path = save_model(tmp_path / "m.safetensors", trainer, files={"tokenizer.json": b"{}"})
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    header["data/tokenizer.json"]["shape"] = [2, 1]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the header re-laid, the tensors' bytes unchanged
    (tmp_path / "bad.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + raw[8 + length :]
    )
    with pytest.raises(ExportError, match=r"data/tokenizer.json has shape \[2, 1\]"):
        load_model(tmp_path / "bad.safetensors")


def test_save_reports_the_bytes_written(run, tmp_path):
    seen: list[tuple[int, int]] = []
    trainer = trainer_from_model(run[1][1], "cpu")
    path = save_model(tmp_path / "m.safetensors", trainer, lambda *at: seen.append(at))
    size = path.stat().st_size
    assert len(seen) == 1 + len(expected_tensors(CFG))  # the header, then each tensor
    assert {total for _, total in seen} == {size} and seen[-1][0] == size
    (header,) = struct.unpack("<Q", path.read_bytes()[:8])
    done = [d for d, _ in seen]
    assert done == sorted(set(done)) and done[0] == 8 + header


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stderr", [Terminal, io.StringIO], ids=["terminal", "log file"])
def test_a_replay_shows_a_bar_on_a_terminal_only(run, monkeypatch, stderr):
    save_dir, models = run
    monkeypatch.setattr(sys, "stderr", stderr())
    trainer = _replay_run(save_dir, None, CFG, "cpu")
    assert_same(snapshot(trainer), models[STEPS])
    shown = sys.stderr.getvalue()
    assert ("replaying: 100%" in shown and f" {STEPS}/{STEPS} " in shown) == (stderr is Terminal)
    assert (shown == "") == (stderr is io.StringIO)


def test_the_safetensors_library_reads_and_writes_the_format(run, tmp_path):
    import safetensors
    import safetensors.numpy

    save_dir, models = run
    path = export_at(run, 2, tmp_path / "model.safetensors")
    tensors = safetensors.numpy.load_file(str(path))
    model = models[2]
    assert set(tensors) == set(expected_tensors(CFG))
    for k, v in model.params.items():
        assert tensors[f"param/{k}"].dtype == np.int8
        assert np.array_equal(tensors[f"param/{k}"], v)
    for k, v in model.overlays.items():
        assert np.array_equal(tensors[f"overlay/{k}"], v)
    for prefix, table in [("adam_m", model.state.m), ("adam_v", model.state.v)]:
        for k, v in table.items():
            assert tensors[f"{prefix}/{k}"].dtype == np.float32
            assert np.array_equal(tensors[f"{prefix}/{k}"], v)
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and json.loads(meta["config"]) == CFG.to_dict()
    assert meta["fingerprint"] == CFG.fingerprint().hex()
    assert (meta["step"], meta["seed"]) == ("2", str(model.seed))
    # and what the library writes (its own tensor order and offsets) reads back here
    again = tmp_path / "library.safetensors"
    safetensors.numpy.save_file(tensors, str(again), metadata=meta)
    assert_same(load_model(again), model)


def test_resuming_from_an_export_then_replaying_equals_a_full_replay(run, tmp_path):
    save_dir, models = run
    path = export_at(run, 1, tmp_path / "step1.safetensors")
    trainer = resume(path, "cpu", threads=1, save_dir=save_dir)
    assert (trainer.step, trainer.seed) == (1, models[1].seed)
    seen = []
    replay(save_dir, trainer, progress=lambda step, last, changed: seen.append(step))
    assert seen == [2, 3]  # only the steps after the export
    full = replay(save_dir, Trainer(CpuBackend(CFG, threads=1)))
    assert_same(snapshot(trainer), snapshot(full))
    assert_same(snapshot(trainer), models[STEPS])
    # an export of the newest step has nothing left to replay
    last = export_at(run, STEPS, tmp_path / "last.safetensors")
    assert_same(snapshot(replay(save_dir, resume(last, "cpu", save_dir=save_dir))), models[STEPS])


def test_a_resume_refuses_another_run(run, tmp_path):
    save_dir, models = run
    path = export_at(run, 2, tmp_path / "model.safetensors")
    other = tmp_path / "other"
    other.mkdir()
    save_config(other, CFG.replace(optimizer=dict(beta1=0.8)))
    with pytest.raises(ExportError, match=r"another config .*optimizer\.beta1: 0\.9 != 0\.8"):
        resume(path, "cpu", save_dir=other)
    short = tmp_path / "short"  # the same run's history, cut at step 1
    short.mkdir()
    save_config(short, CFG)
    (short / "checkpoint_00000001.bin").write_bytes(
        (save_dir / "checkpoint_00000001.bin").read_bytes()
    )
    with pytest.raises(ExportError, match=r"at step 2, beyond .* history \(step 1\)"):
        resume(path, "cpu", save_dir=short)
    (short / "checkpoint_00000002.bin").write_bytes(
        (save_dir / "checkpoint_00000003.bin").read_bytes()[:8]
        + (2).to_bytes(8, "little")
        + (save_dir / "checkpoint_00000003.bin").read_bytes()[16:]
    )  # step 2 with step 3's seed
    with pytest.raises(ExportError, match="not a model of this run"):
        resume(path, "cpu", save_dir=short)
    with pytest.raises(ExportError, match="config.json not found"):
        resume(path, "cpu", save_dir=tmp_path)


def test_a_trainer_from_a_model_continues_training(run):
    _, models = run
    trainer = trainer_from_model(models[1], "cpu")
    trainer.train_step(DATA)
    assert_same(snapshot(trainer), models[2])


# --- a file that is not what it claims ------------------------------------------------


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def edit_header(edit):
    def corrupt(path: Path) -> bytes:
        header, data = split(path)
        edit(header)
        return join(header, data)

    return corrupt


def nan_in(key: str, value: float = float("nan")):
    def corrupt(path: Path) -> bytes:
        header, data = split(path)
        begin = header[key]["data_offsets"][0]
        data = data[:begin] + struct.pack("<f", value) + data[begin + 4 :]
        return join(header, data)

    return corrupt


def entry(key: str, field: str, value):
    return edit_header(lambda h: h[key].__setitem__(field, value))


def metadata(key: str, value):
    return edit_header(lambda h: h["__metadata__"].__setitem__(key, value))


OTHER = tiny_config(model=dict(n_layers=2))

CORRUPTIONS = {
    "empty": (lambda p: b"", r"truncated \(0 bytes\)"),
    "truncated data": (lambda p: p.read_bytes()[:-1], "outside the .* data bytes"),
    "padded data": (lambda p: p.read_bytes() + b"\0", "1 bytes after the last tensor"),
    "a gap": (entry("param/ln_f", "data_offsets", [2**10, 2**10 + 32]), "leaves a gap|overlaps"),
    "truncated header": (lambda p: p.read_bytes()[:100], "truncated: the header announces"),
    "huge header length": (
        lambda p: struct.pack("<Q", 2**63) + p.read_bytes()[8:],
        f"header length {2**63} is above the {MAX_HEADER_BYTES}-byte limit",
    ),
    "not json": (lambda p: struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
    "not an object": (lambda p: struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    "duplicate key": (
        lambda p: struct.pack("<Q", 16) + b'{"a":1, "a":2}  ',
        "duplicate key 'a'",
    ),
    "no metadata": (edit_header(lambda h: h.pop("__metadata__")), "no __metadata__"),
    "another format": (metadata("format", "gguf"), "format 'gguf', expected 'deggs-model-1'"),
    "no step": (edit_header(lambda h: h["__metadata__"].pop("step")), "metadata lacks step"),
    "bad step": (metadata("step", "-1"), "step '-1' is not a decimal number"),
    "bad seed": (metadata("seed", str(2**32)), "seed 4294967296 is outside"),
    "bad config": (metadata("config", "{}}"), "bad config in the metadata"),
    "another config's fingerprint": (
        metadata("fingerprint", OTHER.fingerprint().hex()),
        "is not its config's .*corrupt or edited",
    ),
    "wrong dtype": (entry("param/w_q", "dtype", "F32"), "param/w_q has dtype 'F32', expected I8"),
    "state as int8": (entry("adam_v/w_q", "dtype", "I8"), "adam_v/w_q has dtype 'I8'"),
    "wrong shape": (entry("param/w_q", "shape", [32, 32]), r"shape \[32, 32\], expected \[1, 32"),
    "float shape": (entry("param/emb_bias", "shape", [32.0]), "emb_bias has shape"),
    "missing tensor": (
        edit_header(lambda h: h.pop("overlay/w_k_row")),
        "missing tensor overlay/w_k_row",
    ),
    "extra tensor": (
        edit_header(lambda h: h.__setitem__("param/extra", h["param/w_q"])),
        "unexpected tensor 'param/extra'",
    ),
    "extra field": (entry("param/w_q", "offset", 0), "exactly dtype, shape and data_offsets"),
    "overlapping offsets": (
        edit_header(
            lambda h: h["param/ln_f_bias"].__setitem__(
                "data_offsets", h["param/ln_f"]["data_offsets"]
            )
        ),
        "overlaps the tensor before it",
    ),
    "offsets out of range": (
        entry("param/ln_f", "data_offsets", [2**40, 2**40 + 32]),
        "outside the .* data bytes",
    ),
    "offsets of the wrong size": (entry("param/ln_f", "data_offsets", [0, 1]), "span 1 bytes"),
    "string offsets": (entry("param/ln_f", "data_offsets", ["0", "32"]), "two integers"),
    "NaN in the state": (nan_in("adam_m/w_v"), "adam_m/w_v holds NaN or infinite"),
    "infinity in the state": (nan_in("adam_acc/ln_1", float("inf")), "adam_acc/ln_1 holds NaN"),
    "negative v": (nan_in("adam_v/w_o", -1.0), "adam_v/w_o holds negative values"),
}


@pytest.fixture(scope="module")
def good_file(run, tmp_path_factory):
    return export_at(run, 2, tmp_path_factory.mktemp("good") / "model.safetensors")


@pytest.mark.parametrize("corrupt, message", CORRUPTIONS.values(), ids=list(CORRUPTIONS))
def test_a_bad_file_is_refused_with_the_reason(good_file, tmp_path, corrupt, message):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(corrupt(good_file))
    with pytest.raises(ExportError, match=message) as raised:
        load_model(bad)
    assert str(raised.value).startswith(f"{bad}: ")


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ExportError, match="cannot read"):
        load_model(tmp_path / "none.safetensors")


def test_save_refuses_a_model_that_does_not_match_its_config(run, tmp_path):
    trainer = trainer_from_model(run[1][1], "cpu")
    trainer.backend.params.pop("w_q")
    with pytest.raises(ExportError, match=r"missing \['param/w_q'\]"):
        save_model(tmp_path / "m.safetensors", trainer)
    trainer = trainer_from_model(run[1][1], "cpu")
    trainer.backend.state.v["w_q"][0, 0, 0] = np.nan
    with pytest.raises(ExportError, match="adam_v/w_q holds NaN or infinite values, not saved"):
        save_model(tmp_path / "m.safetensors", trainer)
    assert list(tmp_path.iterdir()) == []


# --- the commands -------------------------------------------------------------------


def invoke(command, *args):
    return CliRunner().invoke(command, [str(a) for a in args])


def test_export_then_generate_from_it_samples_as_the_replay_does(run, tmp_path):
    save_dir, models = run
    out = tmp_path / "model.safetensors"
    result = invoke(export_main, "--load-dir", save_dir, "--out", out, "--backend", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # stderr is no terminal here: no bars in the logs
    assert f"step {STEPS}: wrote {out}" in result.stdout
    assert_same(load_model(out), models[STEPS])

    common = ("--data-dir", save_dir, "--backend", "cpu", "--tokens", 16)
    replayed = invoke(generate_main, "--load-dir", save_dir, *common)
    exported = invoke(generate_main, "--model", out, *common)
    assert replayed.exit_code == 0 and exported.exit_code == 0, replayed.output + exported.output
    assert replayed.stderr == exported.stderr == ""
    lines = exported.stdout.splitlines()
    assert lines == replayed.stdout.splitlines()[-2:]
    # the text is the model's own sample
    trainer = trainer_from_model(models[STEPS], "cpu")
    prompt = prompt_window(CFG, DATA, STEPS)
    sample = trainer.sample(prompt, 16)
    assert lines == [
        f"step {STEPS}: the prompt, >>>, then the model's 16 tokens",
        detokenize(sample[: len(prompt)], CFG, None)
        + " >>> "
        + detokenize(sample[len(prompt) :], CFG, None),
    ]

    # a replay started from an earlier export gets there too
    early = tmp_path / "step1.safetensors"
    export_at(run, 1, early)
    resumed = invoke(generate_main, "--load-dir", save_dir, "--from", early, *common)
    assert resumed.exit_code == 0, resumed.output
    assert resumed.stdout.splitlines()[-2:] == lines
    again = tmp_path / "again.safetensors"
    result = invoke(export_main, "--load-dir", save_dir, "--out", again, "--from", early)
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == out.read_bytes()


def test_the_commands_refuse_bad_input_in_one_line(run, tmp_path):
    save_dir, _ = run
    model = export_at(run, 2, tmp_path / "model.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 7)
    other = tmp_path / "other"
    other.mkdir()
    save_config(other, OTHER)
    cases = [
        (generate_main, ["--load-dir", save_dir, "--model", model], "either --load-dir or --model"),
        (generate_main, [], "either --load-dir or --model"),
        (generate_main, ["--model", model, "--from", model], "--from and --step need --load-dir"),
        (generate_main, ["--model", model, "--step", "1"], "--from and --step need --load-dir"),
        (export_main, ["--load-dir", save_dir, "--out", tmp_path / "y", "--step", "99"], "ends at"),
        (generate_main, ["--model", bad], "truncated"),
        (generate_main, ["--load-dir", other, "--from", model, "--prompt", "ab"], "another config"),
        (
            export_main,
            ["--load-dir", other, "--out", tmp_path / "x", "--from", model],
            "another config",
        ),
        (export_main, ["--load-dir", save_dir, "--out", tmp_path / "no" / "x"], "not a directory"),
        (export_main, ["--load-dir", tmp_path, "--out", tmp_path / "x"], "no config.json"),
    ]
    for command, args, message in cases:
        result = invoke(command, *args, "--backend", "cpu")
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(("deggs-generate: error: ", "deggs-export: error: "))
    assert not (tmp_path / "x").exists()


def test_an_export_with_its_tokenizer_samples_from_a_prompt_with_nothing_else(tmp_path):
    """deggs-export --data-dir puts the BPE vocabulary and tokenizer in the file;
    deggs-generate --model FILE --prompt TEXT then needs no data directory."""
    import contextlib

    from deggs.prepare import default_corpus, prepare

    cfg = tiny_config(model={"vocab_size": 300})
    prepare(default_corpus()[:100_000], 300, tmp_path / "data", cfg=cfg)
    (tmp_path / "run").mkdir()
    save_config(tmp_path / "run", cfg)  # a run at step 0: nothing to replay
    out = tmp_path / "model.safetensors"
    exported = invoke(
        export_main,
        "--load-dir",
        tmp_path / "run",
        "--data-dir",
        tmp_path / "data",
        "--out",
        out,
        "--backend",
        "cpu",
    )
    assert exported.exit_code == 0, exported.output
    assert set(load_model(out).files) == {"decoding.bin", "tokenizer.json"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with contextlib.chdir(elsewhere):
        sample = invoke(generate_main, "--model", out, "--prompt", "def ", "--backend", "cpu")
    assert sample.exit_code == 0, sample.output
    head, text = sample.stdout.splitlines()[:2]
    assert head.startswith("step 0: the prompt, >>>, then the model's")
    assert text.startswith("def  >>> ")  # the prompt's text, decoded by the carried vocabulary

    without = tmp_path / "bare.safetensors"
    assert invoke(export_main, "--load-dir", tmp_path / "run", "--out", without).exit_code == 0
    with contextlib.chdir(elsewhere):
        bare = invoke(generate_main, "--model", without, "--prompt", "def ", "--backend", "cpu")
    assert bare.exit_code == 2
    assert "tokenizer.json not found" in bare.output and "export the model with --data-dir" in (
        bare.output
    )
