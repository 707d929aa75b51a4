"""Weights you can keep: a model at a step as one safetensors file.

A save directory rebuilds its model by replaying every step (replay.py); an export is
that model written down, so that sampling needs no replay and a later replay can start
from it. The file is a safetensors file (https://huggingface.co/docs/safetensors),
written and read here without the library:

    u64 little-endian N, then N bytes of JSON (padded with spaces to a multiple of 8),
    then the tensors' raw little-endian bytes, back to back

The JSON maps each tensor's name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets from the start of the data) and "__metadata__" to a table of strings:

    format       "deggs-model-1"
    config       the config's JSON (Config.to_json)
    fingerprint  the config's fingerprint, hex
    step, seed   the step the model is at and its seed, decimal
    digest       the model's state digest, hex (`state_digest`; files written before it
                 existed have none, and load without the check)

Tensors: `param/<name>` (I8, the logical layout of params.param_shapes),
`overlay/<name>` (I8, params.overlay_shapes) and the optimizer state `adam_m/<name>`,
`adam_v/<name>`, `adam_acc/<name>` (F32, shaped like the parameters): everything a
Trainer holds, so that training resumes from it bit for bit. The float tensors come
first, so every one of them starts at a multiple of 4 bytes.

Optional, last: `data/decoding.bin` and `data/tokenizer.json` (U8, one dimension), the
bytes of those files of the training data (deggs-export --data-dir), so that sampling
needs nothing but the model file: the vocabulary to show tokens as text, the tokenizer
to encode a prompt. A file without them still loads.

The file is never trusted: load_model bounds the header, parses it strictly and checks
every tensor against the config the file names (present, dtype, shape, offsets that
tile the data exactly) and the state for NaN and infinities; any problem raises
ExportError naming the file, and so does a digest that is not the tensors'. save_model
writes atomically (temporary file, fsync, rename), as the checkpoints are written.

The same file is a snapshot (snapshot.py): the coordinator stores and serves it, so this
module imports nothing that needs numba.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..config import Config, ConfigError
from ..files import atomic_file
from ..numerics.params import overlay_shapes, param_shapes
from ..numerics.state import OptimizerState
from .checkpoint import list_checkpoints, read_checkpoint, saved_config

if TYPE_CHECKING:  # the numerics need numba; the coordinator reads these files without it
    from ..numerics.es import Trainer

FORMAT = "deggs-model-1"
MAX_HEADER_BYTES = 16 << 20  # the JSON header; a default model's is about 10 KiB
MAX_STEP = 2**63 - 1
_LENGTH = struct.Struct("<Q")
_DTYPES: dict[str, np.dtype] = {
    "I8": np.dtype("i1"),
    "F32": np.dtype("<f4"),
    "U8": np.dtype("u1"),
}
DATA_FILES = ("decoding.bin", "tokenizer.json")  # carried as data/<name>, when given
MAX_DATA_FILE = 64 << 20  # bytes of one of them (a 65,536-token tokenizer.json: ~4 MiB)
_STATE_PREFIXES = ("adam_m", "adam_v", "adam_acc")  # OptimizerState's m, v, acc
_METADATA_KEYS = ("format", "config", "fingerprint", "step", "seed")
DIGEST_SIZE = 32  # SHA-256
_DIGEST_TAG = b"deggs-state-1"


class ExportError(ValueError):
    """A model file that cannot be written or used; the message names it and says why."""


class Model(NamedTuple):
    """A model at a step, as an export holds it."""

    cfg: Config
    step: int
    seed: int
    params: dict[str, np.ndarray]
    overlays: dict[str, np.ndarray]
    state: OptimizerState
    files: dict[str, bytes] = {}  # data/<name> tensors: DATA_FILES it carries (never mutated)


def expected_tensors(cfg: Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of an export of this config, name -> (dtype, shape), in file order."""
    params = param_shapes(cfg)
    out = {f"{p}/{k}": ("F32", s) for p in _STATE_PREFIXES for k, s in params.items()}
    out.update({f"param/{k}": ("I8", s) for k, s in params.items()})
    out.update({f"overlay/{k}": ("I8", s) for k, s in overlay_shapes(cfg).items()})
    return out


def _tensors(model: Model) -> dict[str, np.ndarray]:
    state = model.state
    out = {}
    for prefix, table in zip(_STATE_PREFIXES, (state.m, state.v, state.acc), strict=True):
        out.update({f"{prefix}/{k}": v for k, v in table.items()})
    out.update({f"param/{k}": v for k, v in model.params.items()})
    out.update({f"overlay/{k}": v for k, v in model.overlays.items()})
    return out


def state_digest(model: Model) -> bytes:
    """SHA-256 of everything that decides the model's next steps: the config's
    fingerprint, the step, the seed and every tensor's bytes in file order. Two replicas
    of a run hold the same model exactly when their digests agree; the config's tables
    outside the fingerprint (where workers may differ) are left out."""
    h = hashlib.sha256(_DIGEST_TAG + model.cfg.fingerprint())
    h.update(struct.pack("<QQ", model.step, model.seed))
    tensors = _tensors(model)
    for key, (dtype, _) in expected_tensors(model.cfg).items():
        h.update(key.encode() + b"\0")
        h.update(np.ascontiguousarray(tensors[key], dtype=_DTYPES[dtype]).data)
    return h.digest()


# --- writing -------------------------------------------------------------------------


def model_of(trainer: Trainer) -> Model:
    """What an export of this trainer holds (the backend's arrays, copies on the GPU)."""
    backend = trainer.backend
    return Model(
        trainer.cfg, trainer.step, trainer.seed, backend.params, backend.overlays, backend.state
    )


def _layout(model: Model, name: str) -> tuple[bytes, list[np.ndarray]]:
    """The header bytes (length prefix included) and the arrays in file order."""
    expected = expected_tensors(model.cfg)
    tensors = _tensors(model)
    for file, raw in model.files.items():
        if file not in DATA_FILES or len(raw) > MAX_DATA_FILE:
            raise ExportError(f"{name}: cannot carry {file!r} ({len(raw)} bytes)")
        expected[f"data/{file}"] = ("U8", (len(raw),))
        tensors[f"data/{file}"] = np.frombuffer(raw, np.uint8)
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise ExportError(
            f"{name}: the model's tensors do not match its config "
            f"(missing {missing}, unexpected {extra})"
        )
    header: dict[str, object] = {
        "__metadata__": {
            "format": FORMAT,
            "config": model.cfg.to_json(),
            "fingerprint": model.cfg.fingerprint().hex(),
            "step": str(model.step),
            "seed": str(model.seed),
            "digest": state_digest(model).hex(),
        }
    }
    arrays = []
    offset = 0
    for key, (dtype, shape) in expected.items():
        array = np.ascontiguousarray(tensors[key], dtype=_DTYPES[dtype])
        if array.shape != shape:
            raise ExportError(f"{name}: {key} has shape {array.shape}, its config's is {shape}")
        if dtype == "F32" and not np.isfinite(array).all():
            raise ExportError(f"{name}: {key} holds NaN or infinite values, not saved")
        header[key] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text, arrays


def encode_model(model: Model) -> bytes:
    """The model file's bytes, in memory (a snapshot a worker uploads)."""
    head, arrays = _layout(model, "the model")
    return b"".join([head, *(array.data for array in arrays)])


def save_model(
    path: str | Path,
    trainer: Trainer,
    progress: Callable[[int, int], None] | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write the trainer's model to `path` atomically; returns the path.

    progress(bytes written, bytes in all) is called after the header and each tensor.
    files: the training data's DATA_FILES to carry, by name (their bytes)."""
    path = Path(path)
    model = model_of(trainer)
    if files:
        model = model._replace(files=dict(files))
    head, arrays = _layout(model, str(path))
    size = len(head) + sum(array.nbytes for array in arrays)
    report = progress or (lambda done, total: None)
    with atomic_file(path) as f:
        f.write(head)
        report(f.tell(), size)
        for array in arrays:
            f.write(array.data)
            report(f.tell(), size)
    return path


# --- reading -------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _integer(name: str, key: str, text: object, low: int, high: int) -> int:
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 20:
        raise ExportError(f"{name}: metadata {key} {text!r} is not a decimal number")
    value = int(text)
    if not low <= value <= high:
        raise ExportError(f"{name}: metadata {key} {value} is outside [{low}, {high}]")
    return value


def _read_header(f, name: str, size: int) -> tuple[dict, int]:
    """The parsed JSON header and where the data starts."""
    if size < _LENGTH.size:
        raise ExportError(f"{name}: truncated ({size} bytes), not a safetensors file")
    (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise ExportError(
            f"{name}: header length {length} is above the {MAX_HEADER_BYTES}-byte limit "
            "(not a deggs model file, or a corrupt one)"
        )
    if length > size - _LENGTH.size:
        raise ExportError(
            f"{name}: truncated: the header announces {length} bytes, the file holds "
            f"{size - _LENGTH.size} after the length"
        )
    raw = f.read(length)
    if len(raw) != length:
        raise ExportError(f"{name}: truncated while reading the header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ExportError(f"{name}: the header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ExportError(f"{name}: the header is not a JSON object")
    return header, _LENGTH.size + length


def _read_metadata(header: dict, name: str) -> tuple[Config, int, int, bytes | None]:
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ExportError(f"{name}: no __metadata__ table of strings: not a deggs model file")
    missing = [k for k in _METADATA_KEYS if k not in meta]
    if meta.get("format") != FORMAT:
        raise ExportError(
            f"{name}: format {meta.get('format')!r}, expected {FORMAT!r}: not a deggs model "
            "file, or one this version cannot read"
        )
    if missing:
        raise ExportError(f"{name}: metadata lacks {', '.join(missing)}")
    try:
        cfg = Config.from_json(meta["config"])
    except ConfigError as e:
        raise ExportError(f"{name}: bad config in the metadata: {e}") from None
    if meta["fingerprint"] != cfg.fingerprint().hex():
        raise ExportError(
            f"{name}: fingerprint {meta['fingerprint']!r} is not its config's "
            f"({cfg.fingerprint().hex()}): a corrupt or edited file"
        )
    step = _integer(name, "step", meta["step"], 0, MAX_STEP)
    seed = _integer(name, "seed", meta["seed"], 0, 2**32 - 1)
    if step == 0 and seed != cfg.training.seed:
        raise ExportError(f"{name}: seed {seed} at step 0, its config's is {cfg.training.seed}")
    digest = meta.get("digest")
    if digest is None:
        return cfg, step, seed, None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != DIGEST_SIZE:
        raise ExportError(f"{name}: metadata digest {digest[:80]!r} is not {DIGEST_SIZE} hex bytes")
    return cfg, step, seed, raw


def _check_entries(
    header: dict, expected: dict[str, tuple[str, tuple[int, ...]]], name: str, data_size: int
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, tuple[int, ...]]]]:
    """Each tensor's (begin, end), checked: dtype, shape, offsets tiling the data; and
    the expected tensors with the optional data/ ones the file has."""
    missing = [k for k in expected if k not in header]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ExportError(f"{name}: missing tensor {', '.join(missing[:3])}{more}")
    for file in DATA_FILES:  # optional: their shape is their length
        entry = header.get(f"data/{file}")
        if entry is not None:
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not (
                isinstance(shape, list)
                and len(shape) == 1
                and type(shape[0]) is int
                and 0 <= shape[0] <= MAX_DATA_FILE
            ):
                raise ExportError(f"{name}: data/{file} has shape {shape}, expected [bytes]")
            expected = {**expected, f"data/{file}": ("U8", (shape[0],))}
    extra = [k for k in header if k not in expected]
    if extra:
        raise ExportError(f"{name}: unexpected tensor {extra[0]!r} for this config")
    spans = {}
    for key, (dtype, shape) in expected.items():
        entry = header[key]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ExportError(f"{name}: {key}: needs exactly dtype, shape and data_offsets")
        if entry["dtype"] != dtype:
            raise ExportError(f"{name}: {key} has dtype {entry['dtype']!r}, expected {dtype}")
        if (
            not isinstance(entry["shape"], list)
            or entry["shape"] != list(shape)
            or not all(type(n) is int for n in entry["shape"])
        ):
            raise ExportError(f"{name}: {key} has shape {entry['shape']}, expected {list(shape)}")
        offsets = entry["data_offsets"]
        if not (
            isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        ):
            raise ExportError(f"{name}: {key}: data_offsets must be two integers")
        begin, end = offsets
        nbytes = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_size:
            raise ExportError(
                f"{name}: {key}: data_offsets {offsets} are outside the {data_size} data bytes"
            )
        if end - begin != nbytes:
            raise ExportError(
                f"{name}: {key}: data_offsets {offsets} span {end - begin} bytes, "
                f"its shape needs {nbytes}"
            )
        spans[key] = (begin, end)
    position = 0
    for key, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
        if begin != position:
            problem = "overlaps the tensor before it" if begin < position else "leaves a gap"
            raise ExportError(f"{name}: {key}: data_offsets {[begin, end]} {problem}")
        position = end
    if position != data_size:
        raise ExportError(
            f"{name}: {data_size - position} bytes after the last tensor (truncated or padded)"
        )
    return spans, expected


def load_model(path: str | Path) -> Model:
    """Read and validate a model file: (cfg, step, seed, params, overlays, state)."""
    name = str(path)
    try:
        with open(path, "rb") as f:
            return _read_model(f, name, os.fstat(f.fileno()).st_size)[0]
    except OSError as e:
        raise ExportError(f"{name}: cannot read: {e.strerror or e}") from None


def model_from_bytes(data: bytes, name: str) -> Model:
    """A model file's bytes (an uploaded or downloaded snapshot), validated as load_model
    validates a file; `name` says where they came from in errors."""
    return model_and_digest(data, name)[0]


def model_and_digest(data: bytes, name: str) -> tuple[Model, bytes]:
    """model_from_bytes, and the model's state digest: the one the file records (checked
    against its tensors when read), else computed; either way hashed once."""
    model, recorded = _read_model(io.BytesIO(data), name, len(data))
    return model, recorded if recorded is not None else state_digest(model)


def _read_model(f: io.BufferedIOBase, name: str, size: int) -> tuple[Model, bytes | None]:
    """The model, and the digest its metadata records (checked), if it records one."""
    header, start = _read_header(f, name, size)
    cfg, step, seed, digest = _read_metadata(header, name)
    spans, expected = _check_entries(header, expected_tensors(cfg), name, size - start)
    arrays = {}
    for key, (dtype, shape) in expected.items():
        begin, end = spans[key]
        buffer = bytearray(end - begin)
        f.seek(start + begin)
        if f.readinto(buffer) != len(buffer):
            raise ExportError(f"{name}: truncated while reading {key}")
        array = np.frombuffer(buffer, _DTYPES[dtype]).reshape(shape)
        arrays[key] = array.astype(array.dtype.newbyteorder("="), copy=False)
    for key, array in arrays.items():
        if key.startswith(_STATE_PREFIXES) and not np.isfinite(array).all():
            raise ExportError(f"{name}: {key} holds NaN or infinite values")
        if key.startswith("adam_v/") and (array < 0).any():
            raise ExportError(f"{name}: {key} holds negative values")
    table = lambda prefix: {
        k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(prefix + "/")
    }
    state = OptimizerState(table("adam_m"), table("adam_v"), table("adam_acc"))
    files = {k: v.tobytes() for k, v in table("data").items()}
    model = Model(cfg, step, seed, table("param"), table("overlay"), state, files)
    if digest is not None and state_digest(model) != digest:
        raise ExportError(
            f"{name}: the tensors' digest is not the one the file records: a corrupt or edited file"
        )
    return model, digest


# --- training and replaying from an export ---------------------------------------------


def trainer_from_model(model: Model, backend: str = "auto", threads: int | None = None) -> Trainer:
    """A Trainer holding the model, at its step and seed, on the named backend."""
    from ..numerics.backend import make_backend
    from ..numerics.es import Trainer

    trainer = Trainer(make_backend(model.cfg, backend, threads))
    load_into(trainer, model)
    return trainer


def load_into(trainer: Trainer, model: Model) -> None:
    """Put a model (of the trainer's config) into a trainer: weights, state, step, seed."""
    trainer.backend.load_state(model.params, model.overlays, model.state)
    trainer.step, trainer.seed = model.step, model.seed


def check_history(model: Model, save_dir: str | Path, name: str) -> None:
    """Refuse to continue `model` (read from `name`) with a save directory's steps unless
    the directory trained the same config and its history reaches the model's step."""
    saved = saved_config(save_dir)
    config_file = Path(save_dir) / "config.json"
    if saved is None:
        raise ExportError(f"{config_file} not found: cannot check {name} against the run")
    if saved.fingerprint() != model.cfg.fingerprint():
        diffs = "; ".join(model.cfg.differences(saved)) or "fingerprints differ"
        raise ExportError(
            f"{name} was trained with another config than {config_file} (export != saved): {diffs}"
        )
    files = list_checkpoints(save_dir)
    last = max(files, default=0)
    if model.step > last:
        raise ExportError(
            f"{name} is at step {model.step}, beyond {save_dir}'s history (step {last})"
        )
    if model.step in files:
        checkpoint = read_checkpoint(files[model.step], model.cfg.training.n_pairs)
        if checkpoint.seed != model.seed:
            raise ExportError(
                f"{name}: seed {model.seed} at step {model.step}, {files[model.step]} "
                f"says {checkpoint.seed}: not a model of this run"
            )


def resume(
    path: str | Path,
    backend: str = "auto",
    threads: int | None = None,
    save_dir: str | Path | None = None,
) -> Trainer:
    """A Trainer at an export's step; with save_dir, checked to continue that run's replay
    (same config fingerprint, a step within its history): replay(save_dir, trainer)."""
    model = load_model(path)
    if save_dir is not None:
        check_history(model, save_dir, str(path))
    return trainer_from_model(model, backend, threads)
