#!/usr/bin/env python3
"""Check and time the GPU kernels one at a time against the CPU specification.

    python scripts/kernels.py [NAME ...] [--config PATH] [--members N] [--repeats R]
        [-D NAME=VALUE ...] [--energy SECONDS] [--no-check]

For each kernel: random inputs (weights and overlays moved off their initial values, so
every noise path is live; the `_unit` checks raise every overlay byte to 64 or more, as
training keeps them, where the fused kernels sum their input dots by unit factors), the
kernel alone through its typed launcher, the same
computation with the CPU backend's functions (deggs/numerics/model.py, optimizer.py,
sampling.py), a bit-exact comparison, then R timed launches with CUDA events. Prints one
line per kernel: ok or MISMATCH, milliseconds, and the GB/s of the bytes the kernel must
move (its inputs and outputs once), against the card's memory bandwidth. Exit status 1
on any mismatch. Speed work on one kernel never needs the whole model to run, and -D
compiles a variant (another ATT_SPLIT, LOSS_REGISTER_LPT, ...) to check and time beside it.
With --energy S each kernel also runs in a loop of about S seconds, long enough for the
card to reach its power limit: a second line gives the call's time there, the power and
clock (nvidia-smi, scripts/power.py) and so the energy a call, which at the limit is
what a step pays for the kernel.

Kernels without a check here (UNCHECKED) are covered end to end by tests/test_gpu.py.
The update's kernels take the config's whole population (scripts/kernels.py
noise_matrix vector_votes --config config.toml times them at the default).

The harness reaches the kernels through the backend's public parts only: its plan, its
launcher, and the launchers of its forward and update paths.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from variants import define_option, parse_defines  # noqa: E402

from deggs.config import Config, load_config  # noqa: E402
from deggs.numerics import model  # noqa: E402
from deggs.numerics.gpu.cores import hidden_order  # noqa: E402
from deggs.numerics.gpu.forward import Batch, Norm  # noqa: E402
from deggs.numerics.gpu.plan import KERNELS, UNIT_TWINS  # noqa: E402
from deggs.numerics.gpu.state import QKV  # noqa: E402
from deggs.numerics.gpu.update import (  # noqa: E402
    DEVICE_OPTIMIZERS,
    Changes,
    DeviceParam,
    VectorClusters,
    vote_gemms,
)
from deggs.numerics.model import Perturbation, Weights, wrap32  # noqa: E402
from deggs.numerics.optimizer import (  # noqa: E402
    OPTIMIZERS,
    Moments,
    matrix_votes,
    pair_noise,
    update_overlay,
    vector_votes,
)
from deggs.numerics.params import EMB_MLP, LAYER_MLP, PARAM, offsets  # noqa: E402
from deggs.numerics.sampling import choose_token, sampler_limits, scan_order  # noqa: E402
from deggs.seeds import pair_seed  # noqa: E402

SMALL = Config().replace(
    model=dict(hidden_dim=256, head_dim=64, n_layers=1, seq_len=64, vocab_size=8192),
    training=dict(population_size=512, chunk_size=512),
)


class Bench:
    """A GPU backend with random weights, a CPU view of the same weights, and members."""

    def __init__(self, cfg: Config, members: int, seed: int = 0, defines=None):
        import cupy as cp

        from deggs.numerics.gpu import GpuBackend

        self.cp, self.cfg, self.rng = cp, cfg, np.random.default_rng(seed)
        self.gpu = GpuBackend(cfg, defines=defines)
        self.forward, self.plan, self.launch = self.gpu.forward, self.gpu.plan, self.gpu.launch
        params = {
            k: self.rng.integers(-100, 101, v.shape).astype(np.int8)
            for k, v in self.gpu.params.items()
        }
        self.params = params
        self.drawn = {
            k: self.rng.integers(-127, 128, v.shape).astype(np.int8)
            for k, v in self.gpu.overlays.items()
        }
        self.tables = self.gpu.tables
        self.m, self.t, self.d = members, cfg.model.seq_len, cfg.model.hidden_dim
        self.rows = members * self.t
        self.pert = Perturbation(cfg, int(self.rng.integers(2**32)), np.arange(members))
        self.unit = None
        self.use_overlays(unit=False)
        self.seeds = cp.asarray(self.pert.seeds)
        self.signs = cp.asarray(self.pert.signs.astype(np.int32))
        # room for any kernel's products or logits, whichever path it belongs to
        words = self.rows * max(4 * self.d, cfg.model.vocab_size)
        self.buf = self.forward.make_rows(self.rows, words)
        self.batch = Batch(self.buf, self.seeds, self.signs, members=members, positions=self.t)

    def use_overlays(self, unit: bool):
        """The overlays as drawn, or (unit) each byte raised to 64 if below: every
        adaptive factor 1, where the fused kernels sum their dots by unit factors
        (kernels/common.cuh)."""
        if unit == self.unit:
            return
        overlays = {k: np.maximum(v, np.int8(64)) if unit else v for k, v in self.drawn.items()}
        self.gpu.load_state(self.params, overlays)
        self.weights = Weights(self.cfg, self.params, overlays, self.pert)
        self.unit = unit

    def layer_weights(self, layer: int | None) -> Weights:
        """The weights as a layer's kernels see them (None: those outside the layers)."""
        return self.weights if layer is None else self.weights.at(layer)

    def ints(self, low, high, shape, dtype=np.int32):
        return self.rng.integers(low, high, shape).astype(dtype)

    def put(self, name, host):
        """Copy a host array into the start of a row buffer."""
        getattr(self.buf, name)[: host.size] = self.cp.asarray(host.ravel())

    def get(self, name, shape, dtype=None):
        size = int(np.prod(shape))
        out = getattr(self.buf, name)[:size].get().reshape(shape)
        return out if dtype is None else out.astype(dtype)


def projection_terms(b, name, layer, g, sb, width):
    """wrap32(g + output_term(sb)) of the matrix `name`: the GEMM output plus rank-1 term."""
    off_a = offsets(b.cfg, name, layer)[0]
    pick = (lambda a: a[layer]) if layer is not None else (lambda a: a)
    ov_out = pick(b.weights.overlays[PARAM[name].overlays[1]])
    return wrap32(g + b.pert.output_term(sb, off_a, ov_out, width))


# --- one check per kernel: (setup, launch, reference, result, bytes moved) ----------


def check_embed_norm(b):
    """The embedding, then a norm with three input dots (layer 0's first; training's
    first norm, the embedding MLP's, has one, as residual_norm's check has)."""
    tokens = b.ints(0, b.cfg.model.vocab_size, (b.m, b.t + 1))
    d_tok = b.cp.asarray(tokens.ravel())

    def launch():
        b.forward.embed_norm(b.batch, d_tok, QKV_NORM)

    def reference():
        return norm_reference(b, model.embed(b.cfg, b.weights, tokens[:, : b.t]), QKV_NORM)

    moved = tokens.nbytes + 2 * b.rows * b.d + 12 * b.rows
    return lambda: None, launch, reference, lambda: residual_result(b, ndots=3), moved


def check_qkv_rope(b):
    g = b.ints(-(2**20), 2**20, (b.m, b.t, 3, b.d))
    sb = b.ints(-(2**18), 2**18, (3, b.m, b.t))

    def setup():
        b.put("g", g)
        b.put("sb", sb)

    def launch():
        b.forward.qkv_rope(b.batch, 0)

    def reference():
        return qkv_rope_reference(b, g.astype(np.int64), sb)

    def result():
        return b.get("qkv", (3, b.m, b.t, b.d), np.int64)

    return setup, launch, reference, result, g.nbytes + sb.nbytes + 3 * b.rows * b.d


def qkv_rope_reference(b, g, sb):
    """RoPE'd, max-abs normalised q, k, v ([3, member, position, hidden]) from the
    projections g [member, position, 3, hidden] and their input dots sb [3, ...]."""
    out = []
    for i, name in enumerate(("w_q", "w_k", "w_v")):
        v = projection_terms(b, name, 0, g[:, :, i], sb[i], b.d)
        if i < 2:
            v = model.rope(b.cfg, b.tables, v, np.arange(b.t))
        out.append(model.max_abs_normalize(v))
    return np.stack(out)


def check_qkv_rope_sm90(b):
    """The q, k, v GEMM and qkv_rope fused on warpgroup MMAs (qkv_rope_sm90.cu): no
    products in memory. Built on H100s and H200s only."""
    y = b.ints(-127, 128, (b.m, b.t, b.d), np.int8)
    sb = b.ints(-(2**18), 2**18, (3, b.m, b.t))
    layer = b.weights.at(0)

    def setup():
        b.put("y", y)
        b.put("sb", sb)

    def launch():
        b.forward.qkv_rope_sm90(b.batch, 0)

    def reference():
        g = [model.int_matmul(y, layer.arrays(name)[0]) for name in ("w_q", "w_k", "w_v")]
        return qkv_rope_reference(b, np.stack(g, 2), sb)

    def result():
        return b.get("qkv", (3, b.m, b.t, b.d), np.int64)

    moved = y.nbytes + sb.nbytes + 3 * b.d * b.d + 3 * b.rows * b.d
    return setup, launch, reference, result, moved


def check_attention_mix(b, tensor_cores=False):
    q, k, v = (b.ints(-127, 128, (b.m, b.t, b.d), np.int8) for _ in range(3))
    layer = b.weights.at(0)

    def setup():
        b.put("qkv", np.stack([q, k, v]))

    def launch():
        b.forward.attention_mix(b.batch, 0, tensor_cores)

    def reference():
        mixed = model.attention_mix(
            b.cfg,
            b.tables,
            q.astype(np.int64),
            k.astype(np.int64),
            v.astype(np.int64),
            np.arange(b.t),
        )
        sb = b.pert.input_dot(mixed, offsets(b.cfg, "w_o", 0)[1], layer.arrays("w_o")[1][0])
        return mixed, sb

    def result():
        return b.get("y", (b.m, b.t, b.d), np.int64), b.get("sbd", (b.m, b.t), np.int64)

    return setup, launch, reference, result, 4 * b.rows * b.d + 4 * b.rows


def check_attention_mma(b):
    """attention_mix on the tensor cores (attention.cu), against the same reference."""
    return check_attention_mix(b, tensor_cores=True)


def residual_terms_reference(b, g, sb, name="w_o", layer=0, shift=None):
    """A projection's terms of the residual, (g + rank-1 term) >> shift (the
    o-projection's by default)."""
    shift = b.cfg.quantization.shift_out if shift is None else shift
    return projection_terms(b, name, layer, g.astype(np.int64), sb, b.d) >> shift


def norm_reference(b, x, norm: Norm) -> tuple:
    """x, the norm `norm` of it and its readers' input dots: what a row kernel writes."""
    weights = b.layer_weights(norm.layer)
    y = model.norm(b.cfg, weights, x, norm.weight, norm.bias)
    dots = [
        b.pert.input_dot(y, offsets(b.cfg, name, norm.layer)[1], weights.arrays(name)[1][0])
        for name in norm.readers
    ]
    return (x, y, *dots)


def residual_reference(b, x, term, then: Norm, bias=None, bias_layer=None):
    """The new x = max_abs_normalize(x + term [+ the vector `bias` of `bias_layer` with its
    noise]), then the norm `then` of it and its readers' input dots."""
    bias_term = 0 if bias is None else b.layer_weights(bias_layer).vector(bias)
    new_x = model.max_abs_normalize(x + term + bias_term)
    return norm_reference(b, new_x, then)


MLP_NORM = Norm(LAYER_MLP.ln, LAYER_MLP.ln_bias, 0, (LAYER_MLP.up,))  # layer 0's, one dot
QKV_NORM = Norm("ln_1", "ln_1_bias", 0, QKV)  # layer 0's first, three dots


def residual_result(b, ndots=1):
    """x, y and the next norm's `ndots` input dots, as the residual kernels write them."""
    new_x = b.get("x", (b.m, b.t, b.d), np.int64)
    dots = b.get("sb", (ndots, b.m, b.t), np.int64)
    return (new_x, b.get("y", (b.m, b.t, b.d), np.int64), *dots)


def check_residual_norm(b):
    """The residual after the o-projection, then layer 0's MLP norm of the new x, from
    the int32 products."""
    g = b.ints(-(2**20), 2**20, (b.m, b.t, b.d))
    sb = b.ints(-(2**18), 2**18, (b.m, b.t))
    x = b.ints(-127, 128, (b.m, b.t, b.d), np.int8)

    def setup():
        b.put("g", g)
        b.put("sbd", sb)
        b.put("x", x)

    def launch():
        b.forward.residual(b.batch, "w_o", 0, b.cfg.quantization.shift_out, MLP_NORM)

    def reference():
        return residual_reference(b, x, residual_terms_reference(b, g, sb), MLP_NORM)

    def result():
        return residual_result(b)

    inputs = g.nbytes + x.nbytes + sb.nbytes
    return setup, launch, reference, result, inputs + 2 * x.nbytes + sb.nbytes


def check_o_residual_sm90(b, down=False):
    """The o-projection's GEMM with residual_norm as its epilogue (residual_sm90.cu): no
    products in memory; the next norm is layer 0's MLP norm (one dot). Built on H100s
    and H200s only."""
    q = b.cfg.quantization
    if down:  # the embedding MLP's down-projection and bias, then layer 0's ln_1 (q, k, v)
        kernel, name, layer, bias = "down_residual_sm90", EMB_MLP.down, None, EMB_MLP.bias_down
        k, shift, then = 4 * b.d, q.shift_mlp_down, QKV_NORM
    else:
        kernel, name, layer, bias = "o_residual_sm90", "w_o", 0, None
        k, shift, then = b.d, q.shift_out, MLP_NORM
    inputs = b.ints(-127, 128, (b.m, b.t, k), np.int8)
    sb = b.ints(-(2**18), 2**18, (b.m, b.t))
    x = b.ints(-127, 128, (b.m, b.t, b.d), np.int8)
    # where up_gelu_sm90 runs, the down-projection reads its input in hidden_order
    order = hidden_order(b.d) if down and b.plan.fused_up else np.arange(k)
    source = "hidden" if down and b.plan.fused_up else "y"  # the row buffer it reads

    def setup():
        b.put(source, np.ascontiguousarray(inputs[..., order]))
        b.put("sbd", sb)
        b.put("x", x)

    # few members (the tests) in few blocks, so that each block takes several tiles in
    # turn, as it does at training sizes
    blocks = max(1, min(b.forward.sms, -(-b.rows // b.plan.defines["RESIDUAL_ROWS"]) // 5))

    def launch():
        rows = getattr(b.buf, source)
        b.forward.projection_residual(b.batch, kernel, name, layer, shift, then, bias, rows, blocks)

    def reference():
        weights = b.layer_weights(layer)
        g = model.int_matmul(inputs, weights.arrays(name)[0])
        term = residual_terms_reference(b, g, sb, name, layer, shift)
        return residual_reference(b, x, term, then, bias, layer)

    def result():
        return residual_result(b, len(then.readers))

    moved = inputs.nbytes + sb.nbytes + 3 * x.nbytes + 4 * b.rows * len(then.readers) + k * b.d
    return setup, launch, reference, result, moved


def check_down_residual_sm90(b):
    """The down-projection's likewise, its 4 hidden_dim inputs in slices, its bias, and
    the next norm's three dots (q, k, v)."""
    return check_o_residual_sm90(b, down=True)


def mlp_up_reference(b, names, g, sb):
    """GELU'd hidden and the down-projection's input dot, from the up-projection g."""
    q = b.cfg.quantization
    out = projection_terms(b, names.up, None, g, sb, 4 * b.d)
    pre = (out >> q.shift_mlp_up) + b.weights.vector(names.bias_up)
    hidden = b.tables.gelu[model.clip8(pre) & 0xFF]
    off_b = offsets(b.cfg, names.down)[1]
    ov_in = b.weights.arrays(names.down)[1][0]
    return hidden, b.pert.input_dot_by_threads(hidden, off_b, ov_in)


def check_mlp_up(b):
    g = b.ints(-(2**20), 2**20, (b.m, b.t, 4 * b.d))
    sb = b.ints(-(2**18), 2**18, (b.m, b.t))
    names = EMB_MLP

    def setup():
        b.put("g", g)
        b.put("sb", sb)

    def launch():
        b.forward.mlp_up(b.batch, names, None)

    def reference():
        return mlp_up_reference(b, names, g.astype(np.int64), sb)

    def result():
        hidden = b.get("y", (b.m, b.t, 4 * b.d), np.int64)
        return hidden, b.get("sbd", (b.m, b.t), np.int64)

    return setup, launch, reference, result, g.nbytes + b.rows * 4 * b.d + 8 * b.rows


def check_up_gelu_sm90(b):
    """The up-projection's GEMM and mlp_up fused on warpgroup MMAs (up_gelu_sm90.cu): no
    products in memory. Built on H100s and H200s only."""
    y = b.ints(-127, 128, (b.m, b.t, b.d), np.int8)
    sb = b.ints(-(2**18), 2**18, (b.m, b.t))
    names = EMB_MLP

    def setup():
        b.put("y", y)
        b.put("sb", sb)
        b.buf.hidden.fill(0x7F)  # a byte the kernel leaves unwritten cannot pass

    def launch():
        b.forward.up_gelu(b.batch, names, None)

    def reference():
        g = model.int_matmul(y, b.weights.arrays(names.up)[0])
        return mlp_up_reference(b, names, g, sb)

    def result():
        hidden = np.empty((b.m, b.t, 4 * b.d), np.int64)  # written in hidden_order
        hidden[..., hidden_order(b.d)] = b.get("hidden", (b.m, b.t, 4 * b.d), np.int64)
        return hidden, b.get("sbd", (b.m, b.t), np.int64)

    moved = y.nbytes + sb.nbytes + 4 * b.d * b.d + b.rows * (4 * b.d + 4)
    return setup, launch, reference, result, moved


def head_loss_reference(b, g, sb, tokens):
    """Each member's loss from the head's GEMM output g and its input dot sb."""
    v = b.cfg.model.vocab_size
    lgt = projection_terms(b, "embedding", None, g, sb, v) >> b.cfg.quantization.shift_logit
    return model.sequence_loss(b.cfg, b.tables, lgt, tokens[:, 1:].astype(np.int64))


def loss_inputs(b, sb_bound=2**18):
    """What a loss kernel reads besides its products: the input dots, the members' tokens
    (host and device), and the device buffer of the members' losses. sb_bound 0: no
    rank-1 terms (in adaptive mode 2 any others spread the logits over the whole range)."""
    sb = b.ints(-sb_bound, sb_bound + 1, (b.m, b.t))
    tokens = b.ints(0, b.cfg.model.vocab_size, (b.m, b.t + 1))
    return sb, tokens, b.cp.asarray(tokens.ravel()), b.cp.empty(b.m, b.cp.int32)


def check_sequence_loss(b, low=-(2**22), high=2**22, sb_bound=2**18, place=None):
    """sequence_loss of random products in [low, high), then place(g, tokens) setting
    chosen ones. Random full-range rows have their peaks far above their input and target
    tokens' logits: most are read twice."""
    v = b.cfg.model.vocab_size
    g = b.ints(low, high, (b.m, b.t, v))
    sb, tokens, d_tok, loss = loss_inputs(b, sb_bound)
    if place is not None:
        place(g, tokens)

    def setup():
        b.put("g", g)
        b.put("sb", sb)

    def launch():
        b.forward.sequence_loss(b.batch, d_tok, loss)

    def reference():
        return head_loss_reference(b, g.astype(np.int64), sb, tokens)

    def result():
        return loss.get()

    return setup, launch, reference, result, g.nbytes + sb.nbytes + tokens.nbytes


def check_sequence_loss_near(b):
    """sequence_loss where a row's logits lie within the exp table of each other: every
    row read once (its histogram, forward.cu)."""
    return check_sequence_loss(b, -(2**12), 2**12, sb_bound=0)


def check_sequence_loss_peaked(b):
    """sequence_loss where each row's input token's logit lies above the others, within
    and below the exp table under it, except that every other row has one logit far
    above it: those rows read twice, the others once."""
    shift = b.cfg.quantization.shift_logit

    def peaked(g, tokens):
        np.put_along_axis(g, tokens[:, :-1, None].astype(np.int64), 100 << shift, -1)
        far = b.ints(0, g.shape[-1], g.shape[:-1])[:, 1::2, None].astype(np.int64)
        np.put_along_axis(g[:, 1::2], far, 3000 << shift, -1)

    return check_sequence_loss(b, -400 << shift, 60 << shift, 0, peaked)


def check_sequence_loss_edges(b):
    """sequence_loss at its bins' edges (forward.cu): each row's input token's logit 0,
    the others far below it but for the few set here, so that a term dropped or added
    changes a row's floor(log2). A third of the rows have their peak in the last bin
    (read once); a third one past it, with logits in the last bin (read twice: the
    bins' sum dropped); a third sum to 2^(SCALE_BIT + 1) or just past it, one or two of
    their logits in the first bin (read once)."""
    shift, e = b.cfg.quantization.shift_logit, b.tables.exp
    bins, last = b.plan.defines["LOSS_BINS"], b.plan.defines["EXP_LAST"]
    top = bins - last  # the last bin's distance above the input token's logit

    def edges(g, tokens):
        for m, t in np.ndindex(*g.shape[:2]):
            row, used = g[m, t], {int(tokens[m, t]), int(tokens[m, t + 1])}
            free = (int(c) for c in b.rng.permutation(g.shape[-1]) if c not in used)
            row[tokens[m, t]] = 0

            def put(logits):
                for logit in logits:
                    row[next(free)] = logit << shift

            if t % 3 == 0:
                put([top])
            elif t % 3 == 1:  # the peak's term and k at distance 1: [1.5, 2) e[0]
                put([top + 1] + [top] * max(1, -(-int(e[0]) // (2 * int(e[1])))))
            else:  # e[0] + e[last - 1] + entries up to 2 e[0], then e[last - 1] past it
                need, k, below = int(e[0] - e[last - 1]), 1, [-(last - 1)]
                while need >= e[last - 1]:
                    k = next(j for j in range(k, last) if e[j] <= need)
                    below.append(-k)
                    need -= int(e[k])
                put(below + ([-(last - 1)] if need else []))

    return check_sequence_loss(b, -(4 * bins) << shift, -(2 * bins) << shift, 0, edges)


def check_head_loss(b, y_bound=127, sb_bound=2**18, kernel="head_loss"):
    """The head's GEMM and sequence_loss fused (head_loss.cu): no logits in memory."""
    v, d = b.cfg.model.vocab_size, b.d
    y = b.ints(-y_bound, y_bound + 1, (b.m, b.t, d), np.int8)
    sb, tokens, d_tok, loss = loss_inputs(b, sb_bound)

    def setup():
        b.put("y", y)
        b.put("sb", sb)

    def launch():
        b.forward.head_loss(b.batch, d_tok, loss, kernel)

    def reference():
        g = model.int_matmul(y, b.weights.arrays("embedding")[0])
        return head_loss_reference(b, g, sb, tokens)

    def result():
        return loss.get()

    return setup, launch, reference, result, y.nbytes + sb.nbytes + tokens.nbytes + v * d


def check_head_loss_near(b):
    """head_loss where many logits lie near their row's peak, as a trained model's do: the
    exp lookups land on many entries (random full-range inputs put nearly all past the
    table's last nonzero entry, one word for every lane)."""
    return check_head_loss(b, y_bound=9, sb_bound=2**14)


def check_head_loss_sm90(b):
    """head_loss on warpgroup MMAs (head_loss_sm90.cu), built on H100s and H200s only."""
    return check_head_loss(b, kernel="head_loss_sm90")


def check_head_loss_sm90_near(b):
    """head_loss_sm90 where many logits lie near their row's peak: its one sweep moves
    many terms as peaks rise, and the rows it leaves open are summed again."""
    return check_head_loss(b, y_bound=9, sb_bound=2**14, kernel="head_loss_sm90")


def update_inputs(b):
    """The update's buffers with random ternary fitness and a random step seed."""
    updates = b.gpu.updates
    U = updates.buffers
    n_pairs = b.cfg.training.n_pairs
    fitness = np.zeros(U.pairs, np.int8)
    fitness[:n_pairs] = b.ints(-1, 2, n_pairs, np.int8)
    seed = int(b.rng.integers(2**32))
    updates.set_inputs(fitness, seed)
    return updates, U, fitness, seed


def check_noise_matrix(b):
    """The noise of matrices' votes as their GEMMs read it, each side over the seeds they
    sum (VoteGemm): layer 0's q, k, v and o in one GEMM, its up- and down-projection as
    training makes them (the larger side a window of the step's fields, the other made
    times the fitness), and the up-projection with its input seeds moved as the
    embedding's are (both sides made, over the pairs); and from those sides 8 x 8 of each
    matrix's votes, against the optimizer's."""
    updates, U, fitness, seed = update_inputs(b)
    cp, n_pairs = b.cp, b.cfg.training.n_pairs
    layer0 = [s for s in U.slices if s.layer == 0 and s.param.is_matrix]
    up = next(s for s in layer0 if s.name == "w_up")
    slices = layer0 + [dataclasses.replace(up, off_b=up.off_a + b.d)]
    cases = []  # (a GEMM, buffers for its made sides)
    for g in vote_gemms(slices, U.pairs):
        cases.append((g, cp.empty(g.outputs * g.k, cp.int8), cp.empty(g.inputs * g.k, cp.int8)))
    operands = []
    sample = lambda n: np.linspace(0, n - 1, 8).astype(int)

    def launch():
        operands.clear()
        updates.noise_fields()
        operands.extend(updates.vote_operands(g, slices, a, b_) for g, a, b_ in cases)

    def noise(off, n, k, shift=None):  # [n, k]: seeds off + c, times the fitness of c + shift
        seeds = pair_seed(seed, np.arange(k)).astype(np.uint32)[:, None]
        side = pair_noise(b.cfg, seeds, off, np.arange(n)).T.astype(np.int64)
        if shift is None:
            return side
        q = np.arange(k) + shift
        return side * np.where((q >= 0) & (q < U.pairs), fitness[np.clip(q, 0, U.pairs - 1)], 0)

    def reference():
        out = []
        for g, _, _ in cases:
            a_sides, votes = [], []
            for i in g.slices:
                s = slices[i]
                (n_in, n_out), shift = s.shape, g.base - s.off_a
                a_sides.append(noise(g.base, n_out, g.k, None if g.shared == "a" else shift))
                rows, cols = sample(n_in), sample(n_out)
                votes.append(
                    matrix_votes(b.cfg, fitness[:n_pairs], seed, s.off_a, s.off_b, rows, cols)
                )
            first = slices[g.slices[0]]
            b_off = first.off_b if g.shared is None else g.base + 1
            b_shift = g.base - first.off_a if g.shared == "a" else None
            out += [np.concatenate(a_sides), noise(b_off, first.shape[0], g.k, b_shift), *votes]
        return tuple(out)

    def result():
        out = []
        for (g, *_), (a, lda, b_, ldb) in zip(cases, operands, strict=True):
            # each side as the GEMM reads it: n rows of k from its pointer, ld apart
            get = lambda side, n, ld: cp.ndarray((n, g.k), cp.int8, side.data, strides=(ld, 1))
            sides = ((a, g.outputs, lda), (b_, g.inputs, ldb))
            ha, hb = (get(*x).get().astype(np.int64) for x in sides)
            out += [ha, hb]
            row = 0
            for i in g.slices:
                rows, cols = sample(g.inputs), row + sample(slices[i].shape[1])
                out.append(hb[rows] @ ha[cols].T)
                row += slices[i].shape[1]
        return tuple(out)

    moved = U.field_a.nbytes + U.field_b.nbytes + sum(a.nbytes + b_.nbytes for _, a, b_ in cases)
    return lambda: None, launch, reference, result, moved


def check_vector_votes(b):
    """The votes of every vector slice, one launch, of the first and last 16 entries of
    each slice where the population passes 4,096 pairs (the CPU's votes hash every pair);
    and in a second launch the same with the first layer's slices' input seeds moved
    apart as the embedding's are (no longer the output seeds plus one)."""
    updates, U, fitness, seed = update_inputs(b)
    n_pairs = b.cfg.training.n_pairs
    apart = [dataclasses.replace(s, off_b=s.off_a + b.d) if s.layer == 0 else s for s in U.slices]
    apart_clusters = VectorClusters.make(apart, U.vector_at)
    apart_vote = b.cp.empty_like(U.vector_vote)
    checked = []  # (slice, its entries checked, where its votes start)
    for i, at in U.vector_at.items():
        idx = np.arange(int(np.prod(U.slices[i].shape)))
        if n_pairs > 4096 and len(idx) > 32:
            idx = np.r_[idx[:16], idx[-16:]]
        checked.append((i, idx, at))

    def launch():
        updates.vector_votes()
        updates.vector_votes(apart_clusters, apart_vote)

    def reference():
        fit = fitness[:n_pairs]
        return tuple(
            np.concatenate(
                [
                    vector_votes(b.cfg, fit, seed, s[i].off_a, s[i].off_b, idx)
                    for i, idx, _ in checked
                ]
            )
            for s in (U.slices, apart)
        )

    def result():
        return tuple(
            np.concatenate([host[at + idx] for _, idx, at in checked])
            for host in (U.vector_vote.get(), apart_vote.get())
        )

    return lambda: None, launch, reference, result, U.pairs + 8 * len(U.vector_vote)


def check_optimizer(b, kind: str):
    """An optimizer's step (optimizer.cu) on a random slice of weights, moments and
    accumulators, against the CPU's optimizer of the same kind."""
    cp, n = b.cp, b.rows * 4
    w = b.ints(-127, 128, n, np.int8)
    m, v = (b.rng.standard_normal(n).astype(np.float32) for _ in range(2))
    v = np.abs(v)
    acc = (b.rng.uniform(-1.2, 1.2, n)).astype(np.float32)
    vote = b.ints(-5000, 5000, n)
    lr = np.float32(b.cfg.learning_rate(0))
    d = {k: cp.asarray(a) for k, a in dict(w=w, m=m, v=v, acc=acc, vote=vote).items()}
    counts, changes = cp.zeros(n, cp.int32), cp.zeros(1, cp.uint64)
    lrs = cp.asarray(np.array([lr, lr], np.float32))
    device = DEVICE_OPTIMIZERS[kind](b.cfg.optimizer, b.launch)
    param = DeviceParam(d["w"], d["m"], d["v"], d["acc"], n, n, lrs, 0)

    def setup():
        for k, a in dict(w=w, m=m, v=v, acc=acc).items():
            d[k][...] = cp.asarray(a)

    def launch():
        device.step(param, d["vote"], Changes(counts, None, changes))

    def reference():
        new_w, state, _ = OPTIMIZERS[kind](b.cfg.optimizer).step(w, vote, Moments(m, v, acc), lr)
        return new_w, state.m, state.v, state.acc

    def result():
        return tuple(d[k].get() for k in ("w", "m", "v", "acc"))

    return setup, launch, reference, result, n * (1 + 4 * 4) * 2


def check_adamw_step(b):
    return check_optimizer(b, "adamw")


def check_sgd_step(b):
    return check_optimizer(b, "sgd")


def check_update_overlay(b):
    cp, n = b.cp, b.rows
    ov = b.ints(-127, 128, n, np.int8)
    changes = b.ints(0, 3, n)
    d_ov, d_counts = cp.asarray(ov), cp.asarray(changes)
    a = b.cfg.adaptive_noise

    def setup():
        d_ov[...] = cp.asarray(ov)
        d_counts[...] = cp.asarray(changes)

    def launch():
        b.launch(
            "update_overlay",
            ((n + 255) // 256,),
            (256,),
            ov=d_ov,
            counts=d_counts,
            n=n,
            inc=a.inc,
            dec=a.dec,
        )

    def reference():
        return update_overlay(b.cfg, ov, changes)

    def result():
        return d_ov.get()

    return setup, launch, reference, result, n * (1 + 4) * 2


def check_choose_token(b):
    cp, v = b.cp, b.cfg.model.vocab_size
    logits = b.ints(-(2**14), 2**14, v) << b.cfg.quantization.shift_logit
    history = b.ints(0, v, 40)
    tokens = np.zeros(41, np.int32)
    tokens[:40] = history
    d_g, d_tokens = cp.asarray(logits), cp.asarray(tokens)
    penalty, min_p_limit = sampler_limits(b.cfg)
    seed, t = int(b.rng.integers(2**32)), 39
    d_seed = cp.asarray(np.array([seed], np.uint32))

    def setup():
        d_tokens[...] = cp.asarray(tokens)

    def launch():
        b.launch(
            "choose_token",
            (1,),
            (b.plan.defines["CT_THREADS"],),
            g=d_g,
            tokens=d_tokens,
            t=t,
            seed=d_seed,
            penalty=penalty,
            temperature=b.cfg.sampling.temperature,
            min_p_limit=min_p_limit,
            exp_tab=b.forward.exp,
        )

    def reference():
        lgt = logits.astype(np.int64) >> b.cfg.quantization.shift_logit
        return choose_token(
            b.cfg, b.tables, lgt, history.astype(np.int64), seed, t, scan_order(b.cfg)
        )

    def result():
        return int(d_tokens.get()[t + 1])

    return setup, launch, reference, result, logits.nbytes + tokens.nbytes


UNIT_FACTORS = (*UNIT_TWINS, "down_residual_sm90", "o_residual_sm90", "up_gelu_sm90")
CHECKS = {name[6:]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}
del CHECKS["optimizer"]  # the two above, by kind
# The fused kernels' checks again with every overlay byte at 64 or more (run's
# Bench.use_overlays): every adaptive factor 1, their input dots by unit factors (in
# the kernel itself, or in its twin of that name: gpu/plan.py's UNIT_TWINS)
CHECKS |= {f"{name}_unit": CHECKS[name] for name in UNIT_FACTORS}
assert all(twin == f"{name}_unit" for name, twin in UNIT_TWINS.items())
# Kernels with no check of their own here, and what covers them
UNCHECKED = {
    "cached_attention": "tests/test_gpu.py's generations against the CPU",
    "gather_pieces": "every sm90a check (they read the weights' copies it makes)",
    "gather_bytes": "check_down_residual_sm90 and the MLP's cuBLAS path after up_gelu_sm90",
}
assert set(KERNELS) <= set(CHECKS) | set(UNCHECKED), set(KERNELS) - set(CHECKS)


def equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return np.array_equal(np.asarray(a), np.asarray(b))


def run(
    cfg: Config,
    names,
    members: int,
    repeats: int,
    out=print,
    defines=None,
    check=True,
    energy_s: float = 0.0,
) -> bool:
    b = Bench(cfg, members, defines=defines)
    bandwidth = b.cp.cuda.runtime.getDeviceProperties(0)
    peak = 2 * bandwidth["memoryClockRate"] * 1e3 * bandwidth["memoryBusWidth"] / 8 / 1e9
    ok = True
    verdict = {True: "ok", False: "MISMATCH", None: "unchecked"}
    for name in names:
        kernel = name.removesuffix("_near").removesuffix("_unit")
        if kernel.endswith("_sm90") and kernel not in b.launch.kernels:  # Hopper's, elsewhere
            out(f"{name:16s} not built for this device")
            continue
        if kernel.endswith("_sm90") and kernel not in b.plan.shared:
            # launched, it would read and write past the shared memory it was given
            out(f"{name:16s} not used at this config: its tiles or its values do not fit")
            continue
        b.use_overlays(unit=name.endswith("_unit"))
        setup, launch, reference, result, moved = CHECKS[name](b)
        setup()
        b.forward.head_blocks = b.forward.loss_rows = 0
        b.forward.head_again.fill(0)
        b.forward.loss_again.fill(0)
        launch()
        good = equal(result(), reference()) if check else None  # then timed on what it left
        again = b.forward.head_again_shares() or {}  # one_pass.py; sequence_loss's
        ms = time_calls(b, launch, repeats)
        gbs = moved / ms / 1e6
        out(
            f"{name:16s} {verdict[good]:9s} {ms:8.3f} ms  {gbs:7.1f} GB/s "
            f"({100 * gbs / peak:4.1f}% of {peak:.0f})"
            + (
                f"  swept twice {again['swept_twice']:.1%},"
                f" rows summed again {again['rows_summed_again']:.2%}"
                if "swept_twice" in again
                else ""
            )
            + (
                f"  rows read twice {again['rows_read_twice']:.2%}"
                if "rows_read_twice" in again
                else ""
            )
        )
        if energy_s > 0:
            out(" " * 17 + energy_line(b, launch, ms, energy_s))
        ok &= good is not False
    return ok


def time_calls(b: Bench, launch, repeats: int) -> float:
    """Milliseconds a call over `repeats` calls back to back."""
    start, end = b.cp.cuda.Event(), b.cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        launch()
    end.record()
    end.synchronize()
    return b.cp.cuda.get_elapsed_time(start, end) / repeats


def energy_line(b: Bench, launch, ms: float, seconds: float) -> str:
    """The kernel in a loop of about `seconds` (at least 3), long enough for the card to
    reach its power limit and settle its clock: the call's time in the loop, the mean
    power and clock from 1.5 s in (power.draw averages the second before it), and so
    its energy a call."""
    from power import Sampler

    seconds = max(seconds, 3.0)
    with Sampler() as sampler:
        began = time.time()
        loop_ms = time_calls(b, launch, max(1, round(1e3 * seconds / ms)))
        ended = time.time()
    card = sampler.mean(began + 1.5, ended)
    if card is None:
        return "energy: no power samples (no nvidia-smi?)"
    line = (
        f"in a {ended - began:.1f} s loop {loop_ms:.3f} ms, {card['watts']:.0f} W at"
        f" {card['sm_clock_mhz']:.0f} MHz, {card['temperature_c']:.0f} C:"
        f" {card['watts'] * loop_ms:.1f} mJ a call"
    )
    if loop_ms > 1.5 * ms:  # the host's launches, not the kernel, set the loop's pace
        line += " (the loop waited for its launches: too short a kernel to tell)"
    return line


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("names", nargs=-1, type=click.Choice(sorted(CHECKS)))
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    help="model shape (default: hidden 256, 1 layer, seq 64, vocab 8192)",
)
@click.option("--members", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True)
@define_option("compile a kernel variant: replace a -D value (ATT_SPLIT=4, ...)")
@click.option(
    "--energy",
    "energy_s",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    default=0.0,
    help="also run each kernel in a loop of about SECONDS: its power, clock and energy a call",
)
@click.option(
    "--no-check",
    is_flag=True,
    help="time only: the CPU reference of thousands of members takes minutes",
)
def main(names, config_path, members, repeats, defines, energy_s, no_check):
    cfg = load_config(config_path) if config_path else SMALL
    overrides = parse_defines(defines)
    ok = run(
        cfg,
        names or sorted(CHECKS),
        members,
        repeats,
        defines=overrides,
        check=not no_check,
        energy_s=energy_s,
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
