"""Training data files, in the reference's formats.

input.bin     the token stream: uint8 per token when vocab_size is 256 (raw bytes),
              little-endian uint32 otherwise.
val.bin       the held-out end of the stream (deggs-prepare --val-fraction), same format.
decoding.bin  the vocabulary: uint32 count, then per token a uint32 length and its bytes.
meta.json     what deggs-prepare made (deggs' own, optional): vocab_size, token_dtype,
              tokenizer_sha256, train_tokens, val_tokens, deggs_version. When it is
              there, check_meta refuses data that does not match it or the config.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .config import Config
from .files import write_atomic

META_FILE = "meta.json"
TRAIN_FILE = "input.bin"
VAL_FILE = "val.bin"
TOKENIZER_FILE = "tokenizer.json"
META_FORMAT = 1


class DataError(ValueError):
    """An input.bin or decoding.bin that cannot be used; the message says why."""


def _unreadable(path: Path, e: OSError) -> DataError:
    return DataError(f"{path}: cannot be read ({e.strerror or e})")


def min_tokens(cfg: Config) -> int:
    """The fewest tokens an input.bin may hold: a member's window, and the prompt."""
    return max(cfg.model.seq_len + 1, cfg.sampling.prompt_tokens)


def dtype_name(vocab_size: int) -> str:
    """The token type of the data files of a vocab: "uint8" (bytes) or "uint32"."""
    return "uint8" if vocab_size == 256 else "uint32"


def load_tokens(path: str | Path, cfg: Config) -> np.ndarray:
    """The token stream of input.bin (or val.bin), checked against the config and, when
    there is one beside it, against meta.json's vocab and token type."""
    path = Path(path)
    dtype = np.dtype(cfg.token_dtype).newbyteorder("<")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: not found (run deggs-prepare to make one)") from None
    except OSError as e:
        raise _unreadable(path, e) from None
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a token file")
    meta = read_meta(path.parent)
    if meta is not None:
        _check_kind(meta, path.parent / META_FILE, cfg)
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.itemsize}-byte "
            f"tokens (vocab_size {cfg.model.vocab_size})"
        )
    try:
        tokens = np.fromfile(path, dtype=dtype).astype(cfg.token_dtype)
    except OSError as e:
        raise _unreadable(path, e) from None
    need = min_tokens(cfg)
    if len(tokens) < need:
        raise DataError(
            f"{path}: {len(tokens)} tokens, fewer than seq_len + 1 = "
            f"{cfg.model.seq_len + 1} (or the prompt's {cfg.sampling.prompt_tokens})"
        )
    if not cfg.model.byte_tokens and len(tokens):
        top = int(tokens.max())
        if top >= cfg.model.vocab_size:
            where = int(np.argmax(tokens >= cfg.model.vocab_size))
            raise DataError(
                f"{path}: token {top} at index {where} is not below vocab_size "
                f"{cfg.model.vocab_size}"
            )
    tokens.flags.writeable = False  # the GPU backend keeps a device copy of the stream
    return tokens


def save_tokens(path: str | Path, tokens, cfg: Config) -> None:
    dtype = np.dtype(cfg.token_dtype).newbyteorder("<")
    np.asarray(tokens).astype(dtype).tofile(path)


def load_decoding(path: str | Path, vocab_size: int | None = None) -> list[bytes]:
    """The byte string of every token id from decoding.bin; given vocab_size (the
    config's model.vocab_size), it must hold exactly that many tokens."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except OSError as e:
        raise _unreadable(path, e) from None
    return parse_decoding(raw, str(path), vocab_size)


def parse_decoding(raw: bytes, path: str, vocab_size: int | None = None) -> list[bytes]:
    """load_decoding of decoding.bin's bytes (from a file, or an export); path names them."""
    if len(raw) < 4:
        raise DataError(f"{path}: too short for its token count ({len(raw)} bytes)")
    count = int.from_bytes(raw[:4], "little")
    pieces, pos = [], 4
    for token in range(count):
        if pos + 4 > len(raw):
            raise DataError(f"{path}: ends before the length of token {token} of {count}")
        n = int.from_bytes(raw[pos : pos + 4], "little")
        if pos + 4 + n > len(raw):
            raise DataError(f"{path}: token {token} claims {n} bytes, past the end of the file")
        pieces.append(raw[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if pos != len(raw):
        raise DataError(f"{path}: {len(raw) - pos} bytes left over after {count} tokens")
    if vocab_size is not None and count != vocab_size:
        raise DataError(
            f"{path}: {count} tokens, but vocab_size is {vocab_size} "
            "(a decoding.bin from another vocab?)"
        )
    return pieces


def decoding_bytes(pieces: list[bytes]) -> bytes:
    """decoding.bin's contents for a vocabulary."""
    out = bytearray(len(pieces).to_bytes(4, "little"))
    for piece in pieces:
        out += len(piece).to_bytes(4, "little") + piece
    return bytes(out)


def save_decoding(path: str | Path, pieces: list[bytes]) -> None:
    Path(path).write_bytes(decoding_bytes(pieces))


# --- meta.json ---------------------------------------------------------------------------

META_INTS = ("vocab_size", "train_tokens", "val_tokens")


def byte_vocab_sha256() -> str:
    """meta.json's tokenizer hash for vocab 256: that of the byte vocabulary (the
    decoding.bin of the 256 one-byte tokens)."""
    return hashlib.sha256(decoding_bytes([bytes([b]) for b in range(256)])).hexdigest()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_meta(data_dir: str | Path, meta: dict) -> None:
    write_atomic(Path(data_dir) / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())


def read_meta(data_dir: str | Path) -> dict | None:
    """meta.json of a data directory, checked for shape; None when there is none."""
    path = Path(data_dir) / META_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: not a JSON object")
    for key in META_INTS:
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataError(f"{path}: {key} is {value!r}, not a token count")
    if meta.get("token_dtype") not in ("uint8", "uint32"):
        raise DataError(f"{path}: token_dtype is {meta.get('token_dtype')!r}, not uint8 or uint32")
    return meta


def _check_kind(meta: dict, path: Path, cfg: Config) -> None:
    """The data's vocab and token type against the config's."""
    want = dtype_name(cfg.model.vocab_size)
    if meta["token_dtype"] != want:
        raise DataError(
            f"{path}: the data holds {meta['token_dtype']} tokens (vocab_size "
            f"{meta['vocab_size']}), but the config's vocab_size {cfg.model.vocab_size} "
            f"reads {want}: prepare the data for this config (deggs-prepare --config)"
        )
    if meta["vocab_size"] != cfg.model.vocab_size:
        raise DataError(
            f"{path}: the data was prepared for vocab_size {meta['vocab_size']}, the "
            f"config has model.vocab_size {cfg.model.vocab_size}"
        )


def check_meta(data_dir: str | Path, cfg: Config) -> dict | None:
    """Refuse data that meta.json says is not for this config, or whose files are not
    those meta.json describes (another deggs-prepare run's input.bin, val.bin or
    tokenizer.json). Returns the meta, or None when the directory has no meta.json."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    if meta is None:
        return None
    meta_path = data_dir / META_FILE
    _check_kind(meta, meta_path, cfg)
    itemsize = np.dtype(meta["token_dtype"]).itemsize
    for name, key in ((TRAIN_FILE, "train_tokens"), (VAL_FILE, "val_tokens")):
        path, count = data_dir / name, meta[key]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if count == 0 and name == VAL_FILE:
                continue
            raise DataError(f"{path}: not found, but {meta_path} records {count} tokens") from None
        except OSError as e:
            raise _unreadable(path, e) from None
        if path.is_dir():
            raise DataError(f"{path}: is a directory, not a token file")
        if size != count * itemsize:
            raise DataError(
                f"{path}: {size} bytes, but {meta_path} records {count} tokens "
                f"({count * itemsize} bytes): data files of different deggs-prepare runs?"
            )
    tokenizer = data_dir / TOKENIZER_FILE
    recorded = meta.get("tokenizer_sha256")
    if meta["vocab_size"] != 256 and isinstance(recorded, str) and tokenizer.is_file():
        try:
            actual = file_sha256(tokenizer)
        except OSError as e:
            raise _unreadable(tokenizer, e) from None
        if actual != recorded:
            raise DataError(
                f"{tokenizer}: its sha256 {actual[:16]}... is not the {recorded[:16]}... "
                f"that {meta_path} records: a tokenizer of another deggs-prepare run?"
            )
    return meta


def detokenize(tokens, cfg: Config, pieces: list[bytes] | None) -> str:
    """Readable text of tokens: bytes shown as text in byte mode, else the vocabulary."""
    if cfg.model.byte_tokens:
        return "".join(chr(t) if 32 <= t <= 126 else "." for t in (int(t) for t in tokens))
    if pieces is None:
        return "[" + ",".join(str(int(t)) for t in tokens) + "]"
    raw = b"".join(
        pieces[t] if t < len(pieces) else f"<{t}>".encode() for t in (int(t) for t in tokens)
    )
    return raw.decode("utf-8", "replace")
