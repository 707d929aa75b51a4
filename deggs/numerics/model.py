"""The int8 transformer: parameters, lookup tables and the forward pass.

Everything here is integer arithmetic, written to reproduce the d-eggs reference bit for
bit. Activations are int8 ("Q.4" fixed point), weights are int8, sums are int32. Each
population member sees the weights plus its own low-rank perturbation: for a matrix W it
is sigma * a b^T (a over outputs, b over inputs), for a vector an elementwise product of
two noise vectors. The perturbation of a matrix is never materialised; instead

    x @ (W + a b^T) = x @ W + (x . b) a

so all members share one integer matrix product and add a rank-1 correction.

Arrays are laid out [member, position, feature]. Matrices are stored logically as
W[in, out]. Integer products go through float BLAS, which is exact because every partial
sum stays below 2^24 (float32) or 2^53 (float64).

The places where C semantics differ from NumPy's are spelled out by small helpers:
`trunc_i32` (float to int casts truncate and saturate), `cdiv` (division truncates toward
zero), `round_half_away` (roundf) and `wrap32` (int32 sums wrap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import Config
from ..seeds import member_sign, pair_seed
from .noise import hash_np, noise_np, noise_table, xorshift_noise
from .params import (
    EMB_MLP,
    GATE_SEED,
    LAYER_MLP,
    PARAM,
    Mlp,
    offsets,
    overlay_shapes,
    param_shapes,
    param_slices,
)

MAX_VAL = 127


# --- parameters --------------------------------------------------------------------


def init_params(cfg: Config) -> dict[str, np.ndarray]:
    """The initial weights: matrices drawn from one xorshift32 stream in the reference's
    order (params.param_slices), the rest filled with their table's constant."""
    params = {name: np.zeros(shape, np.int8) for name, shape in param_shapes(cfg).items()}
    state = np.uint32(cfg.training.init_seed)
    three = cfg.noise.init_distribution == "three_sample"
    for s in param_slices(cfg):
        target = params[s.name][s.index]
        if s.param.fill is None:
            values, state = xorshift_noise(state, target.size, cfg.noise.init_mask, three)
            target[...] = values.reshape(target.shape)
        else:
            target[...] = s.param.fill
    return params


def init_overlays(cfg: Config) -> dict[str, np.ndarray]:
    return {
        name: np.full(shape, cfg.adaptive_noise.init, np.int8)
        for name, shape in overlay_shapes(cfg).items()
    }


# --- lookup tables -------------------------------------------------------------------


@dataclass(frozen=True)
class Tables:
    exp: np.ndarray  # int64 [lut_size]: exp(-i / exp_scale) * 2^scale_bit, rounded
    gelu: np.ndarray  # int64 [256]: GELU of each int8 in Q.fixed_point, by uint8 index
    rope: np.ndarray  # int64 [positions, head_dim // 2, 2]: cos, sin * 2^rope_scale_bit


def c_round(x: float) -> int:
    """C's round(): halves away from zero."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def rope_positions(cfg: Config) -> int:
    """Positions a RoPE table must cover: training windows and generations."""
    return max(cfg.model.seq_len, cfg.sampling.prompt_tokens + cfg.sampling.generate_tokens)


def make_tables(cfg: Config, positions: int | None = None) -> Tables:
    """The integer lookup tables, RoPE for `positions` positions (default: rope_positions).

    The reference's RoPE table covers seq_len positions only and its generation reads
    past the end of it; we size it for every position we use.
    """
    positions = rope_positions(cfg) if positions is None else positions
    sm = cfg.softmax
    exp = [
        c_round(v) if (v := math.exp(-i / sm.exp_scale) * (1 << sm.scale_bit)) >= 1.0 else 0
        for i in range(sm.lut_size)
    ]
    fp = cfg.quantization.fixed_point
    gelu = []
    for i in range(256):
        x = (i - 256 if i >= 128 else i) / (1 << fp)
        y = 0.5 * x * (1.0 + math.erf(x / 1.41421356))
        gelu.append(max(-MAX_VAL, min(MAX_VAL, c_round(y * (1 << fp)))))
    hd = cfg.model.head_dim
    scale = 1 << cfg.rope.scale_bit
    rope = np.zeros((positions, hd // 2, 2), np.int64)
    for t in range(positions):
        for i in range(hd // 2):
            alpha = t * math.pow(10000.0, -2.0 * i / hd)
            rope[t, i] = c_round(math.cos(alpha) * scale), c_round(math.sin(alpha) * scale)
    return Tables(np.array(exp, np.int64), np.array(gelu, np.int64), rope)


# --- C arithmetic on NumPy arrays ----------------------------------------------------


def wrap32(x):
    """int32 wraparound of an int64 array (CUDA integer adds and multiplies wrap)."""
    return np.asarray(x, np.int64).astype(np.int32).astype(np.int64)


def trunc_i32(x):
    """float -> int32 cast as the GPU does it: truncate, saturate, NaN -> 0."""
    x = np.asarray(x, np.float64)
    return np.nan_to_num(np.clip(np.trunc(x), -(2**31), 2**31 - 1)).astype(np.int64)


def cdiv(a, b):
    """C integer division (truncates toward zero)."""
    a = np.asarray(a, np.int64)
    b = np.asarray(b, np.int64)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q)


def round_half_away(x):
    """roundf: float32 to nearest integer, halves away from zero (exact in float64)."""
    x = np.asarray(x, np.float64)
    return np.copysign(np.floor(np.abs(x) + 0.5), x)


def clip8(x):
    return np.clip(x, -MAX_VAL, MAX_VAL)


def f32(x):
    return np.asarray(x, np.float32)


def fma32(a, b, c):
    """float32 fused multiply-add a * b + c with one rounding, as nvcc emits it.

    The float32 product is exact in float64, and so is the float64 sum's rounding error
    (TwoSum). Casting the float64 sum to float32 rounds a second time, which differs from
    one rounding only where the sum landed exactly halfway between two float32 values:
    there the error's sign says on which side the exact value lies.
    """
    x = np.asarray(a, np.float32).astype(np.float64) * np.asarray(b, np.float32).astype(np.float64)
    y = np.asarray(c, np.float32).astype(np.float64)
    s = x + y
    back = s - x
    err = (x - (s - back)) + (y - back)
    exponent = np.frexp(s)[1]  # s = m 2^exponent, 0.5 <= |m| < 1
    half_ulp = np.ldexp(1.0, np.maximum(exponent - 25, -150))  # float32's, subnormals too
    q = np.abs(s) / half_ulp
    tie = (err != 0) & (q == np.floor(q)) & (np.fmod(q, 2) == 1)
    s = np.where(tie, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def int_matmul(x, w):
    """Exact integer x @ w for int8-range operands, through float BLAS."""
    k = w.shape[-2]
    dtype = np.float32 if k * 128 * 128 <= 2**24 else np.float64
    return np.matmul(x.astype(dtype), w.astype(dtype)).astype(np.int64)


# --- per-member perturbations ----------------------------------------------------------


class Perturbation:
    """The noise of a set of population members: one seed and one sign per member.

    Members 2i and 2i+1 of a pair share the pair's seed (deggs.seeds.pair_seed) and carry
    +noise and -noise. Every method returns arrays whose first
    axis is the member.
    """

    def __init__(self, cfg: Config, step_seed: int, members: np.ndarray):
        self.cfg = cfg
        members = np.asarray(members, np.int64)
        self.seeds = pair_seed(step_seed, members // 2).astype(np.uint32)
        self.signs = member_sign(members)
        self.mask = cfg.noise.perturb_mask
        self.three = cfg.noise.perturb_distribution == "three_sample"
        q = cfg.quantization
        self.matrix_shift = q.fixed_point + q.sigma_shift
        self.vector_shift = q.sigma_shift_vector

    def seed(self, offset: int):
        return (self.seeds + np.uint32(offset & 0xFFFFFFFF))[:, None]

    def noise(self, offset: int, idx):
        """noise_from_hash(seed + offset, idx) per member; idx is [n] or [member, n]."""
        idx = np.asarray(idx)
        if idx.ndim == 1:  # the same indices for every member: the numba table
            return noise_table(
                self.seed(offset)[:, 0], idx.astype(np.uint32), self.mask, self.three
            )
        return noise_np(self.seed(offset), idx, self.mask, self.three)

    def factor(self, overlay, offset: int, idx):
        """get_adaptive_factor: how much of the noise at idx a member uses (float32).

        idx is [n] or [member, n]; the result is [1 or member, n].
        """
        mode = self.cfg.adaptive_noise.mode
        idx = np.asarray(idx)
        ov = np.asarray(overlay)[idx].astype(np.float32)
        if ov.ndim == 1:
            ov = ov[None, :]
        if mode == 0:
            return np.ones_like(ov)
        if mode == 1:
            return np.where(
                ov < 0, np.float32(0), np.where(ov < 64, ov / np.float32(64), np.float32(1))
            ).astype(np.float32)
        # mode 2, heavy-tailed: scale / sqrt(u) with u uniform in (0, 1] from the gate hash
        scale = (ov + np.float32(127)) / np.float32(255)
        r = hash_np(self.seed(offset + GATE_SEED), idx).astype(np.float32)
        u = (r + np.float32(1)) / np.float32(4294967296.0)
        return scale / np.sqrt(u)

    def scaled(self, values, factor):
        """(int)(values * factor): int product to float32, times the factor, truncated."""
        return trunc_i32(f32(values) * factor)

    def vector(self, overlay, off_a: int, off_b: int, n: int):
        """Rank-1 noise of a vector parameter: (n_a * n_b * factor * sign) >> shift."""
        idx = np.arange(n)
        prod = self.noise(off_a, idx) * self.noise(off_b, idx)
        scaled = self.scaled(prod, self.factor(overlay, off_a, idx))
        return (scaled * self.signs[:, None]) >> self.vector_shift

    def input_dot(self, x, off_b: int, overlay_in):
        """sb = sum_i (int)(x_i * b_i * factor_i): the input side of the rank-1 term."""
        idx = np.arange(x.shape[-1])
        b = self.noise(off_b, idx)[:, None, :]
        s = self.factor(overlay_in, off_b, idx)[:, None, :]
        return wrap32(self.scaled(x * b, s).sum(-1))

    def input_dot_by_threads(self, x, off_b: int, overlay_in):
        """input_dot as the reference's down-projection sums it, thread by thread.

        Thread j of hidden_dim adds inputs j, j+d, j+2d, j+3d into an int32 through
        float32, truncating after every addition: pb = (int)((float)pb + x * b * factor),
        the multiply-add fused (fmaf) as nvcc emits it. (The golden vectors agree with the
        unfused form too; tests/test_blocks.py holds us to the fused one.) The partial
        sums then add as integers.
        """
        d = x.shape[-1] // 4
        idx = np.arange(4 * d)
        terms = f32(x * self.noise(off_b, idx)[:, None, :])
        factor = self.factor(overlay_in, off_b, idx)[:, None, :]
        partial = np.zeros(x.shape[:2] + (d,), np.int64)
        for sub in range(4):
            cols = slice(sub * d, (sub + 1) * d)
            partial = trunc_i32(fma32(terms[..., cols], factor[..., cols], f32(partial)))
        return wrap32(partial.sum(-1))

    def output_term(self, sb, off_a: int, overlay_out, n: int):
        """((sb * (int)(a_j * factor_j)) * sign) >> shift, per member, position and output."""
        idx = np.arange(n)
        av = self.scaled(self.noise(off_a, idx), self.factor(overlay_out, off_a, idx))
        term = wrap32(wrap32(sb[:, :, None] * av[:, None, :]) * self.signs[:, None, None])
        return term >> self.matrix_shift


def project(
    x, w, pert: Perturbation | None, off_a: int, off_b: int, ov_in, ov_out, by_threads: bool = False
):
    """x @ (W + perturbation) for x [member, position, in], W [in, out]."""
    out = int_matmul(x, w)
    if pert is not None:
        dot = pert.input_dot_by_threads if by_threads else pert.input_dot
        sb = dot(x, off_b, ov_in)
        out = wrap32(out + pert.output_term(sb, off_a, ov_out, w.shape[1]))
    return out


class Weights:
    """The parameters as a set of members sees them, looked up by their table names.

    `layer` picks one layer's copy of the per-layer parameters; the noise offsets come
    from deggs.numerics.params. With pert None the weights are unperturbed.
    """

    def __init__(self, cfg: Config, params, overlays, pert: Perturbation | None, layer=None):
        self.cfg, self.params, self.overlays = cfg, params, overlays
        self.pert, self.layer = pert, layer

    def at(self, layer: int) -> Weights:
        return Weights(self.cfg, self.params, self.overlays, self.pert, layer)

    def arrays(self, name: str):
        """The parameter `name` (this layer's copy) and its overlays (in, out for a matrix)."""
        per_layer = PARAM[name].per_layer
        if per_layer and self.layer is None:
            raise ValueError(f"{name} is a per-layer parameter: take Weights.at(layer)")
        pick = (lambda a: a[self.layer]) if per_layer else (lambda a: a)
        return pick(self.params[name]), [pick(self.overlays[o]) for o in PARAM[name].overlays]

    def _offsets(self, name: str) -> tuple[int, int]:
        return offsets(self.cfg, name, self.layer if PARAM[name].per_layer else None)

    def vector(self, name: str):
        """A vector parameter plus each member's rank-1 noise: int64 [member or 1, 1, n]."""
        v, (overlay,) = self.arrays(name)
        v = v.astype(np.int64)[None, None, :]
        if self.pert is None:
            return v
        off_a, off_b = self._offsets(name)
        return v + self.pert.vector(overlay, off_a, off_b, v.shape[-1])[:, None, :]

    def project(self, x, name: str, by_threads: bool = False):
        """x @ (W + each member's rank-1 noise) for the matrix `name`."""
        w, (ov_in, ov_out) = self.arrays(name)
        return project(x, w, self.pert, *self._offsets(name), ov_in, ov_out, by_threads)


# --- the layers ------------------------------------------------------------------------


def standard_norm(cfg, x, w, b):
    """x * w / mean|x| + b, for weights w and biases b as the members see them."""
    mean = np.abs(x).sum(-1, keepdims=True) // cfg.model.hidden_dim
    mean = np.where(mean == 0, 1, mean)
    return clip8(cdiv(x * w, mean) + b)


def norm(cfg, weights: Weights, x, weight: str, bias: str):
    """The standard norm with the named weight and bias, as the members see them."""
    return standard_norm(cfg, x, weights.vector(weight), weights.vector(bias))


def max_abs_normalize(x):
    """Scale a whole hidden vector so its largest magnitude becomes 127 (float32 math)."""
    peak = np.abs(x).max(-1, keepdims=True)
    scale = np.float32(127.0) / (f32(peak) + np.float32(1e-9))
    return clip8(round_half_away(f32(x) * scale)).astype(np.int64)


def rope(cfg, tables, x, positions):
    """Integer rotary embedding of each head's feature pairs (x [member, position, hidden])."""
    m, t, d = x.shape
    hd = cfg.model.head_dim
    shift = cfg.rope.scale_bit
    pairs = x.reshape(m, t, d // hd, hd // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cs = tables.rope[positions][None, :, None, :, :]  # [1, t, 1, hd/2, 2]
    cos, sin = cs[..., 0], cs[..., 1]
    half = 1 << (shift - 1)
    new_even = (even * cos - odd * sin + half) >> shift
    new_odd = (even * sin + odd * cos + half) >> shift
    return wrap32(np.stack([new_even, new_odd], -1).reshape(m, t, d))


def attention_mix(cfg, tables, q, k_cache, v_cache, positions):
    """Causal integer softmax attention of queries at `positions` over the cached keys.

    Per head: scores q.k, their max over visible keys, weights from the exp table indexed
    by (max >> shift_attn) - (score >> shift_attn), then sum(w * v) / sum(w), truncated.
    """
    m, t, d = q.shape
    hd, h = cfg.model.head_dim, cfg.model.n_heads
    n_keys = positions[-1] + 1
    qh = q.reshape(m, t, h, hd).transpose(0, 2, 1, 3)
    kh = k_cache[:, :n_keys].reshape(m, n_keys, h, hd).transpose(0, 2, 3, 1)
    vh = v_cache[:, :n_keys].reshape(m, n_keys, h, hd).transpose(0, 2, 1, 3)
    scores = int_matmul(qh, kh)  # [m, h, t, keys]
    visible = np.arange(n_keys)[None, :] <= np.asarray(positions)[:, None]  # [t, keys]
    peak = np.where(visible, scores, np.iinfo(np.int64).min).max(-1, keepdims=True)
    sa = cfg.quantization.shift_attn
    index = np.clip((peak >> sa) - (scores >> sa), 0, cfg.softmax.lut_size - 1)
    weights = np.where(visible, tables.exp[index], 0)
    total = weights.sum(-1, keepdims=True)
    mixed = np.matmul(weights.astype(np.float64), vh.astype(np.float64)).astype(np.int64)
    out = clip8(cdiv(mixed, np.where(total == 0, 1, total)))
    return out.transpose(0, 2, 1, 3).reshape(m, t, d)


@dataclass
class KVCache:
    """Normalised keys and values of every layer, [layer][member, position, hidden]."""

    k: list
    v: list

    @classmethod
    def empty(cls, cfg: Config, members: int, positions: int):
        shape = (members, positions, cfg.model.hidden_dim)
        n = cfg.model.n_layers
        return cls(
            [np.zeros(shape, np.int64) for _ in range(n)],
            [np.zeros(shape, np.int64) for _ in range(n)],
        )


def attention_block(cfg, tables, weights: Weights, x, cache: KVCache, positions):
    """Norm, q/k/v projections with RoPE, attention over the cache, output projection."""
    layer = weights.layer
    normed = norm(cfg, weights, x, "ln_1", "ln_1_bias")
    q, k, v = (weights.project(normed, name) for name in ("w_q", "w_k", "w_v"))
    q = max_abs_normalize(rope(cfg, tables, q, positions))
    cache.k[layer][:, positions] = max_abs_normalize(rope(cfg, tables, k, positions))
    cache.v[layer][:, positions] = max_abs_normalize(v)
    mixed = attention_mix(cfg, tables, q, cache.k[layer], cache.v[layer], positions)
    out = weights.project(mixed, "w_o")
    return max_abs_normalize(x + (out >> cfg.quantization.shift_out))


def mlp_block(cfg, tables, weights: Weights, x, names: Mlp):
    """Norm, up-projection, GELU table, down-projection, residual, max-abs normalisation."""
    q = cfg.quantization
    normed = norm(cfg, weights, x, names.ln, names.ln_bias)
    up = weights.project(normed, names.up)
    pre = (up >> q.shift_mlp_up) + weights.vector(names.bias_up)
    hidden = tables.gelu[clip8(pre) & 0xFF]
    out = weights.project(hidden, names.down, by_threads=True)  # summed as the reference does
    res = x + (out >> q.shift_mlp_down) + weights.vector(names.bias_down)
    return max_abs_normalize(res)


def embed(cfg, weights: Weights, tokens):
    """Token embeddings plus embedding bias, each with its perturbation."""
    pert = weights.pert
    table, (ov_in, ov_out) = weights.arrays("embedding")  # [hidden, vocab]
    x = table.T[tokens].astype(np.int64) + weights.vector("emb_bias")
    if pert is not None:
        out_seed, in_seed = offsets(cfg, "embedding")  # over the vocabulary, the hidden dims
        a_tok = pert.noise(out_seed, tokens)  # [m, t]
        s_row = pert.factor(ov_out, out_seed, tokens)
        idx = np.arange(cfg.model.hidden_dim)
        b_dim = pert.noise(in_seed, idx)  # [m, d]
        s_col = pert.factor(ov_in, in_seed, idx)[:, None, :]
        prod = f32(f32(a_tok[:, :, None] * b_dim[:, None, :]) * s_row[..., None]) * s_col
        x = x + ((trunc_i32(prod) * pert.signs[:, None, None]) >> pert.matrix_shift)
    return clip8(x)


def logits(cfg, weights: Weights, normed):
    """The tied head: normed @ embedding (+ its rank-1 noise), >> shift_logit."""
    return weights.project(normed, "embedding") >> cfg.quantization.shift_logit


def forward(cfg, tables, weights: Weights, tokens, cache, positions):
    """Hidden states after the final norm for `tokens` [member, position] at `positions`."""
    x = embed(cfg, weights, tokens)
    x = mlp_block(cfg, tables, weights, x, EMB_MLP)
    for layer in range(cfg.model.n_layers):
        x = attention_block(cfg, tables, weights.at(layer), x, cache, positions)
        x = mlp_block(cfg, tables, weights.at(layer), x, LAYER_MLP)
    return norm(cfg, weights, x, "ln_f", "ln_f_bias")


def sequence_loss(cfg, tables, lgt, targets):
    """Integer cross-entropy summed over positions: log2-bucketed log-sum-exp - target."""
    peak = lgt.max(-1)
    index = np.clip(peak[..., None] - lgt, 0, cfg.softmax.lut_size - 1)
    total = tables.exp[index].sum(-1)
    # floor(log2(total)), exact: frexp gives total = mantissa * 2^exponent, mantissa in [0.5, 1)
    log2 = np.frexp(total.astype(np.float64))[1].astype(np.int64) - 1
    positive = total > 0
    sb = cfg.softmax.scale_bit
    log_sum = np.where(positive, (log2 << 4) - (sb << 4), 0)
    target = np.take_along_axis(lgt, targets[..., None], -1)[..., 0]
    per_position = (log_sum >> 1) + peak - target
    return per_position.sum(-1).astype(np.int32)


def member_losses(
    cfg: Config, tables: Tables, params, overlays, data, step: int, step_seed: int, members
) -> np.ndarray:
    """Loss (int32) of each listed population member at a step."""
    members = np.asarray(members, np.int64)
    tokens = member_tokens(cfg, data, step, members)
    weights = Weights(cfg, params, overlays, Perturbation(cfg, step_seed, members))
    t = cfg.model.seq_len
    cache = KVCache.empty(cfg, len(members), t)
    normed = forward(cfg, tables, weights, tokens[:, :t], cache, np.arange(t))
    lgt = logits(cfg, weights, normed)
    return sequence_loss(cfg, tables, lgt, tokens[:, 1:])


def window_starts(cfg: Config, n_tokens: int, step: int, members) -> np.ndarray:
    """Where each member's window of seq_len + 1 tokens starts in a stream of n_tokens:
    its pair's window (both members of a pair read the same tokens)."""
    t = cfg.model.seq_len
    pairs = np.asarray(members, np.int64) // 2
    start = step * t
    if cfg.training.same_data:
        return np.full(len(pairs), start % (n_tokens - t), np.int64)
    stride = n_tokens // cfg.training.n_pairs
    return (start + pairs * stride) % (n_tokens - t)


def member_tokens(cfg: Config, data: np.ndarray, step: int, members) -> np.ndarray:
    """The seq_len + 1 tokens each member reads from the data stream."""
    pos = window_starts(cfg, len(data), step, members)
    return data[pos[:, None] + np.arange(cfg.model.seq_len + 1)[None, :]].astype(np.int64)
