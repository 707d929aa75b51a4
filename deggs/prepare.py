"""Making input.bin, val.bin, decoding.bin and meta.json from text.

Vocab 256 stores the text's UTF-8 bytes as tokens. Any other vocab size trains a
byte-level BPE tokenizer (the `tokenizers` library) on the text itself, here, with no
download; its vocabulary becomes decoding.bin and it is saved as tokenizer.json so that
prompts can be encoded later (deggs-generate). The tokenizer is trained on the whole
text, the held-out part included.

The end of the token stream (`val_fraction` of it, rounded down) is held out as val.bin;
input.bin + val.bin is the whole stream. meta.json, written last, records what was made
(data.check_meta holds the files to it).

Large texts are read and encoded in pieces of about `chunk_bytes`, so memory stays
bounded whatever the text's size. A piece ends just before a newline (else a space or a
tab) that follows a printable ASCII character: the byte-level pre-tokenizer always
splits a text there, so the token stream is exactly the one a single encode of the whole
text gives, and the tokenizer learns the same merges. Only a run of more than
`chunk_bytes` bytes with no such place in it is cut elsewhere (at a character boundary),
and only there can the tokens differ from a single encode's: the stream is then the
concatenation of the pieces' encodings.

The default corpus is the Python Language Reference and library topics that every
CPython carries for help() (the standard library's pydoc_data.topics, about 460 KB of
English prose and examples), so a fresh machine can train with nothing downloaded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from . import __version__
from .config import Config
from .data import (
    META_FORMAT,
    TOKENIZER_FILE,
    TRAIN_FILE,
    VAL_FILE,
    DataError,
    byte_vocab_sha256,
    decoding_bytes,
    dtype_name,
    file_sha256,
    min_tokens,
    write_meta,
)
from .files import write_atomic

CHUNK_BYTES = 1 << 20  # text decoded and encoded at a time
BATCH_PIECES = 4  # pieces per encode_batch call (the tokenizers library's threads share them)
DEFAULT_VAL_FRACTION = 0.05
ERRORS = ("strict", "replace", "ignore")  # what to do with bytes that are not UTF-8


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def byte_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (as GPT-2 defines it)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def train_tokenizer(text: str | Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on a text, or on the pieces of one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([text] if isinstance(text, str) else text, trainer)
    return tokenizer


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes, for decoding.bin."""
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    vocab = tokenizer.get_vocab()
    pieces = [b""] * len(vocab)
    for piece, token in vocab.items():
        pieces[token] = bytes(to_byte[c] for c in piece)
    return pieces


def _cut(buf: bytes) -> int:
    """Where to end a piece of buf: just before the last newline, else space or tab,
    that follows a printable ASCII character, where the byte-level pre-tokenizer always
    splits; else before an incomplete UTF-8 sequence at its end (0: buf is one)."""
    for sep in (b"\n", b" ", b"\t"):
        pos = buf.rfind(sep)
        while pos > 0:
            if 0x21 <= buf[pos - 1] <= 0x7E:
                return pos
            pos = buf.rfind(sep, 0, pos)
    for back in range(1, min(4, len(buf)) + 1):
        byte = buf[-back]
        if byte < 0x80:  # ASCII: nothing pending
            break
        if byte >= 0xC0:  # the lead byte of the last sequence: is it complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(buf) - back if need > back else len(buf)
    return len(buf)  # (cut anywhere else, the decoding of bytes would not change)


class _Text:
    """The text to prepare, read as bytes and decoded in pieces (see the module's doc)."""

    def __init__(self, source: str | bytes | Path, errors: str, chunk_bytes: int):
        self.path = source if isinstance(source, Path) else None
        if self.path is not None:
            self.name = str(self.path)
            self.size = self.path.stat().st_size
        else:
            self.name = "the text"
            if isinstance(source, str):  # a lone surrogate: decoding says where it is
                source = source.encode("utf-8", "surrogatepass")
            self._data = bytes(source)
            self.size = len(self._data)
        self.errors, self.chunk_bytes = errors, chunk_bytes

    def _open(self) -> BinaryIO:
        return open(self.path, "rb") if self.path is not None else io.BytesIO(self._data)

    def pieces(self) -> Iterator[tuple[int, str]]:
        """(bytes read so far, text) for each piece, in order."""
        with self._open() as f:
            offset, carry = 0, b""  # offset: where carry starts in the file
            while True:
                block = f.read(self.chunk_bytes)
                buf = carry + block
                if not buf:
                    return
                cut = _cut(buf) if block else len(buf)
                if cut == 0:  # the start of a character and nothing else: read on
                    carry = buf
                    continue
                yield offset + cut, self._decode(buf[:cut], offset)
                offset, carry = offset + cut, buf[cut:]

    def _decode(self, raw: bytes, offset: int) -> str:
        try:
            return raw.decode("utf-8", self.errors)
        except UnicodeDecodeError as e:
            bad = offset + e.start
            raise DataError(
                f"{self.name}: not valid UTF-8 at byte offset {bad} (0x{raw[e.start]:02x}: "
                f"{e.reason}); --errors replace or --errors ignore accepts such bytes"
            ) from None


def _batches(items: Iterator, n: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _sync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prepare(
    source: str | bytes | Path,
    vocab_size: int,
    out: str | Path,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    cfg: Config | None = None,
    errors: str = "strict",
    chunk_bytes: int = CHUNK_BYTES,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Write input.bin, val.bin (when val_fraction > 0), meta.json and, for a BPE vocab,
    decoding.bin and tokenizer.json into `out`.

    source: the text itself (a str, or its UTF-8 bytes), or a Path to a UTF-8 file.
    val_fraction: the share of the token stream held out at its end as val.bin (0: none).
    cfg: when given, input.bin must hold at least max(seq_len + 1, the prompt) tokens
      and val.bin at least seq_len + 1 (its other tables are not used: vocab_size rules).
    errors: bytes that are not UTF-8 are refused ("strict", the error says where),
      replaced by U+FFFD ("replace") or dropped ("ignore").
    progress: called as progress(stage, bytes of text done, bytes in all) as the text is
      read to train the tokenizer ("training the tokenizer"; then "learning the merges",
      with nothing to count: 0 of 0) and as it is encoded ("encoding"); each stage starts
      at 0 bytes.

    Raises DataError (a ValueError) for text or sizes that cannot make usable data;
    nothing is replaced in `out` then."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction {val_fraction}: must be at least 0 and below 1")
    if errors not in ERRORS:
        raise ValueError(f"errors {errors!r}: one of {', '.join(ERRORS)}")
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size}: 256 for bytes, or more for a byte-level BPE")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes {chunk_bytes}: must be positive")
    text = _Text(source, errors, chunk_bytes)
    if text.size == 0:
        raise DataError(f"{text.name}: empty, there is no text to prepare")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda stage, done, total: None)
    tokenizer, pieces = None, None
    if vocab_size != 256:
        tokenizer, pieces = _train(text, vocab_size, report)
    encode = _encoder(tokenizer)
    dtype = np.dtype(dtype_name(vocab_size)).newbyteorder("<")
    tmp_train, tmp_val = out / (TRAIN_FILE + ".tmp"), out / (VAL_FILE + ".tmp")
    try:
        total = 0
        report("encoding", 0, text.size)
        with open(tmp_train, "wb") as f:
            for batch in _batches(text.pieces(), BATCH_PIECES):
                for ids in encode([piece for _, piece in batch]):
                    f.write(np.asarray(ids, dtype).tobytes())
                    total += len(ids)
                report("encoding", batch[-1][0], text.size)
        n_val = int(total * val_fraction)
        n_train = total - n_val
        _check_sizes(text.name, total, n_train, n_val, val_fraction, cfg)
        if n_val:
            _split(tmp_train, tmp_val, n_train * dtype.itemsize)
            _sync_replace(tmp_val, out / VAL_FILE)
        _sync_replace(tmp_train, out / TRAIN_FILE)
    finally:
        for tmp in (tmp_train, tmp_val):
            tmp.unlink(missing_ok=True)
    if not n_val:
        (out / VAL_FILE).unlink(missing_ok=True)  # a stale one would pass for this run's
    if tokenizer is not None and pieces is not None:
        write_atomic(out / "decoding.bin", decoding_bytes(pieces))
        tmp = out / (TOKENIZER_FILE + ".tmp")
        tokenizer.save(str(tmp))
        _sync_replace(tmp, out / TOKENIZER_FILE)
        tokenizer_sha256 = file_sha256(out / TOKENIZER_FILE)
    else:
        tokenizer_sha256 = byte_vocab_sha256()
    meta = {
        "format": META_FORMAT,
        "vocab_size": vocab_size,
        "token_dtype": dtype_name(vocab_size),
        "tokenizer_sha256": tokenizer_sha256,
        "train_tokens": n_train,
        "val_tokens": n_val,
        "deggs_version": __version__,
    }
    write_meta(out, meta)
    return {**meta, "tokens": total, "text_bytes": text.size}


def _train(text: _Text, vocab_size: int, report: Callable[[str, int, int], None]):
    """The BPE tokenizer of the text and its token bytes, read in pieces."""
    failure: list[DataError] = []

    def texts() -> Iterator[str]:
        try:  # an exception must not cross the tokenizers library: kept, raised after
            report("training the tokenizer", 0, text.size)
            for done, piece in text.pieces():
                report("training the tokenizer", done, text.size)
                yield piece
            report("learning the merges", 0, 0)
        except DataError as e:
            failure.append(e)

    tokenizer = train_tokenizer(texts(), vocab_size)
    if failure:
        raise failure[0]
    pieces = token_bytes(tokenizer)
    if len(pieces) != vocab_size:
        raise DataError(
            f"the text only supports {len(pieces)} tokens, not vocab_size "
            f"{vocab_size}: give more text or a smaller vocab"
        )
    return tokenizer, pieces


def _encoder(tokenizer) -> Callable[[list[str]], list]:
    """Token ids of each of a batch of pieces: their UTF-8 bytes, or the tokenizer's."""
    if tokenizer is None:
        return lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
    encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return lambda texts: [e.ids for e in encode_batch(texts)]


def _check_sizes(
    name: str, total: int, n_train: int, n_val: int, val_fraction: float, cfg: Config | None
) -> None:
    if total == 0:
        raise DataError(f"{name}: no tokens (was every byte invalid and ignored?)")
    need_train = min_tokens(cfg) if cfg is not None else 1
    need_val = cfg.model.seq_len + 1 if cfg is not None else 1
    if val_fraction > 0 and n_val < need_val:
        raise DataError(
            f"{name}: --val-fraction {val_fraction:g} holds out {n_val} of {total} tokens, "
            f"fewer than seq_len + 1 = {need_val}: give more text or a larger fraction "
            "(0 holds out none)"
        )
    if n_train < need_train:
        held = f" once {n_val} are held out for validation" if n_val else ""
        raise DataError(
            f"{name}: {n_train} training tokens{held}, fewer than the {need_train} a "
            f"window needs (seq_len + 1, or the prompt): give more text"
            + (" or a smaller --val-fraction" if n_val else "")
        )


def _split(train: Path, val: Path, at: int) -> None:
    """Move the bytes of `train` from `at` on into `val`, a block at a time."""
    with open(train, "rb+") as src, open(val, "wb") as dst:
        src.seek(at)
        while block := src.read(CHUNK_BYTES):
            dst.write(block)
        src.truncate(at)


def encode_prompt(
    text: str, vocab_size: int, data_dir: str | Path, tokenizer_json: bytes | None = None
) -> np.ndarray:
    """Token ids of a prompt: its bytes, or the tokenizer's encoding (tokenizer_json, an
    export's copy, else tokenizer.json in data_dir)."""
    if vocab_size == 256:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    from tokenizers import Tokenizer

    if tokenizer_json is not None:
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as e:  # the library raises its own exception type
            raise DataError(f"the model file's tokenizer.json cannot be read: {e}") from None
    else:
        path = Path(data_dir) / TOKENIZER_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: deggs-prepare writes it next to input.bin "
                "(or export the model with --data-dir, and it carries it)"
            )
        tokenizer = Tokenizer.from_file(str(path))
    ids = np.array(tokenizer.encode(text).ids, np.int64)
    if len(ids) and ids.max() >= vocab_size:
        raise DataError(f"the tokenizer gives token {ids.max()}, not below vocab_size {vocab_size}")
    return ids
