"""Building blocks of the CPU numerics, each on a small case worked out by hand."""

import math

import numpy as np
import pytest
from tiny import tiny_config

from deggs.config import Config
from deggs.numerics.fitness import chunk_fitness
from deggs.numerics.model import (
    Perturbation,
    attention_mix,
    cdiv,
    init_params,
    make_tables,
    max_abs_normalize,
    project,
    rope,
    round_half_away,
    sequence_loss,
    standard_norm,
    trunc_i32,
    wrap32,
)
from deggs.numerics.noise import hash_np, hash_u32, noise_np, noise_table, xorshift_noise
from deggs.numerics.optimizer import matrix_votes, quantize, update_overlay, vector_votes
from deggs.numerics.params import param_shapes, parameter_table
from deggs.numerics.sampling import choose_token, scan_order
from deggs.seeds import hash_rng, next_step_seed

SMALL = tiny_config(model=dict(vocab_size=70))


def fmix32(x):
    """MurmurHash3's finaliser, which hash_rng applies to seed + idx * golden ratio."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


# --- hash and noise -----------------------------------------------------------------


def test_hash_is_fmix32_of_seed_plus_golden_ratio_multiple():
    assert hash_rng(0, 0) == 0
    assert hash_rng(1, 0) == 0x514E28B7  # fmix32(1), a published MurmurHash3 value
    assert hash_rng(0, 1) == fmix32(0x9E3779B9)
    assert hash_rng(0xFFFFFFFF, 1) == fmix32(0x9E3779B8)  # wraps at 2^32
    assert hash_rng(5, 3) == fmix32((5 + 3 * 0x9E3779B9) & 0xFFFFFFFF)


def test_hash_forms_agree():
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**32, 200, dtype=np.uint64)
    idx = rng.integers(0, 2**32, 200, dtype=np.uint64)
    by_numpy = hash_np(seeds.astype(np.uint32), idx.astype(np.uint32))
    for s, i, h in zip(seeds, idx, by_numpy, strict=True):
        assert hash_rng(int(s), int(i)) == int(h) == int(hash_u32(np.uint32(s), np.uint32(i)))


def test_step_seed_evolution():
    assert next_step_seed(42, 1) == hash_rng(42, 1)
    assert next_step_seed(2**40 + 42, 1) == hash_rng(42, 1)  # truncated to 32 bits


@pytest.mark.parametrize(
    "word, expected", [(0b1011, 5), (0b1010, -5), (0, 0), (0b11111, 15), (0b11110, -15)]
)
def test_uniform_sample_from_bits(word, expected):
    assert int(np.asarray(noise_np_word(word, False))) == expected


def test_three_sample_noise_adds_three_signed_fields():
    word = 1 | (3 << 1) | (1 << 5) | (2 << 6) | (0 << 10) | (4 << 11)
    assert int(noise_np_word(word, True)) == 3 + 2 - 4


def noise_np_word(word, three):
    from deggs.numerics.noise import samples_np

    return samples_np(np.array([word], np.uint32), 15, three)[0]


def test_noise_table_matches_broadcast_form():
    for three in (False, True):
        a = noise_table(np.array([7], np.uint32), np.arange(50, dtype=np.uint32), 15, three)[0]
        b = noise_np(np.uint32(7), np.arange(50), 15, three)
        assert np.array_equal(a, b)
        assert np.abs(a).max() <= (45 if three else 15)


# --- initialiser -----------------------------------------------------------------------


def test_xorshift_stream_by_hand():
    x = 42
    expected = []
    for _ in range(4):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        expected.append((1 if x & 1 else -1) * ((x >> 1) & 15))
    values, state = xorshift_noise(np.uint32(42), 4, 15, False)
    assert values.tolist() == expected
    assert int(state) == x


def test_init_params_layout():
    params = init_params(SMALL)
    assert {k: v.shape for k, v in params.items()} == param_shapes(SMALL)
    for name in ("ln_init", "ln_1", "ln_2", "ln_f"):
        assert (params[name] == 16).all()
    for name in ("emb_bias", "mlp_bias_up", "mlp_bias_down", "ln_f_bias", "ln_1_bias"):
        assert (params[name] == 0).all()
    stream, _ = xorshift_noise(np.uint32(42), 32 * 70 + 32 * 128, 15, False)
    assert np.array_equal(
        params["embedding"].ravel(), stream[: 32 * 70]
    )  # W[hidden, vocab] row-major
    assert np.array_equal(params["w_emb_mlp_up"].ravel(), stream[32 * 70 :])


def test_parameter_count_at_the_default_config():
    assert sum(n for _, _, n in parameter_table(Config())) == 5_778_944


# --- C arithmetic ------------------------------------------------------------------------


def test_c_arithmetic_helpers():
    assert cdiv(np.array([-7, 7, 7, -7]), np.array([2, -2, 2, -2])).tolist() == [-3, -3, 3, 3]
    assert round_half_away(np.array([2.5, -2.5, 0.49999997, 1.4999999], np.float32)).tolist() == [
        3,
        -3,
        0,
        1,
    ]
    assert trunc_i32(np.array([3e10, -3e10, np.nan, -1.7, 1.7])).tolist() == [
        2**31 - 1,
        -(2**31),
        0,
        -1,
        1,
    ]
    assert wrap32(np.array([2**31, -(2**31) - 1, 5])).tolist() == [-(2**31), 2**31 - 1, 5]


# --- tables -------------------------------------------------------------------------------


def test_tables_by_hand():
    t = make_tables(Config(), 96)
    assert t.exp[0] == 2**18
    assert t.exp[6] == round(math.exp(-1) * 2**18) == 96437
    assert t.exp[74] == 1 and t.exp[75] == 0  # values below 1 become 0
    assert t.gelu[0] == 0
    assert t.gelu[16] == 13  # GELU(1.0) = 0.841 -> 13.46 in Q.4
    assert t.gelu[256 - 16] == -3  # GELU(-1.0) = -0.159 -> -2.54, halves away from 0
    assert t.gelu[127] == 127
    assert t.rope.shape == (96, 32, 2)
    assert t.rope[0, 0].tolist() == [2**20, 0]
    assert t.rope[1, 0].tolist() == [round(math.cos(1) * 2**20), round(math.sin(1) * 2**20)]


# --- layer pieces ---------------------------------------------------------------------------


def test_max_abs_normalize_scales_the_peak_to_127():
    out = max_abs_normalize(np.array([[[-2, 1, 0, 4]]]))
    assert out.tolist() == [[[-64, 32, 0, 127]]]  # scale 31.75: -63.5 rounds away from 0
    assert max_abs_normalize(np.zeros((1, 1, 4), np.int64)).tolist() == [[[0, 0, 0, 0]]]


def test_standard_norm_without_noise():
    x = np.zeros((1, 1, 32), np.int64)
    x[0, 0, :4] = [40, -40, 8, 0]  # sum |x| = 88, mean 88 // 32 = 2
    w = np.full(32, 16, np.int8)
    b = np.full(32, 3, np.int8)
    out = standard_norm(SMALL, x, w, b)
    assert out[0, 0, :4].tolist() == [127, -127, 67, 3]  # 320 -> clipped, -320, 64 + 3, 0 + 3
    tiny = np.zeros((1, 1, 32), np.int64)
    tiny[0, 0, 0] = -5  # mean 0 becomes 1; C division truncates
    assert (
        standard_norm(SMALL, tiny, np.full(32, 3, np.int8), np.zeros(32, np.int8))[0, 0, 0] == -15
    )


def test_rope_rotates_pairs():
    t = make_tables(SMALL, 8)
    x = np.zeros((1, 2, 32), np.int64)
    x[:, :, 0] = 1000
    out = rope(SMALL, t, x, np.arange(2))
    assert out[0, 0, :2].tolist() == [1000, 0]  # position 0: identity
    assert out[0, 1, :2].tolist() == [540, 841]  # 1000 (cos 1, sin 1), rounded


def test_attention_mix_by_hand():
    t = make_tables(SMALL, 8)
    q = np.zeros((1, 2, 32), np.int64)
    k = np.zeros((1, 2, 32), np.int64)
    v = np.zeros((1, 2, 32), np.int64)
    q[0, :, 0] = 1
    k[0, 0, 0], k[0, 1, 0] = 256 * 6, 0  # scores >> 8: 6 and 0
    v[0, 0, :] = 100
    v[0, 1, :] = -50
    out = attention_mix(SMALL, t, q, k, v, np.arange(2))
    assert (out[0, 0] == 100).all()  # one visible key: its value
    w_far, w_max = 96437, 2**18  # exp index 6 for key 1, 0 for key 0
    expected = int((w_max * 100 + w_far * -50) / (w_max + w_far))
    assert (out[0, 1] == expected).all()


def test_sequence_loss_by_hand():
    t = make_tables(Config(), 8)
    lgt = np.zeros((1, 1, 4), np.int64)  # sum of exp = 4 * 2^18 = 2^20
    assert sequence_loss(Config(), t, lgt, np.array([[0]])).tolist() == [16]  # 8 * (20 - 18)
    lgt[0, 0] = [10, 0, 0, 0]  # max 10; others index 10 in the table
    total = 2**18 + 3 * int(t.exp[10])
    bucket = total.bit_length() - 1
    expected = (((bucket << 4) - (18 << 4)) >> 1) + 10 - 0
    assert sequence_loss(Config(), t, lgt, np.array([[1]])).tolist() == [expected]


def test_rank_one_projection_equals_a_brute_force_member_loop():
    rng = np.random.default_rng(1)
    cfg = SMALL.replace(adaptive_noise={"mode": 1})
    members = np.arange(4)
    pert = Perturbation(cfg, 1234, members)
    x = rng.integers(-127, 128, (4, 3, 32))
    w = rng.integers(-20, 21, (32, 16)).astype(np.int8)
    ov_in = rng.integers(-10, 100, 32).astype(np.int8)
    ov_out = rng.integers(-10, 100, 16).astype(np.int8)
    got = project(x, w, pert, 7, 8, ov_in, ov_out)
    factor = lambda ov: 0.0 if ov < 0 else (ov / 64 if ov < 64 else 1.0)
    for m in members:
        seed = 1234 + m // 2
        sign = 1 if m % 2 == 0 else -1
        a = noise_np(np.uint32(seed + 7), np.arange(16), 15, False)
        b = noise_np(np.uint32(seed + 8), np.arange(32), 15, False)
        for p in range(3):
            sb = sum(int(x[m, p, i] * b[i] * factor(ov_in[i])) for i in range(32))
            for j in range(16):
                base = int(np.dot(x[m, p], w[:, j].astype(np.int64)))
                term = (sb * int(a[j] * factor(ov_out[j])) * sign) >> 7
                assert got[m, p, j] == base + term


# --- fitness ---------------------------------------------------------------------------------


def test_fitness_signs_without_shaping():
    cfg = SMALL.replace(fitness={"chunk_mean_filter": False, "adaptive_threshold": False})
    result = chunk_fitness(cfg, np.array([10, 12, 5, 5, 7, 3]))
    assert result.fitness.tolist() == [1, 0, -1]  # loss(-) - loss(+): 2, 0, -4
    assert result.sum_loss == 42


def test_fitness_chunk_mean_filter_and_threshold():
    cfg = SMALL.replace(fitness={"adaptive_threshold": False})
    # diffs 10, 10, -1: mean 6.33, 6.33^1.2 = 9.19 -> +9 to each: 19, 19, 8
    assert chunk_fitness(cfg, np.array([0, 10, 0, 10, 1, 0])).fitness.tolist() == [1, 1, 1]
    cfg = SMALL.replace(fitness={"chunk_mean_filter": False})
    # diffs 20, 1, -3: mean |d| = 8, threshold 0.8: 1 and -3 survive, as do 20
    assert chunk_fitness(cfg, np.array([0, 20, 0, 1, 3, 0])).fitness.tolist() == [1, 1, -1]
    # diffs 20, 0, -40 with threshold 2: the tie stays 0
    assert chunk_fitness(cfg, np.array([0, 20, 5, 5, 40, 0])).fitness.tolist() == [1, 0, -1]
    # all ties: the threshold is 0 and the reference counts each tie as -1
    assert chunk_fitness(cfg, np.array([3, 3, 4, 4])).fitness.tolist() == [-1, -1]


# --- optimizer ---------------------------------------------------------------------------------


def test_quantize_steps_and_clamps():
    w, acc, changed = quantize(
        np.array([0, 0, 0, 127, -127], np.int8), np.array([1.25, -1.0, 0.5, 1.5, -2.0], np.float32)
    )
    assert w.tolist() == [1, -1, 0, 127, -127]
    assert acc.tolist() == [0.25, 0.0, 0.5, 1.0, -1.0]
    assert changed.tolist() == [True, True, False, False, False]


def test_overlay_grows_on_change_and_decays_otherwise():
    out = update_overlay(SMALL, np.array([126, -127, 10, 64], np.int8), np.array([1, 0, 0, 3]))
    assert out.tolist() == [127, -127, 9, 69]


def test_votes_equal_the_per_pair_sum():
    fitness = np.array([1, 0, -1, 1, -1, 0, 0, 1])
    seed, rows, cols = 99, np.arange(5), np.arange(7)
    votes = matrix_votes(SMALL, fitness, seed, 3, 4, rows, cols)
    vec = vector_votes(SMALL, fitness, seed, 3, 4, rows)
    expected = np.zeros((5, 7), np.int64)
    expected_vec = np.zeros(5, np.int64)
    for p, f in enumerate(fitness):
        a = noise_np(np.uint32(seed + p + 3), cols, 15, False)
        b = noise_np(np.uint32(seed + p + 4), rows, 15, False)
        expected += f * np.outer(b, a)
        expected_vec += f * noise_np(np.uint32(seed + p + 3), rows, 15, False) * b
    assert np.array_equal(votes, expected)
    assert np.array_equal(vec, expected_vec)


# --- sampling ------------------------------------------------------------------------------------


def test_scan_order_follows_threads():
    order = scan_order(SMALL)  # 32 threads, 70 tokens
    assert order[:6].tolist() == [0, 32, 64, 1, 33, 65]
    assert sorted(order.tolist()) == list(range(70))


def test_choose_token_picks_by_running_sum():
    cfg = SMALL.replace(sampling={"presence_penalty": 0.0, "temperature": 1.0, "min_p": 1.0})
    t = make_tables(cfg, 8)
    lgt = np.full(70, -1000)
    lgt[33] = 5  # with min_p = 1 only the maximum survives
    assert choose_token(cfg, t, lgt, np.array([0]), 1, 0, scan_order(cfg)) == 33
    cfg = cfg.replace(sampling={"min_p": 0.01})
    lgt = np.full(70, -1000)
    lgt[[2, 40]] = 7  # two equal weights: the hash decides which half the threshold is in
    r = hash_rng(11 + 3 * 555, 0) % (2 * 2**18)
    expected = 2 if r < 2**18 else 40  # token 2 (thread 2) scans before 40 (thread 8)
    assert choose_token(cfg, t, lgt, np.array([0]), 11, 3, scan_order(cfg)) == expected


def test_presence_penalty_counts_occurrences():
    cfg = SMALL.replace(sampling={"presence_penalty": 1.0, "temperature": 1.0, "min_p": 1.0})
    t = make_tables(cfg, 8)
    lgt = np.full(70, -1000)
    lgt[5], lgt[6] = 600, 400
    # token 5 seen twice: 600 - 2 * 256 = 88 < 400
    assert choose_token(cfg, t, lgt, np.array([5, 5]), 0, 0, scan_order(cfg)) == 6


def test_threshold_sgd_moves_weights_with_the_vote():
    from deggs.numerics.optimizer import optimizer_step

    cfg = SMALL.replace(optimizer={"kind": "sgd", "sgd_vote_scale": 0.01, "weight_decay": 0.0})
    w = np.zeros(3, np.int8)
    zeros = np.zeros(3, np.float32)
    vote = np.array([300, -300, 50])
    new_w, m, v, acc, changed = optimizer_step(cfg, w, zeros, zeros, zeros, vote, 0.5)
    # accumulator += lr * scale * vote = 1.5, -1.5, 0.25
    assert new_w.tolist() == [1, -1, 0]
    assert acc.tolist() == [0.5, -0.5, 0.25]
    assert (m == 0).all() and (v == 0).all()
