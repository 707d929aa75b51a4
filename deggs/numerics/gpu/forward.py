"""The forward pass on the device: row buffers, and one launcher a kernel of the forward
(model.py's functions, fused as forward.cu and the sm90a files fuse them).

A `Batch` is what every kernel of the forward runs on: the row buffers, the members'
seeds and signs, how many members and positions. scripts/kernels.py checks each
launcher below alone against its CPU reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...config import Config
from ..params import EMB_MLP, LAYER_MLP, Mlp
from .cuda import DeviceArray, Launcher, cp
from .one_pass import exp_bounds
from .plan import UNIT_TWINS, Plan, up_gelu_sm90_threads
from .state import QKV, DeviceState

FORWARD_BUDGET = 16 << 30  # bytes of a forward sub-batch's row buffers (Forward.batch)


def seeds_in_pairs(seeds: np.ndarray) -> bool:
    """Whether members 2k and 2k + 1 of a batch share their seed, as an antithetic pair's
    do: head_loss_sm90 keeps its output noise a pair (tiles.cuh's tile_noise, by_pair).
    A chunk's members are whole pairs; a sub-batch starting mid-pair is not."""
    return np.array_equal(seeds[0 : len(seeds) - 1 : 2], seeds[1::2])


@dataclass(frozen=True)
class Norm:
    """A standard_norm: its weight and bias (parameter names) of a layer (None: not per
    layer), and the matrices that read its output next, whose input dots it computes."""

    weight: str
    bias: str
    layer: int | None
    readers: tuple[str, ...]


def row_fields(cfg: Config, plan: Plan) -> dict[str, tuple[int, type]]:
    """A row's elements and dtype in each row buffer but the products ("g")."""
    d = cfg.model.hidden_dim
    return dict(
        x=(d, np.int8),  # the residual stream
        y=(4 * d, np.int8),  # a norm's or a block's output, the next GEMM's input
        # up_gelu_sm90's output: y holds its input, rows other blocks still read
        hidden=(4 * d if plan.fused_up else 0, np.int8),
        sb=(3, np.int32),  # input dots of the matrices reading y (q, k, v: three)
        sbd=(1, np.int32),  # the input dot of the o- or down-projection
        qkv=(3 * d, np.int8),  # q, k, v, [3, rows, hidden]
    )


@dataclass(frozen=True)
class Rows:
    """Row buffers of `n` rows (row_fields), and `g`: int32 words for their products or
    logits."""

    n: int
    x: DeviceArray
    y: DeviceArray
    hidden: DeviceArray
    sb: DeviceArray
    sbd: DeviceArray
    qkv: DeviceArray
    g: DeviceArray

    @classmethod
    def make(cls, cfg: Config, plan: Plan, n: int, words: int) -> Rows:
        fields = {name: cp.empty(n * k, t) for name, (k, t) in row_fields(cfg, plan).items()}
        return cls(n=n, g=cp.empty(words, cp.int32), **fields)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, k).nbytes for k in ("x", "y", "hidden", "sb", "sbd", "qkv", "g"))


@dataclass(frozen=True)
class Batch:
    """What a forward kernel runs on: `members` rows of `positions` each in `rows`, with
    the members' seeds (uint32) and signs (int32: +1, -1, 0 for the unperturbed model)."""

    rows: Rows
    seeds: DeviceArray
    signs: DeviceArray
    members: int
    positions: int

    @property
    def n_rows(self) -> int:
        return self.members * self.positions


@dataclass(frozen=True)
class Cache:
    """Generation's key/value cache: per layer (keys, values), flat [position, hidden];
    the batch's rows are positions start.. of one unperturbed sequence; `rope` the RoPE
    table (int32, flat) covering them."""

    layers: list
    start: int
    rope: DeviceArray


class Forward:
    """The forward pass of the plan's kernels over the weights of `state`."""

    def __init__(
        self,
        cfg: Config,
        plan: Plan,
        launch: Launcher,
        state: DeviceState,
        tables,
        batch: int | None,
        budget: int,
        sms: int,
    ):
        self.cfg, self.plan, self.launch, self.state = cfg, plan, launch, state
        self.exp = cp.asarray(tables.exp.astype(np.int32))
        self.exp_bounds = cp.asarray(exp_bounds(tables.exp, plan.defines["EXP_LAST"]))
        # head_loss_sm90's blocks; of them, those that swept twice and the open rows
        # summed again on the CUDA cores (one_pass.py); every launch since made
        self.head_blocks, self.head_again = 0, cp.zeros(2, cp.uint64)
        # sequence_loss's rows, and of them those read twice (forward.cu); every launch since
        self.loss_rows, self.loss_again = 0, cp.zeros(1, cp.uint64)
        self.gelu = cp.asarray(tables.gelu.astype(np.int32))
        self.rope = cp.asarray(tables.rope.astype(np.int32).ravel())
        self.rope_positions = tables.rope.shape[0]
        self.fixed_batch, self.budget = batch, budget
        self.nt = plan.defines["NT"]  # threads of the row kernels, as compiled (-D NT=...)
        self.sms = sms  # the device's multiprocessors: residual_sm90's blocks, one an SM
        self._rows: Rows | None = None  # the training buffers, made on first use

    # --- sub-batches and their buffers ----------------------------------------------

    @property
    def batch(self) -> int:
        """Members a forward sub-batch of training: as given, else as many as keep its
        row buffers within the budget, an even number (whole antithetic pairs: see
        seeds_in_pairs). Where every projection is fused no int32 product is written
        (`product_words`), and at the default config a chunk is one sub-batch, one
        launch a kernel."""
        if self.fixed_batch:
            return self.fixed_batch
        if not self.plan.fused:
            return self.logit_batch
        return self._members_within_budget(self.product_words(1, whole=True))

    @property
    def logit_batch(self) -> int:
        """Members a sub-batch whose logits are written (validation, the unfused head)."""
        words = max(self.product_words(1, whole=True), self.cfg.model.vocab_size)
        return self.fixed_batch or self._members_within_budget(words)

    def _members_within_budget(self, words: int) -> int:
        """Members whose row buffers, with `words` int32 product words a row, fit the
        budget: an even number, at least a pair."""
        fields = row_fields(self.cfg, self.plan).values()
        row = 4 * words + sum(n * np.dtype(t).itemsize for n, t in fields)
        return max(2, self.budget // (self.cfg.model.seq_len * row) // 2 * 2)

    def product_words(self, rows: int, whole: bool) -> int:
        """int32 words of the products the forward of `rows` rows writes to memory (a
        row buffer's "g"). On whole members the fused kernels that run write none;
        elsewhere (generation) cuBLAS writes them all."""
        d, plan = self.cfg.model.hidden_dim, self.plan
        widths = [0]
        if not (whole and plan.fused_up):
            widths.append(4 * d)
        if not (whole and plan.fused_qkv):
            widths.append(3 * d)
        if not (whole and plan.o_residual and plan.down_residual):
            widths.append(d)
        return rows * max(widths)

    def rows_for(self, members: int, logits: bool) -> Rows:
        """Row buffers of `members` training members (with room for their logits when
        `logits`), kept and grown as needed."""
        r = members * self.cfg.model.seq_len
        words = max(
            self.product_words(r, whole=True), r * self.cfg.model.vocab_size if logits else 0
        )
        rows = self._rows
        if rows is not None and rows.n >= r and rows.g.size >= words:
            return rows
        self._rows = None  # freed before the new ones are made
        self._rows = Rows.make(self.cfg, self.plan, r, words)
        return self._rows

    def make_rows(self, n: int, words: int) -> Rows:
        """Row buffers of n rows and `words` product words, apart from the kept ones."""
        return Rows.make(self.cfg, self.plan, n, words)

    # --- the passes -----------------------------------------------------------------

    def losses(self, batch: Batch, tokens, loss) -> None:
        """The members' losses into `loss` (head_loss_sm90: members 2k and 2k + 1 share
        their seed, `seeds_in_pairs`, as the backend's sub-batches do)."""
        if self.plan.fused:
            self.hidden(batch, tokens)
            self.head_loss(batch, tokens, loss)
        else:
            self.logits(batch, tokens)
            self.sequence_loss(batch, tokens, loss)

    def logits(self, batch: Batch, tokens) -> None:
        """The forward pass up to the logits (before >> shift) in rows.g."""
        m = self.cfg.model
        self.hidden(batch, tokens)
        table = self.state.param("embedding")[0]
        rows = batch.rows
        self.launch.project(table, rows.y, rows.g, m.vocab_size, batch.n_rows, m.hidden_dim)

    def hidden(self, batch: Batch, tokens, cache: Cache | None = None) -> None:
        """Embedding, blocks and final norm of the batch's rows into rows.y (see
        `attention`). Each block's residual also runs the norm that comes next
        (residual_norm)."""
        layers = range(self.cfg.model.n_layers)
        mlp_norm = lambda names, layer: Norm(names.ln, names.ln_bias, layer, (names.up,))
        norms = [mlp_norm(EMB_MLP, None)]
        for layer in layers:
            norms += [Norm("ln_1", "ln_1_bias", layer, QKV), mlp_norm(LAYER_MLP, layer)]
        norms.append(Norm("ln_f", "ln_f_bias", None, ("embedding",)))
        # the sm90 kernels take rows as whole members of seq_len positions: training's
        whole = cache is None and batch.positions == self.cfg.model.seq_len
        self.embed_norm(batch, tokens, norms[0])
        self.mlp(batch, EMB_MLP, None, norms[1], whole)
        for layer in layers:
            self.attention(batch, layer, norms[2 * layer + 2], cache, whole)
            self.mlp(batch, LAYER_MLP, layer, norms[2 * layer + 3], whole)

    # --- one launcher a kernel ------------------------------------------------------

    def embed_norm(self, batch: Batch, tokens, norm: Norm) -> None:
        """The embedding of the batch's tokens into rows.x, then `norm` of it into rows.y
        and into rows.sb the input dots of norm.readers."""
        table, (ov_hidden, ov_vocab), (emb_a, _) = self.state.param("embedding")
        bias, (ov_bias,), (bias_a, bias_b) = self.state.param("emb_bias")
        self.launch(
            "embed_norm",
            (batch.members,),
            (self.nt,),
            tokens=tokens,
            seeds=batch.seeds,
            signs=batch.signs,
            emb_t=table,
            emb_bias=bias,
            ov_row=ov_vocab,
            ov_col=ov_hidden,
            ov_bias=ov_bias,
            off_emb=emb_a,
            off_bias_a=bias_a,
            off_bias_b=bias_b,
            x=batch.rows.x,
            y=batch.rows.y,
            sb=batch.rows.sb,
            seq=batch.positions,
            rows=batch.n_rows,
            **self.norm_arguments(norm),
        )

    def norm_arguments(self, norm: Norm) -> dict:
        """standard_norm's parameters and the input dots of the matrices that read its
        output next (at most three)."""
        param = self.state.param
        w, (ov_w,), (w_a, w_b) = param(norm.weight, norm.layer)
        b, (ov_b,), (b_a, b_b) = param(norm.bias, norm.layer)
        dots = []
        for name in norm.readers:
            _, (ov_in, _), (_, off_b) = param(name, norm.layer)
            dots.append((ov_in, off_b))
        pad = dots + [(None, 0)] * (3 - len(dots))
        return dict(
            w=w, b=b, ov_w=ov_w, ov_b=ov_b, w_a=w_a, w_b=w_b, b_a=b_a, b_b=b_b,
            ndots=len(dots),
            ov0=pad[0][0], ov1=pad[1][0], ov2=pad[2][0],
            off0=pad[0][1], off1=pad[1][1], off2=pad[2][1],
        )  # fmt: skip

    def mlp(self, batch: Batch, names: Mlp, layer, then: Norm, whole: bool = False) -> None:
        """MLP block of the batch's rows (its norm already in rows.y), then the norm
        `then`. `whole`: the rows are whole members (training), so the up-projection may
        run fused with mlp_up (`up_gelu`) and the down-projection with residual_norm
        (`projection_residual`)."""
        rows, r, d = batch.rows, batch.n_rows, self.cfg.model.hidden_dim
        if self.plan.fused_up and whole:
            self.up_gelu(batch, names, layer)
            hidden = rows.hidden
        else:
            up = self.state.param(names.up, layer)[0]
            self.launch.project(up, rows.y, rows.g, 4 * d, r, d)
            self.mlp_up(batch, names, layer)
            hidden = rows.y
        shift = self.cfg.quantization.shift_mlp_down
        if self.plan.down_residual and whole:
            self.projection_residual(
                batch, "down_residual_sm90", names.down, layer, shift, then, names.bias_down, hidden
            )
        else:
            down = self.state.param(names.down, layer)[0]
            if self.plan.fused_up and whole:  # its inputs in hidden_order, as up_gelu_sm90 wrote
                down = self.state.cores[names.down, layer].out.reshape(d, 4 * d)
            self.launch.project(down, hidden, rows.g, d, r, 4 * d)
            self.residual(batch, names.down, layer, shift, then, names.bias_down)

    def mlp_up_arguments(self, batch: Batch, names: Mlp, layer) -> dict:
        """mlp_up's per-member parameters (the up matrix's output noise, the bias, the
        down matrix's input noise), shared by mlp_up and up_gelu_sm90."""
        param = self.state.param
        _, (_, ov_up_out), (up_a, _) = param(names.up, layer)
        bias, (ov_bias,), (bias_a, bias_b) = param(names.bias_up, layer)
        _, (ov_down_in, _), (_, down_b) = param(names.down, layer)
        return dict(
            seeds=batch.seeds, signs=batch.signs, bias_up=bias, ov_up_out=ov_up_out,
            ov_bias_up=ov_bias, ov_down_in=ov_down_in, up_a=up_a, bias_a=bias_a,
            bias_b=bias_b, down_b=down_b, gelu=self.gelu,
        )  # fmt: skip

    def mlp_up(self, batch: Batch, names: Mlp, layer) -> None:
        """rows.g (the up-projection) -> GELU'd hidden in rows.y, the down-projection's
        input dot in rows.sbd."""
        rows = batch.rows
        self.launch(
            "mlp_up",
            (batch.members,),
            (self.nt,),
            g=rows.g,
            sb_up=rows.sb,
            hidden=rows.y,
            sb_down=rows.sbd,
            seq=batch.positions,
            **self.mlp_up_arguments(batch, names, layer),
        )

    def up_gelu(self, batch: Batch, names: Mlp, layer) -> None:
        """mlp_up of the up-projection of rows.y (its input dot in rows.sb) without
        writing the projection: the GEMM and mlp_up in one kernel (up_gelu_sm90.cu). The
        GELU'd hidden goes to rows.hidden, the down-projection's input dot to rows.sbd."""
        rows, r, defines = batch.rows, batch.n_rows, self.plan.defines
        self.launch(
            "up_gelu_sm90",
            (-(-r // defines["UP_ROWS"]),),
            (up_gelu_sm90_threads(defines),),
            y=rows.y,
            up_cores=self.state.cores[names.up, layer].out,
            sb_up=rows.sb,
            hidden=rows.hidden,
            sb_down=rows.sbd,
            rows=r,
            **self.mlp_up_arguments(batch, names, layer),
        )

    def residual_arguments(
        self, batch: Batch, matrix: str, layer, then: Norm, bias: str | None = None
    ) -> dict:
        """What residual_norm and the sm90 projections fused with it share: the residual
        (x), its bias, the next norm `then` (into rows.y, its input dots into rows.sb)."""
        b, ov_b, b_a, b_b = None, None, 0, 0
        if bias is not None:
            b, (ov_b,), (b_a, b_b) = self.state.param(bias, layer)
        _, (_, ov_out), (off_a, _) = self.state.param(matrix, layer)
        return dict(
            x=batch.rows.x, seeds=batch.seeds, signs=batch.signs, ov_out=ov_out, off_a=off_a,
            bias=b, ov_bias=ov_b, bias_a=b_a, bias_b=b_b, y=batch.rows.y,
            sb_out=batch.rows.sb, rows=batch.n_rows, **self.norm_arguments(then),
        )  # fmt: skip

    def residual(
        self, batch: Batch, matrix: str, layer, shift: int, then: Norm, bias: str | None = None
    ) -> None:
        """rows.x += (rows.g + the rank-1 term of `matrix`) >> shift [+ bias and its
        noise], max-abs normalised in place (the term's input dot is rows.sbd); then the
        norm `then` of x into rows.y and its input dots into rows.sb."""
        self.launch(
            "residual_norm",
            (batch.members,),
            (self.nt,),
            g=batch.rows.g,
            sb_in=batch.rows.sbd,
            shift=shift,
            seq=batch.positions,
            **self.residual_arguments(batch, matrix, layer, then, bias),
        )

    def projection_residual(
        self,
        batch: Batch,
        kernel: str,
        matrix: str,
        layer,
        shift: int,
        then: Norm,
        bias: str | None = None,
        inputs=None,
        blocks: int | None = None,
    ) -> None:
        """The projection of `inputs` (rows.y by default) by `matrix` (its input dot in
        rows.sbd), then `residual`'s steps, in one kernel: o_residual_sm90 or
        down_residual_sm90 (residual_sm90.cu), `blocks` of them (at most one an SM, by
        default), each taking tiles of RESIDUAL_ROWS rows in turn. No product is written.
        The rows are whole members."""
        rows, r = batch.rows, batch.n_rows
        tile = self.plan.defines["RESIDUAL_ROWS"]
        if len(then.readers) not in (1, 3):  # the kernels' two dot counts
            raise ValueError(f"{kernel}: a norm read by {len(then.readers)} matrices")
        self.launch(
            kernel,
            (blocks or min(self.sms, -(-r // tile)),),
            (2 * tile,),  # two warpgroups of 64 rows
            inputs=rows.y if inputs is None else inputs,
            w_cores=self.state.cores[matrix, layer].out,
            sb=rows.sbd,
            shift=shift,
            **self.residual_arguments(batch, matrix, layer, then, bias),
        )

    def attention(
        self, batch: Batch, layer, then: Norm, cache: Cache | None = None, whole: bool = False
    ) -> None:
        """Attention block of the batch's rows (its norm already in rows.y), then the
        norm `then`; with a cache, the rows are positions cache.start.. of one
        unperturbed sequence. `whole`: the rows are whole members (training), so q, k
        and v may come from qkv_rope_sm90."""
        rows, r, d = batch.rows, batch.n_rows, self.cfg.model.hidden_dim
        if self.plan.fused_qkv and whole:
            self.qkv_rope_sm90(batch, layer)
        else:
            qkv = self.state.qkv[layer]
            self.launch.project(qkv, rows.y, rows.g, 3 * d, r, d)  # [rows, q | k | v]
            if cache is None:
                self.qkv_rope(batch, layer)
            else:
                self.qkv_rope(batch, layer, cache.rope, cache.start)
        if cache is None:
            self.attention_mix(batch, layer, self.plan.tensor_attention)
        else:
            self.cached_attention(batch, cache.layers[layer], cache.start)
        shift = self.cfg.quantization.shift_out
        if self.plan.o_residual and whole:
            self.projection_residual(batch, "o_residual_sm90", "w_o", layer, shift, then)
        else:
            self.launch.project(self.state.param("w_o", layer)[0], rows.y, rows.g, d, r, d)
            self.residual(batch, "w_o", layer, shift, then)

    def qkv_parts(self, batch: Batch):
        """q, k and v of the batch's rows in rows.qkv."""
        qkv, rd = batch.rows.qkv, batch.n_rows * self.cfg.model.hidden_dim
        return qkv[:rd], qkv[rd : 2 * rd], qkv[2 * rd : 3 * rd]

    def qkv_arguments(self, batch: Batch, layer) -> dict:
        """qkv_rope's per-member parameters (the output noise of q, k and v), shared by
        qkv_rope and qkv_rope_sm90."""
        (_, (_, ov_q), (q_a, _)), (_, (_, ov_k), (k_a, _)), (_, (_, ov_v), (v_a, _)) = (
            self.state.param(w, layer) for w in QKV
        )
        return dict(
            sb=batch.rows.sb, out=batch.rows.qkv, seeds=batch.seeds, signs=batch.signs,
            ov_q=ov_q, ov_k=ov_k, ov_v=ov_v, q_a=q_a, k_a=k_a, v_a=v_a, rows=batch.n_rows,
        )  # fmt: skip

    def qkv_rope(self, batch: Batch, layer, rope=None, start: int = 0) -> None:
        """rows.g ([rows, q | k | v]) -> RoPE'd, normalised q, k, v in rows.qkv; the rows
        at positions start.. of the RoPE table `rope` (training's by default)."""
        table = self.rope if rope is None else rope
        self.launch(
            "qkv_rope",
            (batch.members,),
            (self.nt,),
            g=batch.rows.g,
            rope_tab=table[start * self.cfg.model.head_dim :],
            seq=batch.positions,
            **self.qkv_arguments(batch, layer),
        )

    def qkv_rope_sm90(self, batch: Batch, layer) -> None:
        """qkv_rope of the q, k, v projections of rows.y (their input dots in rows.sb)
        without writing them: the GEMM and qkv_rope in one kernel (qkv_rope_sm90.cu); the
        rows are whole members, from position 0."""
        qkv_rows = self.plan.defines["QKV_ROWS"]
        self.launch(
            "qkv_rope_sm90",
            (-(-batch.n_rows // qkv_rows),),
            (2 * qkv_rows,),  # a warpgroup of 128 threads for 64 rows
            y=batch.rows.y,
            w_cores=self.state.cores["qkv", layer].out,
            rope_tab=self.rope,
            **self.qkv_arguments(batch, layer),
        )

    def attention_mix(self, batch: Batch, layer, tensor_cores: bool = False) -> None:
        """q, k, v of rows.qkv -> mixed values in rows.y, their o-input dot in rows.sbd:
        attention_mix on CUDA cores, attention_mma on the tensor cores."""
        rows = batch.rows
        q, k, v = self.qkv_parts(batch)
        _, (ov_o_in, _), (_, o_b) = self.state.param("w_o", layer)
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(rows.sbd.data.ptr, 0, batch.n_rows * 4, stream)
        items = batch.members * self.cfg.model.n_heads
        extra = {}
        if tensor_cores:  # resident blocks taking (member, head) items in turn
            if not self.plan.tensor_attention:
                raise ValueError("attention_mma does not run this config (plan.tensor_attention)")
            name, threads = "attention_mma", 32 * self.plan.defines["ATT_WARPS"]
            grid: tuple[int, ...] = (min(items, self.sms * self.plan.attention_per_sm),)
            extra["items"] = items
        else:
            name, grid = "attention_mix", (batch.members, self.cfg.model.n_heads)
            threads = (self.plan.defines["ATT_SPLIT"] * batch.positions + 31) // 32 * 32
        twin = UNIT_TWINS.get(name)  # launched beside it; of the two, one runs
        for kernel in (name, twin) if twin else (name,):
            self.launch(
                kernel,
                grid,
                (threads,),
                q=q,
                k=k,
                v=v,
                mixed=rows.y,
                sb_o=rows.sbd,
                seeds=batch.seeds,
                ov_o_in=ov_o_in,
                o_b=o_b,
                exp_tab=self.exp,
                **extra,
            )

    def cached_attention(self, batch: Batch, cache, start: int) -> None:
        """Generation (sign 0: the o-projection's input dot is never used): keys and values
        (`cache`, the layer's) join the cache, the rows attend over it."""
        seq, d = batch.positions, self.cfg.model.hidden_dim
        q, k, v = self.qkv_parts(batch)
        keys, values = cache
        keys[start * d : (start + seq) * d] = k
        values[start * d : (start + seq) * d] = v
        self.launch(
            "cached_attention",
            (seq, self.cfg.model.n_heads),
            (128,),
            q=q,
            k_cache=keys,
            v_cache=values,
            mixed=batch.rows.y,
            pos0=start,
            exp_tab=self.exp,
            shared_mem=4 * (start + seq),  # a word a visible key
        )

    def sequence_loss(self, batch: Batch, tokens, loss) -> None:
        """sequence_loss of the logits in rows.g (their input dot in rows.sb)."""
        _, (_, ov_vocab), (off_a, _) = self.state.param("embedding")
        self.launch(
            "sequence_loss",
            (batch.members,),
            (self.nt,),
            g=batch.rows.g,
            sb=batch.rows.sb,
            tokens=tokens,
            seeds=batch.seeds,
            signs=batch.signs,
            ov_out=ov_vocab,
            off_a=off_a,
            exp_tab=self.exp,
            loss=loss,
            again=self.loss_again,
        )
        self.loss_rows += batch.n_rows

    def head_again_shares(self) -> dict | None:
        """Of head_loss_sm90's blocks so far, the share that swept the vocabulary twice,
        and of their rows the share summed again on the CUDA cores; of sequence_loss's
        rows, the share read twice (None: neither ran)."""
        shares: dict[str, float] = {}
        if self.head_blocks:
            twice, rows = (int(x) for x in self.head_again.get())
            rows_at_most = self.head_blocks * self.plan.tile_rows("head_loss_sm90")
            shares.update(swept_twice=twice / self.head_blocks)
            shares.update(rows_summed_again=rows / rows_at_most)
        if self.loss_rows:
            shares.update(rows_read_twice=int(self.loss_again.get()[0]) / self.loss_rows)
        return shares or None

    def head_loss(self, batch: Batch, tokens, loss, kernel: str | None = None) -> None:
        """sequence_loss of the logits of rows.y (the final norm, input dot in rows.sb)
        without writing them: the head's GEMM and the loss in one kernel (`kernel`, by
        default the plan's)."""
        table, (_, ov_vocab), (off_a, _) = self.state.param("embedding")
        kernel = kernel or self.plan.head
        sm90 = kernel == "head_loss_sm90"
        tile_rows = self.plan.tile_rows(kernel)
        blocks = -(-batch.n_rows // tile_rows)
        sm90_args = {}
        if sm90:
            sm90_args = dict(
                emb_cores=self.state.cores["embedding", None].out,
                exp_bounds=self.exp_bounds,
                again=self.head_again,
            )
            self.head_blocks += blocks
        loss.fill(0)  # rows add to their member's loss
        self.launch(
            kernel,
            (blocks,),
            (tile_rows * (2 if sm90 else 1),),  # sm90: warpgroups
            y=batch.rows.y,
            emb_t=table,
            **sm90_args,
            sb=batch.rows.sb,
            tokens=tokens,
            seeds=batch.seeds,
            signs=batch.signs,
            ov_out=ov_vocab,
            off_a=off_a,
            exp_tab=self.exp,
            loss=loss.view(cp.uint32),
            rows=batch.n_rows,
        )
