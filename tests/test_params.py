"""The parameter table and everything derived from it, against the reference's layout."""

import pytest

from deggs.config import CHOICES, Config
from deggs.numerics import backend, optimizer
from deggs.numerics.params import (
    EMB_MLP,
    LAYER_MLP,
    MATRICES,
    PARAM,
    PARAMS,
    offsets,
    overlay_shapes,
    param_shapes,
    param_slices,
    parameter_table,
)

CFG = Config().replace(model=dict(hidden_dim=64, head_dim=32, n_layers=2, vocab_size=300))


def test_seed_offsets_are_the_references():
    # include/config.h: SEED_OFF_EMB 0 (its input noise at + HIDDEN_DIM), per-layer + 1000 l
    assert offsets(CFG, "embedding") == (0, 64)
    assert offsets(CFG, "emb_bias") == (50, 51)
    assert offsets(CFG, "w_q", 1) == (1200, 1201)
    assert offsets(CFG, "w_down", 0) == (402, 403)
    assert offsets(CFG, "mlp_bias_down", 1) == (1412, 1413)
    assert offsets(CFG, "w_emb_mlp_down") == (512, 513)
    assert offsets(CFG, "ln_f_bias") == (910, 911)


def test_offsets_refuse_a_wrong_layer():
    with pytest.raises(ValueError, match="per-layer"):
        offsets(CFG, "w_q")
    with pytest.raises(ValueError, match="not a per-layer"):
        offsets(CFG, "ln_f", 0)


def test_derived_shapes():
    shapes = param_shapes(CFG)
    assert list(shapes)[:3] == ["embedding", "emb_bias", "ln_init"]
    assert shapes["embedding"] == (64, 300)  # W[hidden, vocab]: tied head
    assert shapes["w_up"] == (2, 64, 256) and shapes["w_down"] == (2, 256, 64)
    ov = overlay_shapes(CFG)
    assert ov["embedding_row"] == (300,) and ov["embedding_col"] == (64,)
    assert ov["w_up_row"] == (2, 64) and ov["w_up_col"] == (2, 256)
    assert ov["mlp_bias_up"] == (2, 256)
    assert len(ov) == sum(len(p.overlays) for p in PARAMS) == 31


def test_slices_run_in_the_reference_order():
    names = [(s.name, s.layer) for s in param_slices(CFG)]
    assert names[:8] == [(p.name, None) for p in PARAMS[:8]]
    assert names[8:10] == [("ln_1", 0), ("ln_1_bias", 0)]
    assert names[20:22] == [("ln_1", 1), ("ln_1_bias", 1)]
    assert names[-2:] == [("ln_f", None), ("ln_f_bias", None)]
    assert len(names) == 8 + 12 * 2 + 2
    s = next(s for s in param_slices(CFG) if s.name == "w_o" and s.layer == 1)
    assert (s.shape, s.off_a, s.off_b, s.index) == ((64, 64), 1206, 1207, (1,))


def test_matrices_and_mlps_name_table_rows():
    assert MATRICES == (
        "embedding",
        "w_emb_mlp_up",
        "w_emb_mlp_down",
        "w_q",
        "w_k",
        "w_v",
        "w_o",
        "w_up",
        "w_down",
    )
    for mlp in (EMB_MLP, LAYER_MLP):
        assert PARAM[mlp.up].is_matrix and PARAM[mlp.down].is_matrix
        assert not any(
            PARAM[n].is_matrix for n in (mlp.ln, mlp.ln_bias, mlp.bias_up, mlp.bias_down)
        )
    assert all(PARAM[n].per_layer for n in vars(LAYER_MLP).values())
    assert not any(PARAM[n].per_layer for n in vars(EMB_MLP).values())


def test_print_arch_rows():
    rows = parameter_table(Config())
    assert rows[0] == ("Embedding", "[8192, 256]", 8192 * 256)  # the reference's [vocab, hidden]
    assert rows[8] == ("  LN 1 (x4)", "[256]", 4 * 256)
    assert rows[-1] == ("LN Final Bias", "[256]", 256)


def test_config_choices_follow_the_implementations():
    assert CHOICES[("optimizer", "kind")] == tuple(optimizer.OPTIMIZERS)
    assert set(backend.NAMES) == {"auto", *backend.BACKENDS}


def test_macs_per_token_by_hand():
    """The default: q, k, v, o (4 d^2) and the MLP (8 d^2) in each of 4 layers, the
    embedding's MLP (8 d^2), the head (d v), and causal attention's d (seq + 1) a layer."""
    from deggs.numerics.params import macs_per_token

    d, v, layers, seq = 256, 8192, 4, 64
    expected = layers * 12 * d * d + 8 * d * d + d * v + layers * d * (seq + 1)
    assert macs_per_token(Config()) == expected == 5_833_728
