"""deggs-prepare's data: the validation split, meta.json and the checks that hold the
data files to it and to the config, the refusals, and the streaming encoder."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import tiny_config

from deggs import __version__
from deggs.cli import prepare_main
from deggs.data import (
    DataError,
    byte_vocab_sha256,
    check_meta,
    load_decoding,
    load_tokens,
    read_meta,
    save_decoding,
)
from deggs.prepare import _Text, default_corpus, prepare, train_tokenizer
from deggs.runtime.worker import Worker

BYTES = tiny_config(sampling=dict(prompt_tokens=4))  # seq_len 8: windows of 9 tokens
BPE = tiny_config(model=dict(vocab_size=300), sampling=dict(prompt_tokens=4))
TEXT = default_corpus()[:20000]
# Unicode, tabs, CRLF line ends, runs of blanks: what the piece cutting must respect.
MIXED = (
    "Déjà vu — naïve café, 東京 and Zürich.\r\n\tindented\tline  with  spaces\n\n\n"
    "x = f(1, 2)  # 3.14159\n" * 40 + TEXT[:6000]
)


def stream(out, dtype):
    """input.bin + val.bin: the whole token stream."""
    out = Path(out)
    val = np.fromfile(out / "val.bin", dtype) if (out / "val.bin").exists() else []
    return np.concatenate([np.fromfile(out / "input.bin", dtype), val])


# --- the validation split ---------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.5])
def test_val_bin_is_the_end_of_the_byte_stream(tmp_path, fraction):
    info = prepare(TEXT, 256, tmp_path, val_fraction=fraction, cfg=BYTES)
    raw = TEXT.encode()
    n_val = int(len(raw) * fraction)
    assert info["val_tokens"] == n_val and info["train_tokens"] == len(raw) - n_val
    assert (tmp_path / "input.bin").read_bytes() == raw[: len(raw) - n_val]
    assert (tmp_path / "val.bin").read_bytes() == raw[len(raw) - n_val :]
    assert load_tokens(tmp_path / "val.bin", BYTES).tobytes() == raw[len(raw) - n_val :]


def test_val_bin_of_a_bpe_stream(tmp_path):
    info = prepare(TEXT, 300, tmp_path, val_fraction=0.1, cfg=BPE)
    ids = train_tokenizer(TEXT, 300).encode(TEXT).ids
    assert info["train_tokens"] + info["val_tokens"] == len(ids)
    assert info["val_tokens"] == int(len(ids) * 0.1)
    assert stream(tmp_path, "<u4").tolist() == ids
    assert len(np.fromfile(tmp_path / "val.bin", "<u4")) == info["val_tokens"]
    pieces = load_decoding(tmp_path / "decoding.bin", 300)
    assert b"".join(pieces[i] for i in stream(tmp_path, "<u4")) == TEXT.encode()


def test_val_fraction_zero_holds_out_nothing_and_drops_a_stale_val_bin(tmp_path):
    prepare(TEXT, 256, tmp_path, cfg=BYTES)
    assert (tmp_path / "val.bin").exists()
    info = prepare(TEXT, 256, tmp_path, val_fraction=0, cfg=BYTES)
    assert info["val_tokens"] == 0 and not (tmp_path / "val.bin").exists()
    assert (tmp_path / "input.bin").read_bytes() == TEXT.encode()
    assert check_meta(tmp_path, BYTES)["val_tokens"] == 0


def test_a_validation_part_shorter_than_a_window_is_refused(tmp_path):
    text = "abcdefghij" * 10  # 100 bytes: 5% is 5 tokens, a window is 9
    with pytest.raises(DataError, match=r"holds out 5 of 100 tokens, fewer than seq_len \+ 1 = 9"):
        prepare(text, 256, tmp_path, cfg=BYTES)
    with pytest.raises(DataError, match="more text or a larger fraction"):
        prepare(text, 256, tmp_path, cfg=BYTES)
    assert prepare(text, 256, tmp_path, val_fraction=0.1, cfg=BYTES)["val_tokens"] == 10
    assert prepare(text, 256, tmp_path, val_fraction=0, cfg=BYTES)["train_tokens"] == 100


def test_a_training_part_shorter_than_a_window_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"8 training tokens once 12 are held out.*smaller"):
        prepare("abcdefghij" * 2, 256, tmp_path, val_fraction=0.6, cfg=BYTES)
    cfg = tiny_config(sampling=dict(prompt_tokens=40))  # the prompt needs more than a window
    with pytest.raises(DataError, match="38 training tokens, fewer than the 40"):
        prepare("x" * 38, 256, tmp_path, val_fraction=0, cfg=cfg)


def test_a_refused_prepare_leaves_the_previous_data_alone(tmp_path):
    prepare(TEXT, 256, tmp_path, cfg=BYTES)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(DataError):
        prepare("tiny", 256, tmp_path, cfg=BYTES)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .tmp either


# --- meta.json --------------------------------------------------------------------------


def test_meta_json_of_byte_data(tmp_path):
    prepare(TEXT, 256, tmp_path, cfg=BYTES)
    meta = json.loads((tmp_path / "meta.json").read_text())
    n = len(TEXT.encode())
    assert meta == {
        "format": 1,
        "vocab_size": 256,
        "token_dtype": "uint8",
        "tokenizer_sha256": byte_vocab_sha256(),
        "train_tokens": n - int(n * 0.05),
        "val_tokens": int(n * 0.05),
        "deggs_version": __version__,
    }
    table = (256).to_bytes(4, "little") + b"".join(
        (1).to_bytes(4, "little") + bytes([b]) for b in range(256)
    )
    assert meta["tokenizer_sha256"] == hashlib.sha256(table).hexdigest()
    assert check_meta(tmp_path, BYTES) == meta == read_meta(tmp_path)


def test_meta_json_of_bpe_data(tmp_path):
    info = prepare(TEXT, 300, tmp_path, cfg=BPE)
    meta = json.loads((tmp_path / "meta.json").read_text())
    sha = hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["vocab_size"] == 300 and meta["token_dtype"] == "uint32"
    assert meta["tokenizer_sha256"] == sha
    assert (meta["train_tokens"], meta["val_tokens"]) == (info["train_tokens"], info["val_tokens"])
    assert meta["deggs_version"] == __version__
    assert (tmp_path / "input.bin").stat().st_size == 4 * meta["train_tokens"]
    assert check_meta(tmp_path, BPE) == meta
    assert not list(tmp_path.glob("*.tmp"))


def test_no_meta_json_means_no_meta_check(tmp_path):
    prepare(TEXT, 256, tmp_path, cfg=BYTES)
    (tmp_path / "meta.json").unlink()
    assert check_meta(tmp_path, BYTES) is None
    assert len(load_tokens(tmp_path / "input.bin", BYTES))


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    prepare(TEXT, 300, path, cfg=BPE)
    return path


@pytest.fixture
def bpe_copy(bpe_dir, tmp_path):
    for f in bpe_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def _grow(path: Path, n: int = 4):
    with open(path, "ab") as f:
        f.write(b"\0" * n)


@pytest.mark.parametrize(
    "spoil, cfg, message",
    [
        (None, tiny_config(model=dict(vocab_size=512)), "prepared for vocab_size 300, the config"),
        (None, BYTES, "holds uint32 tokens .* config's vocab_size 256 reads uint8"),
        (lambda d: _grow(d / "input.bin"), BPE, r"input.bin: \d+ bytes, but .*meta.json records"),
        (lambda d: _grow(d / "val.bin"), BPE, r"val.bin: \d+ bytes, but .*meta.json records"),
        (lambda d: (d / "val.bin").unlink(), BPE, r"val.bin: not found, but .*meta.json records"),
        (lambda d: (d / "input.bin").unlink(), BPE, r"input.bin: not found, but"),
        (
            lambda d: (d / "tokenizer.json").write_text("{}"),
            BPE,
            "tokenizer.json: its sha256 .* another deggs-prepare run",
        ),
        (lambda d: (d / "meta.json").write_text("{"), BPE, "meta.json: not valid JSON"),
        (lambda d: (d / "meta.json").write_text("[]"), BPE, "meta.json: not a JSON object"),
        (
            lambda d: (d / "meta.json").write_text('{"vocab_size": "300"}'),
            BPE,
            "meta.json: vocab_size is '300', not a token count",
        ),
    ],
)
def test_check_meta_refuses_data_that_does_not_match(bpe_copy, spoil, cfg, message):
    if spoil is not None:
        spoil(bpe_copy)
    with pytest.raises(DataError, match=message) as caught:
        check_meta(bpe_copy, cfg)
    assert "\n" not in str(caught.value)


def test_check_meta_refuses_a_val_bin_meta_does_not_know(tmp_path):
    prepare(TEXT, 256, tmp_path, val_fraction=0, cfg=BYTES)
    (tmp_path / "val.bin").write_bytes(b"abcdefghijkl")
    with pytest.raises(DataError, match=r"val.bin: 12 bytes, but .* records 0 tokens"):
        check_meta(tmp_path, BYTES)


def test_load_tokens_refuses_bpe_data_under_a_byte_config(bpe_dir):
    # Without meta.json these bytes would pass as a (wrong) byte stream.
    with pytest.raises(DataError, match="holds uint32 tokens .* vocab_size 256"):
        load_tokens(bpe_dir / "input.bin", BYTES)
    with pytest.raises(DataError, match="holds uint32 tokens"):
        load_tokens(bpe_dir / "val.bin", BYTES)


def make_worker(data_dir, cfg):
    lines: list[str] = []
    return Worker("127.0.0.1", 1, cfg, data_dir, backend="cpu", threads=1, log=lines.append)


def test_the_worker_refuses_data_that_does_not_match_its_meta(bpe_copy):
    worker = make_worker(bpe_copy, BPE)  # the matching config: accepted
    assert worker.training is not None and len(worker.training.pieces) == 300
    with pytest.raises(DataError, match="prepared for vocab_size 300"):
        make_worker(bpe_copy, tiny_config(model=dict(vocab_size=512)))
    with pytest.raises(DataError, match="holds uint32 tokens"):
        make_worker(bpe_copy, BYTES)
    _grow(bpe_copy / "val.bin")
    with pytest.raises(DataError, match="val.bin: .* bytes, but"):
        make_worker(bpe_copy, BPE)


def test_the_worker_refuses_a_decoding_bin_of_another_vocab(bpe_copy):
    (bpe_copy / "meta.json").unlink()
    save_decoding(bpe_copy / "decoding.bin", [b"a"] * 299)
    with pytest.raises(DataError, match="decoding.bin: 299 tokens, but vocab_size is 300"):
        make_worker(bpe_copy, BPE)


# --- refusals ---------------------------------------------------------------------------


def test_empty_text_is_refused(tmp_path):
    with pytest.raises(DataError, match="the text: empty"):
        prepare("", 256, tmp_path / "a")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt: empty"):
        prepare(tmp_path / "empty.txt", 300, tmp_path / "b")


@pytest.mark.parametrize("vocab", [256, 300])
def test_invalid_utf8_is_refused_with_its_offset(tmp_path, vocab):
    path = tmp_path / "t.txt"
    path.write_bytes(TEXT.encode()[:5000] + b"ok \xe2\x82( and \xff" + TEXT.encode()[:5000])
    with pytest.raises(DataError, match=r"t.txt: not valid UTF-8 at byte offset 5003 \(0xe2"):
        prepare(path, vocab, tmp_path / "out", chunk_bytes=700)
    assert not (tmp_path / "out" / "input.bin").exists()


def test_errors_replace_and_ignore(tmp_path):
    path = tmp_path / "t.txt"
    raw = TEXT.encode()[:3000] + b"\xff\xfe" + TEXT.encode()[:3000]
    path.write_bytes(raw)
    prepare(path, 256, tmp_path / "r", val_fraction=0, errors="replace", chunk_bytes=500)
    assert (tmp_path / "r" / "input.bin").read_bytes() == raw.decode(errors="replace").encode()
    prepare(path, 256, tmp_path / "i", val_fraction=0, errors="ignore", chunk_bytes=500)
    assert (tmp_path / "i" / "input.bin").read_bytes() == raw.replace(b"\xff\xfe", b"")
    path.write_bytes(b"\xff" * 10)
    with pytest.raises(DataError, match="no tokens"):
        prepare(path, 256, tmp_path / "n", errors="ignore")


def test_unreadable_token_files_are_one_line_errors(tmp_path):
    (tmp_path / "input.bin").mkdir()
    with pytest.raises(DataError, match="input.bin: is a directory"):
        load_tokens(tmp_path / "input.bin", BYTES)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DataError, match="input.bin: cannot be read"):
        load_tokens(tmp_path / "file" / "input.bin", BYTES)  # its "directory" is a file
    (tmp_path / "decoding.bin").mkdir()
    with pytest.raises(DataError, match="decoding.bin: cannot be read"):
        load_decoding(tmp_path / "decoding.bin")


def test_decoding_bin_must_hold_exactly_the_vocab(tmp_path):
    save_decoding(tmp_path / "d.bin", [b"a", b"b", b"c"])
    assert load_decoding(tmp_path / "d.bin", 3) == [b"a", b"b", b"c"]
    assert load_decoding(tmp_path / "d.bin") == [b"a", b"b", b"c"]  # no vocab: any count
    with pytest.raises(DataError, match="d.bin: 3 tokens, but vocab_size is 4"):
        load_decoding(tmp_path / "d.bin", 4)


# --- streaming --------------------------------------------------------------------------


def test_pieces_are_cut_where_the_bpe_would_cut_anyway(tmp_path):
    text = _Text(MIXED, "strict", 300)
    pieces = [piece for _, piece in text.pieces()]
    assert len(pieces) > 10 and "".join(pieces) == MIXED
    for a, b in zip(pieces, pieces[1:], strict=False):
        assert a[-1].isascii() and a[-1].isprintable() and not a[-1].isspace()
        assert b[0] in "\n \t"


def test_streaming_encode_equals_one_encode_of_the_whole_text(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(MIXED.encode())
    seen: list[tuple[str, int, int]] = []
    prepare(path, 300, tmp_path / "small", chunk_bytes=300, progress=lambda *at: seen.append(at))
    prepare(MIXED, 300, tmp_path / "whole", chunk_bytes=1 << 24)
    tokenizer = train_tokenizer(MIXED, 300)
    assert stream(tmp_path / "small", "<u4").tolist() == tokenizer.encode(MIXED).ids
    for name in ("input.bin", "val.bin", "decoding.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    # the stages in order, each counting the text's bytes from 0 to its size
    order = ["training the tokenizer", "learning the merges", "encoding"]
    ranks = [order.index(stage) for stage, _, _ in seen]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1, 2}
    assert ("learning the merges", 0, 0) in seen
    size = path.stat().st_size
    for stage in ("training the tokenizer", "encoding"):
        done = [d for s, d, total in seen if s == stage and total == size]
        assert len(done) == ranks.count(order.index(stage)) > 2, stage
        assert done[0] == 0 and done[-1] == size and done == sorted(done), stage


def test_a_long_run_without_whitespace_is_cut_at_a_character_boundary(tmp_path):
    text = "ab" * 500 + "é" * 700 + "\n" + "tail " * 50
    pieces = [piece for _, piece in _Text(text, "strict", 256).pieces()]
    assert len(pieces) > 4 and "".join(pieces) == text
    info = prepare(text, 256, tmp_path, val_fraction=0, chunk_bytes=256)
    assert info["train_tokens"] == len(text.encode())
    assert (tmp_path / "input.bin").read_bytes() == text.encode()  # bytes: always exact


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [b"a", b"Z", b".", b" ", b"\n", b"\t", b"\r\n", "é".encode(), "東".encode()]
            + ["😀".encode(), b"\xff", b"\xe2\x82", b"\x80"]
        ),
        max_size=60,
    ),
    st.integers(1, 12),
    st.sampled_from(["replace", "ignore"]),
)
def test_pieces_decode_like_one_decode(parts, chunk_bytes, errors):
    raw = b"".join(parts)
    done = list(_Text(raw, errors, chunk_bytes).pieces())
    assert "".join(piece for _, piece in done) == raw.decode("utf-8", errors)
    assert not done or done[-1][0] == len(raw)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:  # strict: the same offset as one decode's
        with pytest.raises(DataError, match=f"at byte offset {e.start} "):
            list(_Text(raw, "strict", chunk_bytes).pieces())
    else:
        assert "".join(piece for _, piece in _Text(raw, "strict", chunk_bytes).pieces()) == (
            raw.decode()
        )


# --- the command ------------------------------------------------------------------------


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./config.toml: the built-in defaults (seq_len 64)
    return CliRunner()


def test_cli_prepare_writes_the_split_and_meta(tmp_path, runner):
    (tmp_path / "t.txt").write_text(TEXT)
    result = runner.invoke(prepare_main, ["t.txt", "--vocab-size", "256", "--out", "d"])
    assert result.exit_code == 0, result.output
    n = len(TEXT.encode())
    assert f"{n - n // 20} training tokens (input.bin) + {n // 20} validation" in result.output
    assert stream(tmp_path / "d", np.uint8).tobytes() == TEXT.encode()
    assert read_meta(tmp_path / "d")["val_tokens"] == n // 20
    result = runner.invoke(
        prepare_main, ["t.txt", "--vocab-size", "256", "--out", "e", "--val-fraction", "0"]
    )
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "e" / "val.bin").exists()


def test_cli_prepare_takes_vocab_and_seq_len_from_the_config(tmp_path, runner):
    (tmp_path / "t.txt").write_text(TEXT[:4000])
    (tmp_path / "c.toml").write_text("[model]\nvocab_size = 300\nseq_len = 256\n")
    args = ["t.txt", "--config", "c.toml", "--out", "d"]
    result = runner.invoke(prepare_main, args)
    assert result.exit_code == 2
    assert "deggs-prepare: error: t.txt: --val-fraction 0.05 holds out" in result.output
    assert "seq_len + 1 = 257" in result.output
    result = runner.invoke(prepare_main, [*args, "--val-fraction", "0.3"])
    assert result.exit_code == 0, result.output
    assert read_meta(tmp_path / "d")["vocab_size"] == 300


@pytest.mark.parametrize(
    "content, args, message",
    [
        (b"", [], "deggs-prepare: error: t.txt: empty"),
        (b"abc \xff" * 100, [], "not valid UTF-8 at byte offset 4 (0xff"),
        (b"abc " * 100, ["--val-fraction", "1"], "Invalid value for '--val-fraction'"),
        (b"abc " * 100, ["--errors", "skip"], "Invalid value for '--errors'"),
    ],
)
def test_cli_prepare_refusals(tmp_path, runner, content, args, message):
    (tmp_path / "t.txt").write_bytes(content)
    result = runner.invoke(prepare_main, ["t.txt", "--vocab-size", "256", *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_cli_prepare_errors_replace(tmp_path, runner):
    (tmp_path / "t.txt").write_bytes(b"abc \xff\n" * 1000)
    result = runner.invoke(
        prepare_main, ["t.txt", "--vocab-size", "256", "--errors", "replace", "--out", "d"]
    )
    assert result.exit_code == 0, result.output
    assert "\ufffd".encode() in (tmp_path / "d" / "input.bin").read_bytes()
