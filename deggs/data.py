"""Training data files, in the reference's formats.

input.bin     the token stream: uint8 per token when vocab_size is 256 (raw bytes),
              little-endian uint32 otherwise.
decoding.bin  the vocabulary: uint32 count, then per token a uint32 length and its bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import Config


class DataError(ValueError):
    """An input.bin or decoding.bin that cannot be used; the message says why."""


def load_tokens(path: str | Path, cfg: Config) -> np.ndarray:
    """The token stream of input.bin, checked against the config."""
    path = Path(path)
    dtype = np.dtype(cfg.token_dtype).newbyteorder("<")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{path}: not found (run deggs-prepare to make one)") from None
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of {dtype.itemsize}-byte "
            f"tokens (vocab_size {cfg.model.vocab_size})"
        )
    tokens = np.fromfile(path, dtype=dtype).astype(cfg.token_dtype)
    need = max(cfg.model.seq_len + 1, cfg.sampling.prompt_tokens)
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
    return tokens


def save_tokens(path: str | Path, tokens, cfg: Config) -> None:
    dtype = np.dtype(cfg.token_dtype).newbyteorder("<")
    np.asarray(tokens).astype(dtype).tofile(path)


def load_decoding(path: str | Path) -> list[bytes]:
    """The byte string of every token id from decoding.bin."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
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
    return pieces


def save_decoding(path: str | Path, pieces: list[bytes]) -> None:
    out = bytearray(len(pieces).to_bytes(4, "little"))
    for piece in pieces:
        out += len(piece).to_bytes(4, "little") + piece
    Path(path).write_bytes(bytes(out))


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
