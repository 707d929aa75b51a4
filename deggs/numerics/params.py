"""Every int8 parameter of the model, in one table.

Each row says what a parameter is: its shape, where its noise comes from, how it starts,
which adaptive-noise overlays it has and how print-arch shows it. Everything else is
derived from the table: the parameter and overlay shapes, the initial weights' order, the
forward pass's seed offsets, the update plan, the parameter table and the GPU's list of
matrices. Adding a parameter means adding a row here and using it in the forward pass.

Shapes are written with the dimension names "d" (hidden_dim), "4d" and "v" (vocab_size).
Matrices are W[in, out]. A member's noise for a parameter is drawn from two seeds, the
member's seed plus the parameter's offsets: `a` over the outputs (or a vector's entries)
and `b` over the inputs; a per-layer parameter's offsets also get layer * LAYER_STRIDE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config

LAYER_STRIDE = 1000  # seed offset between the layers' copies of a parameter
GATE_SEED = 100000  # adaptive noise mode 2 draws its gate from noise offset + GATE_SEED


@dataclass(frozen=True)
class Param:
    name: str
    title: str  # as print-arch lists it
    dims: tuple[str, ...]  # one layer's logical shape
    seed: int  # seed offset of the `a` noise (include/config.h's SEED_OFF_*)
    per_layer: bool = False
    fill: int | None = 0  # initial value; None: drawn from the xorshift32 stream
    bias_lr: bool = False  # learning rate times optimizer.bias_lr_scale
    b_after: str = "1"  # `b` noise's offset from `a`: 1, or a dimension name
    overlay_names: tuple[str, ...] = ()  # (in, out) for a matrix; default <name>_row, _col
    shown_dims: tuple[str, ...] = ()  # print-arch's dimensions, where they differ

    @property
    def is_matrix(self) -> bool:
        return len(self.dims) == 2

    @property
    def overlays(self) -> tuple[str, ...]:
        """A matrix has an overlay over its inputs and one over its outputs, a vector one."""
        if self.overlay_names:
            return self.overlay_names
        return (f"{self.name}_row", f"{self.name}_col") if self.is_matrix else (self.name,)


_NORM = 16  # 1.0 in the default Q.4 fixed point: the reference starts every norm there

PARAMS: tuple[Param, ...] = (
    # The embedding is W[hidden, vocab], tied with the output head. print-arch shows it in
    # the reference's [vocab, hidden] storage order; its input noise sits hidden_dim
    # entries after its output noise, and its "row" overlay runs over the vocabulary.
    Param(
        "embedding",
        "Embedding",
        ("d", "v"),
        0,
        fill=None,
        b_after="d",
        overlay_names=("embedding_col", "embedding_row"),
        shown_dims=("v", "d"),
    ),
    Param("emb_bias", "Embedding Bias", ("d",), 50, bias_lr=True),
    Param("ln_init", "LN Init", ("d",), 500, fill=_NORM),
    Param("ln_init_bias", "LN Init Bias", ("d",), 502),
    Param("w_emb_mlp_up", "Emb MLP Up", ("d", "4d"), 510, fill=None),
    Param("mlp_emb_bias_up", "Emb MLP Bias Up", ("4d",), 514),
    Param("w_emb_mlp_down", "Emb MLP Down", ("4d", "d"), 512, fill=None),
    Param("mlp_emb_bias_down", "Emb MLP Bias Down", ("d",), 516),
    Param("ln_1", "LN 1", ("d",), 100, per_layer=True, fill=_NORM),
    Param("ln_1_bias", "LN 1 Bias", ("d",), 110, per_layer=True),
    Param("w_q", "W_Q", ("d", "d"), 200, per_layer=True, fill=None),
    Param("w_k", "W_K", ("d", "d"), 202, per_layer=True, fill=None),
    Param("w_v", "W_V", ("d", "d"), 204, per_layer=True, fill=None),
    Param("w_o", "W_O", ("d", "d"), 206, per_layer=True, fill=None),
    Param("ln_2", "LN 2", ("d",), 300, per_layer=True, fill=_NORM),
    Param("ln_2_bias", "LN 2 Bias", ("d",), 310, per_layer=True),
    Param("w_up", "W_Up", ("d", "4d"), 400, per_layer=True, fill=None),
    Param("mlp_bias_up", "MLP Bias Up", ("4d",), 410, per_layer=True),
    Param("w_down", "W_Down", ("4d", "d"), 402, per_layer=True, fill=None),
    Param("mlp_bias_down", "MLP Bias Down", ("d",), 412, per_layer=True),
    Param("ln_f", "LN Final", ("d",), 900, fill=_NORM),
    Param("ln_f_bias", "LN Final Bias", ("d",), 910),
)
PARAM = {p.name: p for p in PARAMS}
MATRICES = tuple(p.name for p in PARAMS if p.is_matrix)


@dataclass(frozen=True)
class Mlp:
    """The parameters of one MLP block: the initial one, or a layer's."""

    ln: str
    ln_bias: str
    up: str
    bias_up: str
    down: str
    bias_down: str


EMB_MLP = Mlp(
    "ln_init",
    "ln_init_bias",
    "w_emb_mlp_up",
    "mlp_emb_bias_up",
    "w_emb_mlp_down",
    "mlp_emb_bias_down",
)
LAYER_MLP = Mlp("ln_2", "ln_2_bias", "w_up", "mlp_bias_up", "w_down", "mlp_bias_down")


def sizes(cfg: Config) -> dict[str, int]:
    d = cfg.model.hidden_dim
    return {"1": 1, "d": d, "4d": 4 * d, "v": cfg.model.vocab_size}


def offsets(cfg: Config, name: str, layer: int | None = None) -> tuple[int, int]:
    """Seed offsets (a, b) of a parameter's noise: a over outputs or entries, b over inputs."""
    p = PARAM[name]
    if p.per_layer != (layer is not None):
        raise ValueError(f"{name} is {'' if p.per_layer else 'not '}a per-layer parameter")
    a = p.seed + (layer or 0) * LAYER_STRIDE
    return a, a + sizes(cfg)[p.b_after]


@dataclass(frozen=True)
class Slice:
    """One parameter, or one layer's copy of a per-layer parameter: what an update walks."""

    param: Param
    layer: int | None
    shape: tuple[int, ...]  # of the slice
    off_a: int
    off_b: int

    @property
    def name(self) -> str:
        return self.param.name

    @property
    def index(self) -> tuple:
        """Selects the slice from the whole array (`array[s.index]` is a view)."""
        return () if self.layer is None else (self.layer,)


def param_slices(cfg: Config) -> list[Slice]:
    """Every parameter slice in the reference's order: the parameters before the layers,
    each layer's, then the ones after (the order the initial weights are drawn in)."""
    n = sizes(cfg)
    first = next(i for i, p in enumerate(PARAMS) if p.per_layer)
    last = max(i for i, p in enumerate(PARAMS) if p.per_layer) + 1
    order: list[tuple[Param, int | None]] = [(p, None) for p in PARAMS[:first]]
    order += [(p, layer) for layer in range(cfg.model.n_layers) for p in PARAMS[first:last]]
    order += [(p, None) for p in PARAMS[last:]]
    return [
        Slice(p, layer, tuple(n[k] for k in p.dims), *offsets(cfg, p.name, layer))
        for p, layer in order
    ]


def _full(cfg: Config, p: Param, shape: tuple[int, ...]) -> tuple[int, ...]:
    return ((cfg.model.n_layers,) if p.per_layer else ()) + shape


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every int8 parameter with its logical shape (a leading layer axis where per-layer)."""
    n = sizes(cfg)
    return {p.name: _full(cfg, p, tuple(n[k] for k in p.dims)) for p in PARAMS}


def overlay_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Adaptive-noise overlays: one int8 per matrix input and output, one per vector entry."""
    n = sizes(cfg)
    return {
        name: _full(cfg, p, (n[dim],))
        for p in PARAMS
        for name, dim in zip(p.overlays, p.dims, strict=True)
    }


def parameter_table(cfg: Config) -> list[tuple[str, str, int]]:
    """(component, dims, params) rows in the order print-arch shows them."""
    n = sizes(cfg)
    rows = []
    for p in PARAMS:
        dims = "[" + ", ".join(str(n[k]) for k in (p.shown_dims or p.dims)) + "]"
        count = math.prod(n[k] for k in p.dims)
        if p.per_layer:
            rows.append((f"  {p.title} (x{cfg.model.n_layers})", dims, count * cfg.model.n_layers))
        else:
            rows.append((p.title, dims, count))
    return rows


# The activations whose health a worker reports beside every parameter slice (health.py).
HEALTH_ACTIVATIONS = ("act.embedding", "act.final_norm")


def health_entries(cfg: Config) -> int:
    """How many entries a model's health report has (every slice of the table and the
    activations): the most a coordinator accepts."""
    return len(param_slices(cfg)) + len(HEALTH_ACTIVATIONS)


def macs_per_token(cfg: Config) -> int:
    """int8 multiply-adds one member's token costs in the forward pass: every matrix of
    the table once (the embedding as the head's matrix; its lookup costs none), and each
    layer's causal attention, scores and mix over (seq_len + 1) / 2 positions on average."""
    m = cfg.model
    n = sizes(cfg)
    matrices = sum(
        n[p.dims[0]] * n[p.dims[1]] * (m.n_layers if p.per_layer else 1)
        for p in PARAMS
        if p.is_matrix
    )
    return matrices + m.n_layers * m.hidden_dim * (m.seq_len + 1)
