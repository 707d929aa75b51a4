"""scripts/conformance.py against the reference's golden vectors.

The golden files come from conftest.py's golden_path: $DEGGS_GOLDEN (the complete ones in
../shared/golden, say), else the trimmed copies in tests/golden (which keep the weights
after updates 1, 4 and 8 and the optimizer state after update 4 only).
"""

import numpy as np
import pytest

import golden as goldens  # scripts/golden.py (conftest.py puts scripts/ on sys.path)

TINY = ["tiny_bytes", "tiny_tok", "tiny_variant"]


def after_steps(path, part):
    """The updates after which a golden file holds `part` (model/embedding, adam_m/...)."""
    with np.load(path) as golden:
        return {
            k.split("/")[0]
            for k in golden.files
            if k.startswith("after") and k.endswith(f"/{part}/embedding")
        }


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_are_bit_exact_for_every_step(
    name, golden_path, golden_decoding, conformance, capsys
):
    path = golden_path(name)
    ok = conformance.run(path, golden_decoding(path))
    out = capsys.readouterr().out
    assert ok, out
    assert out.count("step ") == 8 and "MISMATCH" not in out
    assert out.count("init ok") == 1 and out.count("generation ok") == 2
    # every kept after-state is checked: 3 and 1 in the trimmed copies, 8 and 2 in the full
    assert out.count("weights ok") == len(after_steps(path, "model")), out
    assert out.count("adam ok") == len(after_steps(path, "adam_m")), out


@pytest.mark.parametrize("name", TINY)
def test_vendored_copies_keep_what_conformance_checks(name):
    """The trimmed copies in the repository (whatever golden_path prefers)."""
    with np.load(goldens.VENDORED / f"{name}.npz") as golden:
        assert goldens.golden_steps(golden) == list(range(8))
        assert "input" in golden.files and "model_init/embedding" in golden.files
    assert after_steps(goldens.VENDORED / f"{name}.npz", "model") == {"after1", "after4", "after8"}
    assert after_steps(goldens.VENDORED / f"{name}.npz", "adam_m") == {"after4"}


def test_default_config_slice(golden_path, golden_decoding, conformance, capsys):
    path = golden_path("default")
    ok = conformance.run(path, golden_decoding(path), members=1, update_slice=8)
    out = capsys.readouterr().out
    assert ok, out
    assert "losses ok 8/8" in out and "slice weights ok" in out and "MISMATCH" not in out


def test_a_corrupted_golden_file_fails(tmp_path, golden_path, conformance, capsys):
    path = golden_path("tiny_tok")
    with np.load(path) as original:
        golden = dict(original)
        # the copy carries its token stream (the trimmed file has it inside already)
        golden["input"] = goldens.tokens(original, path, goldens.golden_config(original))
    golden["step0/losses"] = golden["step0/losses"].copy()
    golden["step0/losses"][3] += 1
    golden["after1/model/ln_f"] = golden["after1/model/ln_f"].copy()
    golden["after1/model/ln_f"][0] += 1
    np.savez(tmp_path / "bad.npz", **golden)
    assert not conformance.run(tmp_path / "bad.npz", steps=1)
    out = capsys.readouterr().out
    assert "losses MISMATCH 255/256 exact" in out and "weights MISMATCH ln_f" in out
