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
from .noise import hash_np, noise_np, noise_table, xorshift_noise

MAX_VAL = 127

# Offsets added to a member's seed to get each noise vector's seed (include/config.h).
# Per-layer offsets also get layer * 1000.
SEED = dict(
    emb=0, emb_bias_a=50, emb_bias_b=51,
    ln_1_a=100, ln_1_b=101, ln_1_bias_a=110, ln_1_bias_b=111,
    q_a=200, q_b=201, k_a=202, k_b=203, v_a=204, v_b=205, o_a=206, o_b=207,
    ln_2_a=300, ln_2_b=301, ln_2_bias_a=310, ln_2_bias_b=311,
    mlp_up_a=400, mlp_up_b=401, mlp_down_a=402, mlp_down_b=403,
    mlp_bias_up_a=410, mlp_bias_up_b=411, mlp_bias_down_a=412, mlp_bias_down_b=413,
    ln_init_a=500, ln_init_b=501, ln_init_bias_a=502, ln_init_bias_b=503,
    emb_mlp_up_a=510, emb_mlp_up_b=511, emb_mlp_down_a=512, emb_mlp_down_b=513,
    emb_mlp_bias_up_a=514, emb_mlp_bias_up_b=515,
    emb_mlp_bias_down_a=516, emb_mlp_bias_down_b=517,
    ln_f_a=900, ln_f_b=901, ln_f_bias_a=910, ln_f_bias_b=911,
    gate=100000,
)
LAYER_SEED_STRIDE = 1000


# --- parameters --------------------------------------------------------------------

def param_shapes(cfg: Config) -> dict[str, tuple]:
    """Every int8 parameter, in the reference's order, with its logical shape."""
    d, v, n = cfg.model.hidden_dim, cfg.model.vocab_size, cfg.model.n_layers
    return {
        "embedding": (d, v), "emb_bias": (d,),
        "ln_init": (d,), "ln_init_bias": (d,),
        "w_emb_mlp_up": (d, 4 * d), "mlp_emb_bias_up": (4 * d,),
        "w_emb_mlp_down": (4 * d, d), "mlp_emb_bias_down": (d,),
        "ln_1": (n, d), "ln_1_bias": (n, d),
        "w_q": (n, d, d), "w_k": (n, d, d), "w_v": (n, d, d), "w_o": (n, d, d),
        "ln_2": (n, d), "ln_2_bias": (n, d),
        "w_up": (n, d, 4 * d), "mlp_bias_up": (n, 4 * d),
        "w_down": (n, 4 * d, d), "mlp_bias_down": (n, d),
        "ln_f": (d,), "ln_f_bias": (d,),
    }


def overlay_shapes(cfg: Config) -> dict[str, tuple]:
    """Adaptive-noise overlays: one int8 per matrix row and column, one per vector entry."""
    d, v, n = cfg.model.hidden_dim, cfg.model.vocab_size, cfg.model.n_layers
    return {
        "embedding_row": (v,), "embedding_col": (d,), "emb_bias": (d,),
        "ln_init": (d,), "ln_init_bias": (d,),
        "w_emb_mlp_up_row": (d,), "w_emb_mlp_up_col": (4 * d,), "mlp_emb_bias_up": (4 * d,),
        "w_emb_mlp_down_row": (4 * d,), "w_emb_mlp_down_col": (d,), "mlp_emb_bias_down": (d,),
        "ln_1": (n, d), "ln_1_bias": (n, d),
        "w_q_row": (n, d), "w_q_col": (n, d), "w_k_row": (n, d), "w_k_col": (n, d),
        "w_v_row": (n, d), "w_v_col": (n, d), "w_o_row": (n, d), "w_o_col": (n, d),
        "ln_2": (n, d), "ln_2_bias": (n, d),
        "w_up_row": (n, d), "w_up_col": (n, 4 * d), "mlp_bias_up": (n, 4 * d),
        "w_down_row": (n, 4 * d), "w_down_col": (n, d), "mlp_bias_down": (n, d),
        "ln_f": (d,), "ln_f_bias": (d,),
    }


def init_params(cfg: Config) -> dict[str, np.ndarray]:
    """Weights from one xorshift32 stream in the reference's order; norms 16, biases 0."""
    shapes = param_shapes(cfg)
    params = {name: np.zeros(shape, np.int8) for name, shape in shapes.items()}
    for name in ("ln_init", "ln_1", "ln_2", "ln_f"):
        params[name][...] = 16
    state = np.uint32(cfg.training.init_seed)
    mask = cfg.noise.init_mask
    three = cfg.noise.init_distribution == "three_sample"

    def fill(arr):
        nonlocal state
        values, state = xorshift_noise(state, arr.size, mask, three)
        arr[...] = values.reshape(arr.shape)

    fill(params["embedding"])
    fill(params["w_emb_mlp_up"])
    fill(params["w_emb_mlp_down"])
    for layer in range(cfg.model.n_layers):
        for name in ("w_q", "w_k", "w_v", "w_o", "w_up", "w_down"):
            fill(params[name][layer])
    return params


def init_overlays(cfg: Config) -> dict[str, np.ndarray]:
    return {name: np.full(shape, cfg.adaptive_noise.init, np.int8)
            for name, shape in overlay_shapes(cfg).items()}


def parameter_table(cfg: Config) -> list[tuple[str, str, int]]:
    """(component, dims, params) rows in the order print_arch shows them."""
    d, v, n = cfg.model.hidden_dim, cfg.model.vocab_size, cfg.model.n_layers
    rows = [
        ("Embedding", f"[{v}, {d}]", v * d), ("Embedding Bias", f"[{d}]", d),
        ("LN Init", f"[{d}]", d), ("LN Init Bias", f"[{d}]", d),
        ("Emb MLP Up", f"[{d}, {4 * d}]", 4 * d * d), ("Emb MLP Bias Up", f"[{4 * d}]", 4 * d),
        ("Emb MLP Down", f"[{4 * d}, {d}]", 4 * d * d), ("Emb MLP Bias Down", f"[{d}]", d),
    ]
    layer = [
        ("LN 1", f"[{d}]", d), ("LN 1 Bias", f"[{d}]", d),
        ("W_Q", f"[{d}, {d}]", d * d), ("W_K", f"[{d}, {d}]", d * d),
        ("W_V", f"[{d}, {d}]", d * d), ("W_O", f"[{d}, {d}]", d * d),
        ("LN 2", f"[{d}]", d), ("LN 2 Bias", f"[{d}]", d),
        ("W_Up", f"[{d}, {4 * d}]", 4 * d * d), ("MLP Bias Up", f"[{4 * d}]", 4 * d),
        ("W_Down", f"[{4 * d}, {d}]", 4 * d * d), ("MLP Bias Down", f"[{d}]", d),
    ]
    rows += [(f"  {name} (x{n})", dims, count * n) for name, dims, count in layer]
    rows += [("LN Final", f"[{d}]", d), ("LN Final Bias", f"[{d}]", d)]
    return rows


# --- lookup tables -------------------------------------------------------------------

@dataclass(frozen=True)
class Tables:
    exp: np.ndarray    # int64 [lut_size]: exp(-i / exp_scale) * 2^scale_bit, rounded
    gelu: np.ndarray   # int64 [256]: GELU of each int8 in Q.fixed_point, by uint8 index
    rope: np.ndarray   # int64 [positions, head_dim // 2, 2]: cos, sin * 2^rope_scale_bit


def c_round(x: float) -> int:
    """C's round(): halves away from zero."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def make_tables(cfg: Config, positions: int) -> Tables:
    """The integer lookup tables, RoPE for `positions` positions.

    The reference's RoPE table covers seq_len positions only and its generation reads
    past the end of it; we size it for every position we use.
    """
    sm = cfg.softmax
    exp = [c_round(v) if (v := math.exp(-i / sm.exp_scale) * (1 << sm.scale_bit)) >= 1.0 else 0
           for i in range(sm.lut_size)]
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
    return np.nan_to_num(np.clip(np.trunc(x), -2**31, 2**31 - 1)).astype(np.int64)


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


def int_matmul(x, w):
    """Exact integer x @ w for int8-range operands, through float BLAS."""
    k = w.shape[-2]
    dtype = np.float32 if k * 128 * 128 <= 2**24 else np.float64
    return np.matmul(x.astype(dtype), w.astype(dtype)).astype(np.int64)


# --- per-member perturbations ----------------------------------------------------------

class Perturbation:
    """The noise of a set of population members: one seed and one sign per member.

    A member's seed is step_seed + pair (wrapping at 32 bits); members 2i and 2i+1 of a
    pair share it and carry +noise and -noise. Every method returns arrays whose first
    axis is the member.
    """

    def __init__(self, cfg: Config, step_seed: int, members: np.ndarray):
        self.cfg = cfg
        members = np.asarray(members, np.int64)
        self.seeds = ((step_seed + members // 2) & 0xFFFFFFFF).astype(np.uint32)
        self.signs = np.where(members % 2 == 0, 1, -1).astype(np.int64)
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
            return noise_table(self.seed(offset)[:, 0], idx.astype(np.uint32), self.mask, self.three)
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
            return np.where(ov < 0, np.float32(0),
                            np.where(ov < 64, ov / np.float32(64), np.float32(1))).astype(np.float32)
        # mode 2, heavy-tailed: scale / sqrt(u) with u uniform in (0, 1] from the gate hash
        scale = (ov + np.float32(127)) / np.float32(255)
        r = hash_np(self.seed(offset + SEED["gate"]), idx).astype(np.float32)
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

    def output_term(self, sb, off_a: int, overlay_out, n: int):
        """((sb * (int)(a_j * factor_j)) * sign) >> shift, per member, position and output."""
        idx = np.arange(n)
        av = self.scaled(self.noise(off_a, idx), self.factor(overlay_out, off_a, idx))
        term = wrap32(wrap32(sb[:, :, None] * av[:, None, :]) * self.signs[:, None, None])
        return term >> self.matrix_shift


def project(x, w, pert: Perturbation | None, off_a: int, off_b: int, ov_in, ov_out):
    """x @ (W + perturbation) for x [member, position, in], W [in, out]."""
    out = int_matmul(x, w)
    if pert is not None:
        sb = pert.input_dot(x, off_b, ov_in)
        out = wrap32(out + pert.output_term(sb, off_a, ov_out, w.shape[1]))
    return out


# --- the layers ------------------------------------------------------------------------

def standard_norm(cfg, x, w, b, pert, off_w_a, off_w_b, off_b_a, off_b_b, ov_w, ov_b):
    """x * w / mean|x| + b, with the weight and bias perturbed (rank-1 vector noise)."""
    d = cfg.model.hidden_dim
    mean = np.abs(x).sum(-1, keepdims=True) // d
    mean = np.where(mean == 0, 1, mean)
    w = w.astype(np.int64)[None, None, :]
    b = b.astype(np.int64)[None, None, :]
    if pert is not None:
        w = w + pert.vector(ov_w, off_w_a, off_w_b, d)[:, None, :]
        b = b + pert.vector(ov_b, off_b_a, off_b_b, d)[:, None, :]
    return clip8(cdiv(x * w, mean) + b)


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
        return cls([np.zeros(shape, np.int64) for _ in range(n)],
                   [np.zeros(shape, np.int64) for _ in range(n)])


def attention_block(cfg, tables, params, overlays, x, layer, pert, cache, positions):
    base = layer * LAYER_SEED_STRIDE
    ov = lambda name: overlays[name][layer]
    normed = standard_norm(
        cfg, x, params["ln_1"][layer], params["ln_1_bias"][layer], pert,
        base + SEED["ln_1_a"], base + SEED["ln_1_b"],
        base + SEED["ln_1_bias_a"], base + SEED["ln_1_bias_b"], ov("ln_1"), ov("ln_1_bias"))
    qkv = {}
    for name in ("q", "k", "v"):
        qkv[name] = project(normed, params[f"w_{name}"][layer], pert,
                            base + SEED[f"{name}_a"], base + SEED[f"{name}_b"],
                            ov(f"w_{name}_row"), ov(f"w_{name}_col"))
    q = max_abs_normalize(rope(cfg, tables, qkv["q"], positions))
    cache.k[layer][:, positions] = max_abs_normalize(rope(cfg, tables, qkv["k"], positions))
    cache.v[layer][:, positions] = max_abs_normalize(qkv["v"])
    mixed = attention_mix(cfg, tables, q, cache.k[layer], cache.v[layer], positions)
    out = project(mixed, params["w_o"][layer], pert, base + SEED["o_a"], base + SEED["o_b"],
                  ov("w_o_row"), ov("w_o_col"))
    return max_abs_normalize(x + (out >> cfg.quantization.shift_out))


# Parameter and overlay names of the two MLPs: the initial one and the per-layer one.
INIT_MLP = dict(ln="ln_init", ln_bias="ln_init_bias", up="w_emb_mlp_up",
                bias_up="mlp_emb_bias_up", down="w_emb_mlp_down", bias_down="mlp_emb_bias_down",
                seed="emb_mlp", seed_ln="ln_init", seed_bias="emb_mlp_bias")
LAYER_MLP = dict(ln="ln_2", ln_bias="ln_2_bias", up="w_up", bias_up="mlp_bias_up",
                 down="w_down", bias_down="mlp_bias_down",
                 seed="mlp", seed_ln="ln_2", seed_bias="mlp_bias")


def mlp_block(cfg, tables, params, overlays, x, names, layer, pert):
    """Norm, up-projection, GELU table, down-projection, residual, max-abs normalisation."""
    q = cfg.quantization
    d = cfg.model.hidden_dim
    base = 0 if layer is None else layer * LAYER_SEED_STRIDE
    pick = (lambda a: a) if layer is None else (lambda a: a[layer])
    p = lambda key: pick(params[names[key]])
    o = lambda name: pick(overlays[name])
    s = lambda key: base + SEED[key]
    sd, sl, sb_ = names["seed"], names["seed_ln"], names["seed_bias"]

    normed = standard_norm(cfg, x, p("ln"), p("ln_bias"), pert,
                           s(f"{sl}_a"), s(f"{sl}_b"), s(f"{sl}_bias_a"), s(f"{sl}_bias_b"),
                           o(names["ln"]), o(names["ln_bias"]))
    up = project(normed, p("up"), pert, s(f"{sd}_up_a"), s(f"{sd}_up_b"),
                 o(names["up"] + "_row"), o(names["up"] + "_col"))
    pre = (up >> q.shift_mlp_up) + p("bias_up").astype(np.int64)
    if pert is not None:
        pre = pre + pert.vector(o(names["bias_up"]), s(f"{sb_}_up_a"), s(f"{sb_}_up_b"), 4 * d)[:, None, :]
    hidden = tables.gelu[clip8(pre) & 0xFF]

    down_w = p("down")
    out = int_matmul(hidden, down_w)
    if pert is not None:
        sb = down_input_dot(pert, hidden, s(f"{sd}_down_b"), o(names["down"] + "_row"), d)
        out = wrap32(out + pert.output_term(sb, s(f"{sd}_down_a"), o(names["down"] + "_col"), d))
    res = x + (out >> q.shift_mlp_down) + p("bias_down").astype(np.int64)
    if pert is not None:
        res = res + pert.vector(o(names["bias_down"]), s(f"{sb_}_down_a"), s(f"{sb_}_down_b"), d)[:, None, :]
    return max_abs_normalize(res)


def down_input_dot(pert, hidden, off_b, overlay_in, d):
    """The down-projection's input dot product, summed as the reference's threads do.

    Thread j adds inputs j, j+d, j+2d, j+3d into an int32 through float32, truncating
    after every addition: pb = (int)((float)pb + x * b * factor). We take that
    multiply-add as one fused rounding (fmaf), as nvcc emits it; float64 reproduces it
    because the float32 product is exact there. (The golden vectors agree with both the
    fused and the unfused form.) The threads' partial sums then add as integers.
    """
    idx = np.arange(4 * d)
    terms = f32(hidden * pert.noise(off_b, idx)[:, None, :]).astype(np.float64)
    factor = pert.factor(overlay_in, off_b, idx)[:, None, :].astype(np.float64)
    partial = np.zeros(hidden.shape[:2] + (d,), np.int64)
    for sub in range(4):
        cols = slice(sub * d, (sub + 1) * d)
        total = f32(partial).astype(np.float64) + terms[..., cols] * factor[..., cols]
        partial = trunc_i32(f32(total))
    return wrap32(partial.sum(-1))


def embed(cfg, params, overlays, tokens, pert):
    """Token embeddings plus embedding bias, each with its perturbation."""
    d = cfg.model.hidden_dim
    x = params["embedding"].T[tokens].astype(np.int64) + params["emb_bias"].astype(np.int64)
    if pert is not None:
        q = cfg.quantization
        x = x + pert.vector(overlays["emb_bias"], SEED["emb_bias_a"], SEED["emb_bias_b"], d)[:, None, :]
        a_tok = pert.noise(SEED["emb"], tokens)  # [m, t]
        s_row = pert.factor(overlays["embedding_row"], SEED["emb"], tokens)
        idx = np.arange(d)
        b_dim = pert.noise(SEED["emb"] + d, idx)  # [m, d]
        s_col = pert.factor(overlays["embedding_col"], SEED["emb"] + d, idx)[:, None, :]
        prod = f32(f32(a_tok[:, :, None] * b_dim[:, None, :]) * s_row[..., None]) * s_col
        x = x + ((trunc_i32(prod) * pert.signs[:, None, None]) >> (q.fixed_point + q.sigma_shift))
    return clip8(x)


def final_norm(cfg, params, overlays, x, pert):
    return standard_norm(cfg, x, params["ln_f"], params["ln_f_bias"], pert,
                         SEED["ln_f_a"], SEED["ln_f_b"], SEED["ln_f_bias_a"], SEED["ln_f_bias_b"],
                         overlays["ln_f"], overlays["ln_f_bias"])


def logits(cfg, params, overlays, normed, pert):
    """The tied head: normed @ embedding (+ its rank-1 noise), >> shift_logit."""
    d = cfg.model.hidden_dim
    out = project(normed, params["embedding"], pert, SEED["emb"], SEED["emb"] + d,
                  overlays["embedding_col"], overlays["embedding_row"])
    return out >> cfg.quantization.shift_logit


def forward(cfg, tables, params, overlays, tokens, pert, cache, positions):
    """Hidden states after the final norm for `tokens` [member, position] at `positions`."""
    x = embed(cfg, params, overlays, tokens, pert)
    x = mlp_block(cfg, tables, params, overlays, x, INIT_MLP, None, pert)
    for layer in range(cfg.model.n_layers):
        x = attention_block(cfg, tables, params, overlays, x, layer, pert, cache, positions)
        x = mlp_block(cfg, tables, params, overlays, x, LAYER_MLP, layer, pert)
    return final_norm(cfg, params, overlays, x, pert)


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


def member_losses(cfg: Config, tables: Tables, params, overlays, data, step: int,
                  step_seed: int, members) -> np.ndarray:
    """Loss (int32) of each listed population member at a step."""
    members = np.asarray(members, np.int64)
    tokens = member_tokens(cfg, data, step, members)
    pert = Perturbation(cfg, step_seed, members)
    t = cfg.model.seq_len
    cache = KVCache.empty(cfg, len(members), t)
    normed = forward(cfg, tables, params, overlays, tokens[:, :t], pert, cache, np.arange(t))
    lgt = logits(cfg, params, overlays, normed, pert)
    return sequence_loss(cfg, tables, lgt, tokens[:, 1:])


def member_tokens(cfg: Config, data: np.ndarray, step: int, members) -> np.ndarray:
    """The seq_len + 1 tokens each member reads: its pair's window of the data stream."""
    t = cfg.model.seq_len
    n = len(data)
    pairs = np.asarray(members, np.int64) // 2
    start = step * t
    if cfg.training.same_data:
        pos = np.full(len(pairs), start % (n - t), np.int64)
    else:
        stride = n // cfg.training.n_pairs
        pos = (start + pairs * stride) % (n - t)
    return data[pos[:, None] + np.arange(t + 1)[None, :]].astype(np.int64)
