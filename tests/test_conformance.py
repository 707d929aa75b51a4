"""scripts/conformance.py against the reference's golden vectors (skipped without them)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT.parent / "shared" / "golden"

spec = importlib.util.spec_from_file_location("conformance", ROOT / "scripts" / "conformance.py")
conformance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conformance)

needs_golden = pytest.mark.skipif(not (GOLDEN / "tiny_bytes.npz").exists(),
                                  reason="golden vectors not found beside the repository")


@needs_golden
@pytest.mark.parametrize("name", ["tiny_bytes", "tiny_tok", "tiny_variant"])
def test_tiny_configs_are_bit_exact_for_every_step(name, capsys):
    decoding = GOLDEN / f"{name}.decoding.bin"
    ok = conformance.run(GOLDEN / f"{name}.npz", decoding if decoding.exists() else None)
    out = capsys.readouterr().out
    assert ok, out
    assert out.count("step ") == 8 and "MISMATCH" not in out
    assert out.count("generation ok") == 2 and out.count("adam ok") == 2


@needs_golden
def test_default_config_slice():
    ok = conformance.run(GOLDEN / "default.npz", GOLDEN / "default.decoding.bin",
                         members=1, update_slice=8)
    assert ok


@needs_golden
def test_a_corrupted_golden_file_fails(tmp_path, capsys):
    import numpy as np
    golden = dict(np.load(GOLDEN / "tiny_tok.npz"))
    golden["step0/losses"] = golden["step0/losses"].copy()
    golden["step0/losses"][3] += 1
    golden["after1/model/ln_f"] = golden["after1/model/ln_f"].copy()
    golden["after1/model/ln_f"][0] += 1
    np.savez(tmp_path / "bad.npz", **golden)
    assert not conformance.run(tmp_path / "bad.npz", steps=1, input_path=GOLDEN / "tiny_tok.input.bin")
    out = capsys.readouterr().out
    assert "losses MISMATCH 255/256 exact" in out and "weights MISMATCH ln_f" in out
