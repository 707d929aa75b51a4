"""The kernel plan: which kernels run a config on a device, compiled how, with how much
shared memory. Pure functions of (config, device figures): no CuPy, no GPU, so that
tests/test_plan.py checks every choice on a machine without one.

Two steps, because one figure comes from the compiler:
1. `kernel_defines(cfg, device)`: the -D values the sources are compiled with (the
   config's shapes and constants, the launch constants below, and the few choices
   sized against the device's shared memory: EXP_COPIES, UP_BLOCKS).
2. `make_plan(cfg, device, defines, static, ...)`: after compiling, with each kernel's
   static shared memory as the compiled function reports it (`static`), the kernel
   choices and the dynamic shared memory each kernel is launched with.

A kernel's dynamic shared memory (what its launch passes) is the layout function of
its .cu file below (`head_loss_layout` for head_loss.cu, ...); its static shared memory
is the compiler's figure, never mirrored here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ...config import Config
from ..model import make_tables
from ..params import GATE_SEED
from ..sampling import SAMPLE_STRIDE

# Every kernel and the file that defines it. The "main" program is compiled for the
# device's own architecture; "sm90a" (Hopper's warpgroup MMAs) for sm_90a, on an H100 or
# H200 only. A kernel's launcher calls it by this name (deggs/numerics/launch.py checks
# the arguments against the signature in the file).
KERNELS: dict[str, str] = {
    "embed_norm": "forward.cu",
    "qkv_rope": "forward.cu",
    "attention_mix": "forward.cu",
    "residual_norm": "forward.cu",
    "mlp_up": "forward.cu",
    "sequence_loss": "forward.cu",
    "attention_mma": "attention.cu",
    "attention_mma_unit": "attention.cu",
    "head_loss": "head_loss.cu",
    "cached_attention": "generate.cu",
    "choose_token": "generate.cu",
    "noise_matrix": "update.cu",
    "vector_votes": "update.cu",
    "update_overlay": "update.cu",
    "gather_pieces": "update.cu",
    "gather_bytes": "update.cu",
    "adamw_step": "optimizer.cu",
    "sgd_step": "optimizer.cu",
    "head_loss_sm90": "head_loss_sm90.cu",
    "up_gelu_sm90": "up_gelu_sm90.cu",
    "qkv_rope_sm90": "qkv_rope_sm90.cu",
    "o_residual_sm90": "residual_sm90.cu",
    "down_residual_sm90": "residual_sm90.cu",
}
# Kernels with a twin compiled for unit factors (common.cuh): gpu/forward.py launches
# both with the same arguments, and only the one whose case the overlays are runs (the
# other returns after its blocks' vote, some 5 us). Apart, each has registers of its own.
UNIT_TWINS = {
    "attention_mma": "attention_mma_unit",
}
SM90_FILES = ("head_loss_sm90.cu", "up_gelu_sm90.cu", "qkv_rope_sm90.cu", "residual_sm90.cu")
PROGRAMS: dict[str, tuple[str, ...]] = {
    "main": tuple(dict.fromkeys(f for f in KERNELS.values() if f not in SM90_FILES)),
    "sm90a": SM90_FILES,
}

NT = 256  # threads of the row kernels
ATT_SPLIT = 2  # attention_mix: threads per query, each accumulating 1/ATT_SPLIT of a head
ATT_WARPS = 4  # attention_mma: at most this many warps a block, 16 queries a warp at a time
LOSS_REGISTER_LPT = 16  # sequence_loss keeps up to this many logits a thread in registers
LOSS_BINS = 1024  # past that, sequence_loss's histogram of a row's logits (one read)
TILE_WARPS, TILE_N = 8, 64  # head_loss: 32 rows a warp, vocabulary tiles of 64 embedding rows
# head_loss_sm90: rows a block, four warpgroups; where they do not fit beside two tiles,
# two warpgroups whose registers hold the rows (up to hidden 1024: 128 registers a thread)
HEAD_ROWS, WIDE_HEAD_ROWS, WIDE_HEAD_HIDDEN = 256, 128, 1024
UP_ROWS = 64  # up_gelu_sm90: rows a block, one warpgroup of 64 or two of 32 (UP_WG_ROWS)
QKV_ROWS = 64  # qkv_rope_sm90: rows a block, one warpgroup
RESIDUAL_ROWS = 128  # residual_sm90: rows a tile, two warpgroups of 64
SLICE, SLICE_STAGES = 128, 4  # residual_sm90: bytes of K a pipeline stage holds, stages
# vector_votes: seeds a block, the most a cluster's seed offsets differ, slices a cluster
VOTE_TILE, VOTE_SPAN, VOTE_PARAMS = 512, 4096, 32
MAX_THREADS = 1024  # per block, on every CUDA device
STATIC_SHARED = 48 << 10  # a kernel may use more shared memory only when it opts in
STATIC_ROOM = 1 << 10  # room left beside a layout for its kernel's static shared memory


@dataclass(frozen=True)
class Device:
    """What the plan needs of a device, read from it (cuda.device_figures)."""

    shared_optin: int  # cudaDevAttrMaxSharedMemoryPerBlockOptin: one block's most
    shared_per_sm: int  # cudaDevAttrMaxSharedMemoryPerMultiprocessor
    reserved_per_block: int  # cudaDevAttrReservedSharedMemoryPerBlock
    sms: int  # cudaDevAttrMultiProcessorCount
    hopper: bool  # compute capability 9.0: sm_90a's warpgroup MMAs


# An H100 SXM's figures (an H200's are the same but for its 132 SMs' memory), for
# planning without a GPU: tests and docs.
H100 = Device(
    shared_optin=232448, shared_per_sm=233472, reserved_per_block=1024, sms=132, hopper=True
)


def choose_token_threads(hidden: int) -> int:
    """Threads of choose_token: the reference's HIDDEN, or a divisor of it within a block."""
    per = -(-hidden // MAX_THREADS)
    while hidden % per:
        per += 1
    return hidden // per


def av_bytes(cfg: Config) -> int:
    """Bytes of common.cuh's av_t, the output noise held in shared memory: 32 bits in
    adaptive mode 2 (its factor is unbounded), else 16."""
    return 4 if cfg.adaptive_noise.mode == 2 else 2


def row_kernels_shared(cfg: Config) -> dict[str, int]:
    """Dynamic shared memory of the row kernels that take some (forward.cu, generate.cu's
    choose_token), at training shapes: the sizes of their `extern __shared__` arrays."""
    m = cfg.model
    h, v = m.hidden_dim, m.vocab_size
    return {
        "embed_norm": 32 * h,  # s_norm: 8 HIDDEN words
        "attention_mix": 2 * m.seq_len * m.head_dim,  # s_kv: a head's keys and values
        "residual_norm": 32 * h,  # s_norm
        "mlp_up": 16 * 4 * h,  # s_mlp: 4 UP words
        "sequence_loss": av_bytes(cfg) * v,  # s_av_vocab: the vocabulary's output noise
        "choose_token": 4 * ((v + 1) // 2),  # s_count2: two 16-bit counts a word
    }


def kernel_defines(cfg: Config, device: Device) -> dict[str, int]:
    """The -D values the CUDA sources are compiled with: the config's shapes and
    constants, the launch constants of this module, and the choices sized against the
    device's shared memory."""
    q, m = cfg.quantization, cfg.model
    exp = make_tables(cfg).exp
    lut0 = int(exp.max())
    last = exp_last(exp)
    defines = dict(
        HIDDEN=m.hidden_dim,
        HEAD_DIM=m.head_dim,
        SEQ=m.seq_len,
        VOCAB=m.vocab_size,
        FIXED_POINT=q.fixed_point,
        SIGMA_SHIFT=q.sigma_shift,
        SIGMA_SHIFT_VECTOR=q.sigma_shift_vector,
        SHIFT_ATTN=q.shift_attn,
        SHIFT_LOGIT=q.shift_logit,
        SHIFT_MLP_UP=q.shift_mlp_up,
        LUT_SIZE=cfg.softmax.lut_size,
        SCALE_BIT=cfg.softmax.scale_bit,
        ROPE_SHIFT=cfg.rope.scale_bit,
        NOISE_MASK=cfg.noise.perturb_mask,
        THREE_SAMPLE=int(cfg.noise.perturb_distribution == "three_sample"),
        ADAPTIVE_MODE=cfg.adaptive_noise.mode,
        ATTN_ACC_LL=int(m.seq_len * lut0 * 127 >= 2**31),
        GATE_SEED=GATE_SEED,
        SAMPLE_STRIDE=SAMPLE_STRIDE,
        NT=NT,
        ATT_SPLIT=ATT_SPLIT,
        ATT_WARPS=min(ATT_WARPS, -(-m.seq_len // 16)),
        TILE_WARPS=TILE_WARPS,
        TILE_N=TILE_N,
        UP_ROWS=UP_ROWS,
        QKV_ROWS=QKV_ROWS,
        RESIDUAL_ROWS=RESIDUAL_ROWS,
        SLICE=SLICE,
        SLICE_STAGES=SLICE_STAGES,
        VOTE_TILE=VOTE_TILE,
        VOTE_SPAN=VOTE_SPAN,
        VOTE_PARAMS=VOTE_PARAMS,
        EXP_MAX=lut0,
        EXP_LAST=last,
        EXP_COPIES=(copies := exp_copies(cfg, last, device)),
        HEAD_ROWS=(rows := head_rows(cfg, last, copies, device)),
        HEAD_LIVE=int(rows == WIDE_HEAD_ROWS and exp[last] == 0),
        CT_THREADS=choose_token_threads(m.hidden_dim),
        LOSS_REGISTER_LPT=LOSS_REGISTER_LPT,
        LOSS_BINS=LOSS_BINS if loss_bins_work(cfg, exp, last, device) else 0,
    )
    # up_gelu_sm90: its entries packed in one word where 8-byte ones do not fit one
    # block (the static shared memory's kilobyte beside it) and 16 bits hold them (not in
    # mode 2); three blocks an SM where a warpgroup's rows are one member's and three fit
    # the SM's shared memory; else two (with warpgroups of 32 rows, 96 registers: 80
    # spill there, and a cap that no third block uses only slows the kernel); packed, one
    # (at hidden 1024 128 registers spill). A block is one warpgroup of 64 rows where a
    # member is whole groups of 64 rows (167 registers a thread at the default) and the
    # entries are not packed (one warpgroup an SM would be too few), else two of 32.
    wide = not fits_alone(up_gelu_sm90_shared(cfg, defines), device)  # 8-byte entries
    defines["UP_PACK"] = int(wide and cfg.adaptive_noise.mode != 2)
    three = m.seq_len % 32 == 0 and blocks_fit(3, up_gelu_sm90_shared(cfg, defines), device)
    defines["UP_BLOCKS"] = 3 if three else 1 if defines["UP_PACK"] else 2
    defines["UP_WG_ROWS"] = 64 if m.seq_len % 64 == 0 and not defines["UP_PACK"] else 32
    defines["ATT_BUFFERS"] = attention_buffers(cfg, device, defines["ATT_WARPS"])
    return defines


def loss_bins_work(cfg: Config, exp: np.ndarray, last: int, device: Device) -> bool:
    """Whether sequence_loss may read a row once, counting it in LOSS_BINS bins
    (forward.cu): the exp table is 0 from entry `last` on (exp_last), so that a logit that
    far below another adds nothing; logits differ by less than 2^31 (shifted at least
    once); and the bins fit beside the vocabulary's output noise and the table (with a
    kilobyte for the rest of its static shared memory). Else it reads each row twice."""
    shared = row_kernels_shared(cfg)["sequence_loss"] + 4 * (LOSS_BINS + len(exp))
    return (
        exp[last] == 0
        and last < LOSS_BINS
        and cfg.quantization.shift_logit > 0
        and fits_alone(shared, device)
    )


def fits_alone(shared: int, device: Device) -> bool:
    """Whether a block of `shared` bytes of dynamic shared memory fits the device with
    STATIC_ROOM left beside it (make_plan checks the static memory as compiled)."""
    return shared + STATIC_ROOM <= device.shared_optin


def blocks_fit(blocks: int, shared: int, device: Device) -> bool:
    """Whether `blocks` blocks of `shared` bytes each fit one SM's shared memory."""
    return blocks * (shared + device.reserved_per_block) <= device.shared_per_sm


def exp_last(exp: np.ndarray) -> int:
    """The last entry of the exp table that head_loss reads: every entry past the last
    nonzero one is zero, so one of them stands for all (index min(d, EXP_LAST))."""
    nonzero = np.flatnonzero(exp)
    return min(len(exp) - 1, int(nonzero[-1]) + 1) if len(nonzero) else 0


def exp_copies(cfg: Config, last: int, device: Device) -> int:
    """Copies of the table's entries 0..last that the heads interleave, so that lanes
    looking up different entries read different banks: one a lane where two blocks of
    head_loss an SM still fit, else the most that do (a power of two), else one. Where
    head_loss_sm90 runs in wide blocks, those that leave its block room for its static
    shared memory (a kilobyte)."""
    wide = device.hopper and head_rows(cfg, last, 1, device) == WIDE_HEAD_ROWS

    def fit(copies: int) -> bool:
        if wide:
            return fits_alone(head_loss_sm90_layout(cfg, WIDE_HEAD_ROWS, last, copies), device)
        return blocks_fit(2, head_loss_layout(cfg, TILE_WARPS, last, copies), device)

    copies = 32
    while copies > 1 and not fit(copies):
        copies //= 2
    return copies


def head_rows(cfg: Config, last: int, copies: int, device: Device) -> int:
    """Rows a block of head_loss_sm90 takes: HEAD_ROWS where they fit beside two tiles
    (one block an SM, a kilobyte left for its static shared memory), else WIDE_HEAD_ROWS
    up to hidden WIDE_HEAD_HIDDEN."""
    fits = fits_alone(head_loss_sm90_layout(cfg, HEAD_ROWS, last, copies), device)
    return HEAD_ROWS if fits or cfg.model.hidden_dim > WIDE_HEAD_HIDDEN else WIDE_HEAD_ROWS


def tile_members(cfg: Config, rows: int) -> int:
    """Members a block of `rows` rows can hold rows of (tiles.cuh's TILE_MEMBERS)."""
    seq = cfg.model.seq_len
    return rows // seq if rows % seq == 0 else rows // seq + 2


def tile_pairs(cfg: Config, rows: int) -> int:
    """Antithetic pairs a block of `rows` rows can hold rows of (tiles.cuh's PAIRS_OF)."""
    seq = cfg.model.seq_len
    return (rows // seq + 1) // 2 if rows % seq == 0 else tile_members(cfg, rows) // 2 + 1


# --- the dynamic shared memory of the tiled kernels, each its .cu file's layout --------


def head_loss_layout(cfg: Config, warps: int, last: int, copies: int) -> int:
    """Bytes of dynamic shared memory of head_loss (head_loss.cu's layout): the block's
    rows, two vocabulary tiles, two tiles of output noise per member (av_t), the copies
    of the exp table."""
    rows = 32 * warps
    tiles = (rows + 2 * TILE_N) * (cfg.model.hidden_dim + 16)
    return tiles + av_bytes(cfg) * 2 * tile_members(cfg, rows) * TILE_N + 4 * (last + 1) * copies


def head_loss_shared(cfg: Config, defines: Mapping[str, int]) -> int:
    """head_loss's dynamic shared memory as compiled with `defines`."""
    warps, last, copies = defines["TILE_WARPS"], defines["EXP_LAST"], defines["EXP_COPIES"]
    return head_loss_layout(cfg, warps, last, copies)


def head_loss_sm90_layout(cfg: Config, rows: int, last: int, copies: int) -> int:
    """Bytes of dynamic shared memory of head_loss_sm90 (head_loss_sm90.cu's layout) for
    blocks of `rows` rows: the rows beside two vocabulary tiles (no padding: wgmma's
    core-matrix layout; wide blocks, whose rows go to registers, put the tiles where the
    rows were), the output noise of each pair over the whole vocabulary (in whole
    tiles; tiles.cuh's PAIRS_OF; 32 bits an entry, av_t's in wide blocks), the exp
    table's copies."""
    hidden, vocab = cfg.model.hidden_dim, -(-cfg.model.vocab_size // TILE_N) * TILE_N
    if rows == WIDE_HEAD_ROWS:  # (the kernel asserts that two tiles fit the rows' room)
        staged, entry = rows * hidden, av_bytes(cfg)
    else:
        staged, entry = (rows + 2 * TILE_N) * hidden, 4
    return staged + entry * tile_pairs(cfg, rows) * vocab + 4 * (last + 1) * copies


def head_loss_sm90_shared(cfg: Config, defines: Mapping[str, int]) -> int:
    """head_loss_sm90's dynamic shared memory as compiled with `defines`."""
    rows, last, copies = defines["HEAD_ROWS"], defines["EXP_LAST"], defines["EXP_COPIES"]
    return head_loss_sm90_layout(cfg, rows, last, copies)


def up_gelu_sm90_threads(defines: Mapping[str, int]) -> int:
    """up_gelu_sm90's threads a block as compiled (its UP_THREADS): a warpgroup of 128
    for each UP_WG_ROWS of its UP_ROWS rows."""
    return 128 * defines["UP_ROWS"] // defines["UP_WG_ROWS"]


def up_gelu_sm90_shared(cfg: Config, defines: Mapping[str, int]) -> int:
    """Bytes of dynamic shared memory of up_gelu_sm90 (up_gelu_sm90.cu's layout): the
    block's rows, two tiles of the up matrix, per member and feature of the matrix an
    8-byte entry (4 packed: UP_PACK) and a dot_t (common.cuh: 4 bytes, 8 in adaptive
    mode 2), the GELU table in bytes."""
    rows, up = defines["UP_ROWS"], 4 * cfg.model.hidden_dim
    tiles = (rows + 2 * TILE_N) * cfg.model.hidden_dim
    entry = 4 if defines.get("UP_PACK") else 8
    down = 8 if cfg.adaptive_noise.mode == 2 else 4
    return tiles + (entry + down) * tile_members(cfg, rows) * up + 255


def qkv_rope_sm90_shared(cfg: Config) -> int | None:
    """Bytes of dynamic shared memory of qkv_rope_sm90 (qkv_rope_sm90.cu's layout): the
    block's rows, one of the q, k, v matrices, the output rows staged (padded by 16
    bytes), the output noise of q, k and v for each member (32 bits an entry); None
    where the kernel cannot run the config: a row's products stay in registers, HIDDEN /
    2 a thread, in whole tiles."""
    d = cfg.model.hidden_dim
    if d % TILE_N or d > 256:
        return None
    rows = QKV_ROWS
    return rows * d + d * d + rows * (d + 16) + 3 * 4 * tile_members(cfg, rows) * d


def residual_sm90_shared(cfg: Config, defines: Mapping[str, int]) -> int | None:
    """Bytes of dynamic shared memory of o_residual_sm90 and down_residual_sm90
    (residual_sm90.cu's layout) as compiled with `defines`: the stages (a slice of a
    tile's 128 rows and of the matrix each), each member's seven tables of a tile (32-bit
    entries, 16 words of padding), the tiles' inputs (seeds, signs, input dots) in
    SLICE_STAGES - 1 buffers, ten bytes a feature copied once; None where they cannot
    run the config (a row's products in registers, in whole slices; one-word dot entries,
    not adaptive mode 2's)."""
    d, slice_, rows = cfg.model.hidden_dim, defines["SLICE"], defines["RESIDUAL_ROWS"]
    if d % slice_ or d > 256 or cfg.adaptive_noise.mode == 2:
        return None
    stages, members = defines["SLICE_STAGES"] * (rows + d) * slice_, tile_members(cfg, rows)
    tables = members * 7 * (d + 16) * 4
    inputs = (defines["SLICE_STAGES"] - 1) * 4 * (2 * members + rows)  # seeds, signs, dots
    return stages + tables + inputs + 10 * d


def attention_shared(cfg: Config, buffers: int) -> int:
    """Bytes of dynamic shared memory of attention_mma (attention.cu's layout) with
    `buffers` (ATT_BUFFERS) of each: the staging of an item's queries (with two buffers
    only) and keys (padded to whole tiles and 32-key chunks, rows of head_dim + 16
    bytes) and values (as in memory), and its transposed values (keys padded to 32) and
    o's input dot entries (dot_t: 8 bytes at most); then the exp table."""
    m = cfg.model
    keys, d, queries = -(-m.seq_len // 32) * 32, m.head_dim, -(-m.seq_len // 16) * 16
    stage = (queries * (buffers == 2) + keys) * (d + 16) + m.seq_len * d
    return buffers * (stage + d * (keys + 16) + 8 * d) + 4 * cfg.softmax.lut_size


def attention_buffers(cfg: Config, device: Device, warps: int) -> int:
    """attention_mma's ATT_BUFFERS (with `warps`, its ATT_WARPS): two, so that the next
    item loads while one is scored, unless they do not fit or leave fewer blocks an SM
    than one (long sequences)."""
    if not fits_alone(attention_shared(cfg, 2), device):
        return 1
    blocks = lambda b: attention_per_sm(cfg, device, warps, b, STATIC_ROOM)
    return 2 if blocks(2) >= blocks(1) else 1


def attention_per_sm(cfg: Config, device: Device, warps: int, buffers: int, static: int) -> int:
    """attention_mma's blocks an SM, all resident (each takes items until none are
    left): its launch bounds' 16 warps an SM, or fewer where shared memory runs out."""
    per_block = attention_shared(cfg, buffers) + static + device.reserved_per_block
    return max(1, min(16 // warps, device.shared_per_sm // per_block))


# --- what a device can run -----------------------------------------------------------


def supports(cfg: Config, shared_optin: int, static: Mapping[str, int] | None = None) -> list[str]:
    """Why the GPU backend cannot run a config on a device whose kernels may opt in to
    `shared_optin` bytes of shared memory; empty when it can. Before compiling (`static`
    None) the row kernels' dynamic shared memory is checked alone; `make_plan` adds each
    compiled kernel's static shared memory."""
    m, static = cfg.model, static or {}
    problems = []
    for name, dynamic in row_kernels_shared(cfg).items():
        size = dynamic + static.get(name, 0)
        if size > shared_optin:
            what = "shared memory" if name in static else "dynamic shared memory"
            problems.append(
                f"{name} needs {size} bytes of {what}, the device allows {shared_optin}"
            )
    if ATT_SPLIT * m.seq_len > MAX_THREADS:
        problems.append(
            f"seq_len {m.seq_len} needs {ATT_SPLIT * m.seq_len} threads per "
            f"attention block, more than {MAX_THREADS}"
        )
    positions = cfg.sampling.prompt_tokens + cfg.sampling.generate_tokens
    if positions >= 1 << 16:
        problems.append(f"generations of {positions} positions: choose_token counts in 16 bits")
    return problems


@dataclass(frozen=True)
class Plan:
    """The kernels a backend runs and how: made once, at construction (make_plan).

    fused: the head's GEMM and the loss in one kernel (`head`); else cuBLAS writes the
    logits and sequence_loss reads them. fused_up, fused_qkv: the up-projection and the
    q, k, v projections fused with their epilogues (up_gelu_sm90, qkv_rope_sm90);
    o_residual, down_residual: the o- and down-projections fused with residual_norm
    (residual_sm90.cu); tensor_attention: attention_mma in place of attention_mix.
    shared: each kernel's dynamic shared memory at training shapes (bytes)."""

    defines: dict[str, int]
    shared: dict[str, int]
    hopper: bool
    fused: bool
    head: str
    fused_up: bool
    fused_qkv: bool
    o_residual: bool
    down_residual: bool
    tensor_attention: bool
    opt_in: dict[str, int] = field(default_factory=dict)  # kernels past 48 KiB: their size
    attention_per_sm: int = 0  # attention_mma's resident blocks an SM (tensor_attention)

    def tile_rows(self, head: str) -> int:
        """Rows a block of a fused head (head_loss or head_loss_sm90) takes."""
        if head == "head_loss_sm90":
            return self.defines["HEAD_ROWS"]
        return 32 * self.defines["TILE_WARPS"]


def make_plan(
    cfg: Config,
    device: Device,
    defines: Mapping[str, int],
    static: Mapping[str, int],
    fused: bool | None = None,
    hopper: bool | None = None,
    head: str | None = None,
    qkv: bool | None = None,
) -> Plan:
    """The plan of a config on a device, given the kernels as compiled with `defines`
    and each compiled kernel's static shared memory (`static`, bytes; the sm90a kernels'
    only where that program was built). Each choice left None is the device's: the
    fastest kernel that runs; one given is honoured or refused (ValueError):
    fused=False runs the unfused head; hopper=False keeps the portable kernels; head
    names the fused head ("head_loss" or "head_loss_sm90"); qkv=False runs the q, k, v
    projections on cuBLAS, True asks for qkv_rope_sm90. Raises ValueError where the
    config cannot run at all."""
    optin = device.shared_optin
    shared = {k: v for k, v in row_kernels_shared(cfg).items() if v}
    problems = supports(cfg, optin, static)
    if problems:
        raise ValueError("the gpu backend cannot run this config here: " + "; ".join(problems))
    if hopper and not device.hopper:
        raise ValueError("the Hopper kernels need an sm_90 device (an H100 or H200)")
    use_hopper = device.hopper and hopper is not False
    if head is not None and fused is False:
        raise ValueError(f"head {head!r} is a fused head; fused=False runs cuBLAS logits")

    def fits(name: str, dynamic: int | None) -> bool:
        """A kernel runs where its layout exists at the config and fits beside its static
        shared memory (an sm90a kernel: where that program was built for this device)."""
        if dynamic is None or name not in static:
            return False
        return dynamic + static[name] <= optin

    def sm90(name: str, dynamic: int | None) -> bool:
        if use_hopper and fits(name, dynamic):
            shared[name] = dynamic  # type: ignore[assignment]
            return True
        return False

    # The head's GEMM fused with the loss (head_loss_sm90.cu on Hopper, else head_loss.cu)
    # where its tiles fit; else cuBLAS writes the logits and sequence_loss reads them.
    if head is not None and head not in ("head_loss", "head_loss_sm90"):
        raise ValueError(f"unknown head kernel {head!r}")
    wants_sm90 = fused is not False and head != "head_loss"
    sm90_head = wants_sm90 and sm90("head_loss_sm90", head_loss_sm90_shared(cfg, defines))
    if head == "head_loss_sm90" and not sm90_head:
        raise ValueError("head_loss_sm90 does not run this config on this device")
    portable = head_loss_shared(cfg, defines)
    if (fused or head == "head_loss") and not sm90_head and not fits("head_loss", portable):
        raise ValueError("head_loss needs more shared memory than the device allows")
    use_fused = (sm90_head or fits("head_loss", portable)) if fused is None else fused
    if use_fused and fits("head_loss", portable):
        shared["head_loss"] = portable
    chosen_head = "head_loss_sm90" if sm90_head else "head_loss"
    # The up-projection fused with mlp_up (up_gelu_sm90.cu) likewise; else cuBLAS writes
    # the int32 products and mlp_up reads them.
    fused_up = sm90("up_gelu_sm90", up_gelu_sm90_shared(cfg, defines))
    # The q, k, v GEMM fused with qkv_rope (qkv_rope_sm90.cu) likewise.
    fused_qkv = qkv is not False and sm90("qkv_rope_sm90", qkv_rope_sm90_shared(cfg))
    if qkv and not fused_qkv:
        raise ValueError("qkv_rope_sm90 does not run this config on this device")
    # The o- and the down-projection's GEMMs with residual_norm as their epilogue
    # (residual_sm90.cu) where their tiles fit: no product goes to memory. The
    # down-projection's only where up_gelu_sm90 writes its inputs apart (rows.hidden):
    # in rows.y, its tiles' y would land on rows other tiles still read.
    m, residual = cfg.model, residual_sm90_shared(cfg, defines)
    o_residual = sm90("o_residual_sm90", residual)
    down_residual = fused_up and sm90("down_residual_sm90", residual)
    # Attention on the tensor cores (attention.cu) where a head fills whole MMAs.
    att = attention_shared(cfg, defines["ATT_BUFFERS"])
    att_static = max(static.get(n, 0) for n in ("attention_mma", UNIT_TWINS["attention_mma"]))
    tensor_attention = m.head_dim % 32 == 0 and att + att_static <= optin
    per_sm = 0
    if tensor_attention:
        shared["attention_mma"] = att
        per_sm = attention_per_sm(
            cfg, device, defines["ATT_WARPS"], defines["ATT_BUFFERS"], att_static
        )
    shared |= {twin: shared[name] for name, twin in UNIT_TWINS.items() if name in shared}
    opt_in = {
        name: size for name, size in shared.items() if size + static.get(name, 0) > STATIC_SHARED
    }
    return Plan(
        defines=dict(defines),
        shared=shared,
        hopper=use_hopper,
        fused=use_fused,
        head=chosen_head,
        fused_up=fused_up,
        fused_qkv=fused_qkv,
        o_residual=o_residual,
        down_residual=down_residual,
        tensor_attention=tensor_attention,
        opt_in=opt_in,
        attention_per_sm=per_sm,
    )
