"""Making input.bin and decoding.bin from text.

Vocab 256 stores the text's UTF-8 bytes as tokens. Any other vocab size trains a
byte-level BPE tokenizer (the `tokenizers` library) on the text itself, here, with no
download; its vocabulary becomes decoding.bin and it is saved as tokenizer.json so that
prompts can be encoded later (deggs-generate).

The default corpus is the Python Language Reference and library topics that every
CPython carries for help() (the standard library's pydoc_data.topics, about 460 KB of
English prose and examples), so a fresh machine can train with nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .data import save_decoding

TOKENIZER_FILE = "tokenizer.json"


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


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes, for decoding.bin."""
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    vocab = tokenizer.get_vocab()
    pieces = [b""] * len(vocab)
    for piece, token in vocab.items():
        pieces[token] = bytes(to_byte[c] for c in piece)
    return pieces


def prepare(text: str, vocab_size: int, out: str | Path) -> dict:
    """Write input.bin (and decoding.bin, tokenizer.json for a BPE vocab) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_size == 256:
        tokens = np.frombuffer(text.encode("utf-8"), np.uint8)
        tokens.tofile(out / "input.bin")
        return {"tokens": len(tokens), "vocab_size": 256}
    if vocab_size < 256 + 1:
        raise ValueError(f"vocab_size {vocab_size}: a byte-level BPE needs more than 256 tokens")
    tokenizer = train_tokenizer(text, vocab_size)
    pieces = token_bytes(tokenizer)
    if len(pieces) != vocab_size:
        raise ValueError(
            f"the text only supports {len(pieces)} tokens, not vocab_size "
            f"{vocab_size}: give more text or a smaller vocab"
        )
    ids = np.array(tokenizer.encode(text).ids, np.uint32)
    ids.astype("<u4").tofile(out / "input.bin")
    save_decoding(out / "decoding.bin", pieces)
    tokenizer.save(str(out / TOKENIZER_FILE))
    return {"tokens": len(ids), "vocab_size": vocab_size}


def encode_prompt(text: str, vocab_size: int, data_dir: str | Path) -> np.ndarray:
    """Token ids of a prompt: its bytes, or the saved tokenizer's encoding."""
    if vocab_size == 256:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: deggs-prepare writes it next to input.bin")
    from tokenizers import Tokenizer

    return np.array(Tokenizer.from_file(str(path)).encode(text).ids, np.int64)
