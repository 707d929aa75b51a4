"""GPU backend: the CPU backend's arithmetic on CUDA through CuPy, bit for bit.

Same interface as `CpuBackend` (losses, update, generate; cfg, params, overlays, state,
tables, name). The weights, overlays and optimizer state live on the device; the
`params`, `overlays` and `state` attributes are NumPy copies fetched on access (in the
CPU backend's logical layouts), and `load_state` puts new ones on the device.

Structure (kernels/*.cu, KERNEL_FILES; kernels named after model.py's functions):
- every integer matrix product is one cuBLAS int8 x int8 -> int32 GEMM (exact: int32
  accumulation of int8 products), weights stored transposed Wt[out, in] (a layer's q,
  k and v side by side: one GEMM for the three);
- the members' windows of tokens are gathered on the device from a copy of the token
  stream kept there;
- the per-member rank-1 terms, norms, RoPE, attention, GELU table, residuals and the
  integer cross-entropy are fused into a few row kernels, one thread block per member
  (attention: per member and head), which regenerate each member's noise by hashing;
- except the head: in training, head_loss.cu computes the logits on the int8 tensor
  cores and the loss in the same kernel, so no logit is written (the unfused pair,
  cuBLAS then sequence_loss, remains for validation logits, for generation and where
  the kernel's tiles do not fit the device's shared memory); and attention, whose
  scores and mix run on the int8 tensor cores (attention.cu) where head_dim is a
  multiple of 32 (elsewhere attention_mix, on CUDA cores);
- on an H100 or H200, the head, the MLP's up-projection and q, k, v run on Hopper's
  warpgroup MMAs (SM90_FILES, compiled apart for sm_90a): head_loss_sm90 and
  up_gelu_sm90 (the up-projection with mlp_up) with the next tile's products during
  this tile's epilogue, qkv_rope_sm90 (the three projections with qkv_rope, a row's
  products whole in registers), so no int32 product of theirs is written, where their
  tiles fit; the o- and down-projections too (terms_sm90.cu, a GEMM pipelined along
  K), which write residual_norm's terms in 16 bits where the config bounds them there;
  `hopper=False` keeps the portable kernels;
- the update builds, per matrix, the pairs' noise as int8 matrices [index, pair] (the
  output side times the ternary fitness) and gets every vote with one int8 GEMM, then
  runs the quantised AdamW step and the overlay update in elementwise kernels. The whole
  update is captured once as a CUDA graph and replayed each step (step seed, learning
  rates and fitness are read from device buffers).

Generation (sampling.py, once every few steps) runs on the device too: the row
kernels run the one sequence as a single member of sign 0 (no perturbation), the prompt's
positions together and then each new position alone, with a key/value cache per layer;
`cached_attention` attends over the cache and `choose_token` samples the next token into
the token buffer on the device, so nothing returns to the host until the end.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..config import Config
from ..runtime.checkpoint import file_mode
from ..seeds import member_sign, pair_seed
from . import launch
from .model import init_overlays, init_params, make_tables, member_tokens, window_starts
from .params import (
    EMB_MLP,
    GATE_SEED,
    LAYER_MLP,
    MATRICES,
    PARAM,
    Mlp,
    offsets,
    param_shapes,
    param_slices,
)
from .sampling import SAMPLE_STRIDE, sampler_limits
from .state import OptimizerState

log = logging.getLogger(__name__)

try:  # CuPy is optional: the backend is only usable where it imports and sees a GPU
    import cupy as cp
except Exception:  # pragma: no cover - depends on the machine
    cp = None


KERNEL_FILES = (
    "common.cuh",
    "forward.cu",
    "attention.cu",
    "tiles.cuh",
    "head_loss.cu",
    "generate.cu",
    "update.cu",
)
# GEMMs fused with their epilogues on Hopper's warpgroup MMAs: a program of its own,
# built for sm_90a (the one architecture with wgmma) where the device is an H100 or H200
SM90_FILES = (
    "common.cuh",
    "tiles.cuh",
    "wgmma.cuh",
    "head_loss_sm90.cu",
    "up_gelu_sm90.cu",
    "qkv_rope_sm90.cu",
    "terms_sm90.cu",
)
NT = 256  # threads of the row kernels
ATT_SPLIT = 2  # attention_mix: threads per query, each accumulating 1/ATT_SPLIT of a head
ATT_WARPS = 4  # attention_mma: at most this many warps a block, 16 queries a warp at a time
LOSS_REGISTER_LPT = 16  # sequence_loss keeps up to this many logits a thread in registers
# (more read the logits twice: 20% faster at vocab 8192, where 32 in registers cut occupancy)
TILE_WARPS, TILE_N = 8, 64  # head_loss: 32 rows a warp, vocabulary tiles of 64 embedding rows
UP_ROWS = 64  # up_gelu_sm90: rows a block, two warpgroups of 32
QKV_ROWS = 64  # qkv_rope_sm90: rows a block, one warpgroup
TERMS_ROWS = 128  # terms_sm90: rows a tile, two warpgroups of 64
SLICE, SLICE_STAGES = 128, 4  # terms_sm90: bytes of K a pipeline stage holds, stages
# Shared memory of an H100's or H200's SM (228 KiB): head_loss's copies of the exp table
# fill what two blocks an SM leave of it, each block reserving 1 KiB
SM_SHARED, BLOCK_RESERVED = 233472, 1024
MAX_THREADS = 1024  # per block, on every CUDA device
STATIC_SHARED = 48 << 10  # a kernel may use more shared memory only when it opts in
QKV = ("w_q", "w_k", "w_v")  # one GEMM projects a layer's three (GpuBackend.load_state)
FORWARD_BUDGET = 16 << 30  # bytes of a forward sub-batch's row buffers (GpuBackend.batch)

# cuBLAS / CUDA enum values
CUDA_R_8I, CUDA_R_32I = 3, 10
CUBLAS_COMPUTE_32I = 72
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1


@dataclass(frozen=True)
class Norm:
    """A standard_norm: its weight and bias (parameter names) of a layer (None: not per
    layer), and the matrices that read its output next, whose input dots it computes."""

    weight: str
    bias: str
    layer: int | None
    readers: tuple[str, ...]


def kernel_source(files: tuple[str, ...] = KERNEL_FILES) -> str:
    """The CUDA sources, shipped inside the package (package data), as one program."""
    kernels = resources.files(__package__).joinpath("kernels")
    return "\n".join(kernels.joinpath(name).read_text() for name in files)


def choose_token_threads(hidden: int) -> int:
    """Threads of choose_token: the reference's HIDDEN, or a divisor of it within a block."""
    per = -(-hidden // MAX_THREADS)
    while hidden % per:
        per += 1
    return hidden // per


def seeds_in_pairs(seeds: np.ndarray) -> bool:
    """Whether members 2k and 2k + 1 of a batch share their seed, as an antithetic pair's
    do: head_loss_sm90 keeps its output noise a pair (tiles.cuh's tile_noise, by_pair).
    A chunk's members are whole pairs; a sub-batch starting mid-pair is not."""
    return np.array_equal(seeds[0 : len(seeds) - 1 : 2], seeds[1::2])


def av_bytes(cfg: Config) -> int:
    """Bytes of common.cuh's av_t, the output noise held in shared memory: 32 bits in
    adaptive mode 2 (its factor is unbounded), else 16."""
    return 4 if cfg.adaptive_noise.mode == 2 else 2


def shared_memory(cfg: Config) -> dict[str, tuple[int, int]]:
    """Bytes of shared memory of the kernels that need much: (dynamic, static), as the
    sources declare them (training shapes; generation's cached_attention is sized then)."""
    m, lut = cfg.model, cfg.softmax.lut_size
    h, up, v = m.hidden_dim, 4 * m.hidden_dim, m.vocab_size
    av = av_bytes(cfg)
    reductions = 32 * 8
    magic = 4 * 129  # forward.cu's s_magic, MEAN_MAX + 1 words
    return {
        "embed": (0, 12 * h),
        "standard_norm": (32 * h, magic + reductions),
        "qkv_rope": (0, 12 * h),
        "attention_mix": (2 * m.seq_len * m.head_dim, 4 * lut + 8 * m.head_dim + reductions),
        "residual_norm": (32 * h, 8 * h + magic + reductions),
        "mlp_up": (16 * up, 4 * 256 + reductions),
        "sequence_loss": (av * v, 4 * lut + reductions),
        "choose_token": (4 * ((v + 1) // 2), 8 * (h + 1) + reductions),
    }


def kernel_defines(cfg: Config, tables) -> dict[str, int]:
    """The -D values the CUDA sources are compiled with: the config's shapes and
    constants, and the launch constants of this module."""
    q, m = cfg.quantization, cfg.model
    lut0 = int(tables.exp.max())
    last = exp_last(tables.exp)
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
        ADAMW=int(cfg.optimizer.kind == "adamw"),
        GATE_SEED=GATE_SEED,
        SAMPLE_STRIDE=SAMPLE_STRIDE,
        NT=NT,
        ATT_SPLIT=ATT_SPLIT,
        ATT_WARPS=min(ATT_WARPS, -(-m.seq_len // 16)),
        TILE_WARPS=TILE_WARPS,
        TILE_N=TILE_N,
        UP_ROWS=UP_ROWS,
        QKV_ROWS=QKV_ROWS,
        TERMS_ROWS=TERMS_ROWS,
        SLICE=SLICE,
        SLICE_STAGES=SLICE_STAGES,
        EXP_MAX=lut0,
        EXP_LAST=last,
        EXP_COPIES=exp_copies(cfg, last),
        CT_THREADS=choose_token_threads(m.hidden_dim),
        LOSS_REGISTER_LPT=LOSS_REGISTER_LPT,
    )
    # up_gelu_sm90: three blocks an SM (80 registers a thread) where a warpgroup's rows
    # are one member's and three fit the SM's shared memory; else two (96 registers:
    # 80 spill there, and a cap that no third block uses only slows the kernel)
    three = 3 * (up_gelu_sm90_shared(cfg, defines) + BLOCK_RESERVED) <= SM_SHARED
    defines["UP_BLOCKS"] = 3 if m.seq_len % 32 == 0 and three else 2
    return defines


def exp_last(exp: np.ndarray) -> int:
    """The last entry of the exp table that head_loss reads: every entry past the last
    nonzero one is zero, so one of them stands for all (index min(d, EXP_LAST))."""
    nonzero = np.flatnonzero(exp)
    return min(len(exp) - 1, int(nonzero[-1]) + 1) if len(nonzero) else 0


def exp_copies(cfg: Config, last: int) -> int:
    """Copies of the table's entries 0..last that head_loss interleaves, so that lanes
    looking up different entries read different banks: one a lane where two blocks an SM
    still fit, else the most that do (a power of two), else one."""
    copies = 32
    while (
        copies > 1
        and 2 * (head_loss_layout(cfg, TILE_WARPS, last, copies) + BLOCK_RESERVED) > SM_SHARED
    ):
        copies //= 2
    return copies


def head_loss_layout(cfg: Config, warps: int, last: int, copies: int) -> int:
    """Bytes of dynamic shared memory of head_loss (head_loss.cu's layout): the block's
    rows, two vocabulary tiles, two tiles of output noise per member (av_t), the copies
    of the exp table."""
    rows = 32 * warps
    tiles = (rows + 2 * TILE_N) * (cfg.model.hidden_dim + 16)
    return tiles + av_bytes(cfg) * 2 * tile_members(cfg, rows) * TILE_N + 4 * (last + 1) * copies


def head_loss_shared(cfg: Config, defines: dict[str, int]) -> int:
    """head_loss's dynamic shared memory as compiled with `defines`."""
    warps, last, copies = defines["TILE_WARPS"], defines["EXP_LAST"], defines["EXP_COPIES"]
    return head_loss_layout(cfg, warps, last, copies)


def tile_members(cfg: Config, rows: int) -> int:
    """Members a block of `rows` rows can hold rows of (tiles.cuh's TILE_MEMBERS)."""
    seq = cfg.model.seq_len
    return rows // seq if rows % seq == 0 else rows // seq + 2


def tile_pairs(cfg: Config, rows: int) -> int:
    """Antithetic pairs a block of `rows` rows can hold rows of (tiles.cuh's PAIRS_OF)."""
    seq = cfg.model.seq_len
    return (rows // seq + 1) // 2 if rows % seq == 0 else tile_members(cfg, rows) // 2 + 1


def head_loss_sm90_shared(cfg: Config, defines: dict[str, int]) -> int:
    """Bytes of dynamic shared memory of head_loss_sm90 (head_loss_sm90.cu's layout) as
    compiled with `defines`: the block's rows, two vocabulary tiles (no padding: wgmma's
    core-matrix layout), the output noise of each pair over the whole vocabulary (32
    bits an entry, in whole tiles; tiles.cuh's PAIRS_OF), the exp table's copies."""
    rows, vocab = 32 * defines["TILE_WARPS"], -(-cfg.model.vocab_size // TILE_N) * TILE_N
    tiles = (rows + 2 * TILE_N) * cfg.model.hidden_dim
    table = 4 * (defines["EXP_LAST"] + 1) * defines["EXP_COPIES"]
    return tiles + 4 * tile_pairs(cfg, rows) * vocab + table


def up_gelu_sm90_shared(cfg: Config, defines: dict[str, int]) -> int:
    """Bytes of dynamic shared memory of up_gelu_sm90 (up_gelu_sm90.cu's layout): the
    block's rows, two tiles of the up matrix, per member and feature of the matrix an
    8-byte entry and a dot_t (common.cuh: 4 bytes, 8 in adaptive mode 2), the GELU
    table in bytes."""
    rows, up = defines["UP_ROWS"], 4 * cfg.model.hidden_dim
    tiles = (rows + 2 * TILE_N) * cfg.model.hidden_dim
    down = 8 if cfg.adaptive_noise.mode == 2 else 4
    return tiles + (8 + down) * tile_members(cfg, rows) * up + 255


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


def projection_terms_fit(cfg: Config, k: int, shift: int) -> bool:
    """Whether terms_sm90.cu's 16-bit terms (g + rank-1 term) >> shift hold every
    value the config allows, for a projection of k inputs: |g| <= 128^2 k, the rank-1
    term's input dot at most 128 n k and its output noise n (n the largest noise; a
    product past 32 bits wraps, as the CPU's). Adaptive mode 2's factors are unbounded:
    never there."""
    if cfg.adaptive_noise.mode == 2:
        return False
    q, n = cfg.quantization, cfg.noise.perturb_bound
    g = 128 * 128 * k
    rank1 = min(128 * n * n * k, 2**31) >> (q.fixed_point + q.sigma_shift)
    if g + rank1 >= 2**31:  # the sum before the shift could wrap
        return False
    return ((g + rank1) >> shift) + 1 < 2**15  # + 1: the floor of a negative value


def terms_sm90_shared(cfg: Config, defines: dict[str, int]) -> int | None:
    """Bytes of dynamic shared memory of o_terms_sm90 and down_terms_sm90 (terms_sm90.cu's
    layout) as compiled with `defines`: the stages (a slice of a tile's 128 rows and of
    the matrix each), each warp's 16 staged rows of terms, per member and column the
    output noise (32 bits), the tiles' inputs (seeds, signs, input dots) in SLICE_STAGES -
    1 buffers, the output noise's overlay; None where they cannot run the config (a
    row's products in registers, in whole slices)."""
    d, slice_, rows = cfg.model.hidden_dim, defines["SLICE"], defines["TERMS_ROWS"]
    if d % slice_ or d > 256:
        return None
    stages, members = defines["SLICE_STAGES"] * (rows + d) * slice_, tile_members(cfg, rows)
    stage = (2 * rows // 32) * 16 * (TILE_N // 2 + 4) * 4  # TERMS_LD words a row
    inputs = (defines["SLICE_STAGES"] - 1) * 4 * (2 * members + rows)  # seeds, signs, dots
    return stages + stage + 4 * members * d + inputs + d


def sliced_core_pieces(n: int, k: int, slice_: int) -> np.ndarray:
    """core_pieces for terms_sm90.cu: the n rows of a K-contiguous matrix of k bytes a
    row, cut into slices of slice_ bytes, each slice (all n rows) in the core-matrix
    layout, slice after slice."""
    pieces, per = k // 16, slice_ // 16
    s, group, piece, r = np.meshgrid(
        np.arange(k // slice_), np.arange(n // 8), np.arange(per), np.arange(8), indexing="ij"
    )
    return ((group * 8 + r) * pieces + s * per + piece).astype(np.int32).ravel()


def core_pieces(order: np.ndarray, k: int) -> np.ndarray:
    """The copy of a matrix that an sm90 kernel copies into shared memory as it is: its
    row i is row order[i] of a K-contiguous int8 matrix with k bytes a row (-1: zeros),
    each group of 8 rows in wgmma's core-matrix layout (wgmma.cuh: 8 rows x 16 bytes,
    128 contiguous bytes, along K, then the next group). For each 16-byte piece of the
    copy, the index of the source's piece, or -1."""
    pieces = k // 16
    group, piece, r = np.meshgrid(
        np.arange(len(order) // 8), np.arange(pieces), np.arange(8), indexing="ij"
    )
    row = np.asarray(order)[group * 8 + r]
    return np.where(row < 0, -1, row * pieces + piece).astype(np.int32).ravel()


def up_order(hidden: int) -> np.ndarray:
    """The up matrix's rows in up_gelu_sm90's tiles of 64 (up_gelu_sm90.cu): in tiles 2 u
    + h, row 16 w + 8 s + g is row 32 u + 8 w + g + (2 h + s) hidden."""
    i = np.arange(2 * TILE_N)  # tiles 2 u and 2 u + 1
    h, w, s, g = i >> 6, (i >> 4) & 3, (i >> 3) & 1, i & 7
    pair = 8 * w + g + (2 * h + s) * hidden
    return np.concatenate([32 * u + pair for u in range(hidden // 32)])


def hidden_order(hidden: int) -> np.ndarray:
    """The features of a hidden row as up_gelu_sm90 writes it: byte 4 G + sub is feature
    G + sub hidden (a thread's group at once). The down-projection after it reads its
    matrix's inputs in this order (GpuBackend._core_copies)."""
    p = np.arange(4 * hidden)
    return p // 4 + p % 4 * hidden


def in_hidden_order(index: np.ndarray, k: int) -> np.ndarray:
    """A copy's piece index (core_pieces, sliced_core_pieces) over a matrix of k inputs a
    row taken in hidden_order, as the index of each of its bytes in the matrix itself:
    the down-projection's copies where up_gelu_sm90 writes its input."""
    byte = (index[:, None] * 16 + np.arange(16)).ravel()
    return (byte - byte % k + hidden_order(k // 4)[byte % k]).astype(np.int32)


@dataclass(frozen=True)
class CoreCopy:
    """A weight matrix kept on the device in the order an sm90 kernel copies it into
    shared memory (core_pieces), made again from `source` after every update: out's
    piece i is source's piece index[i], of `piece` bytes (16; 1 where the inputs are
    reordered too, in_hidden_order)."""

    source: object  # the matrix, K-contiguous int8 on the device
    index: object  # on the device
    out: object
    piece: int = 16


def attention_shared(cfg: Config) -> int:
    """Bytes of dynamic shared memory of attention_mma (attention.cu's layout): the
    head's keys and its transposed values (keys padded to 32), o's input dot entries
    (dot_t: 8 bytes at most), the exp table."""
    keys, d = -(-cfg.model.seq_len // 32) * 32, cfg.model.head_dim
    return keys * (d + 16) + d * (keys + 16) + 4 * cfg.softmax.lut_size + 8 * d


def supports(cfg: Config, shared_optin: int) -> list[str]:
    """Why the GPU backend cannot run a config on a device whose kernels may opt in to
    `shared_optin` bytes of shared memory; empty when it can."""
    m = cfg.model
    problems = []
    for name, (dynamic, static) in shared_memory(cfg).items():
        if dynamic + static > shared_optin:
            problems.append(
                f"{name} needs {dynamic + static} bytes of shared memory, the "
                f"device allows {shared_optin}"
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


def kernel_cache_folder() -> Path:
    """CuPy's kernel cache folder, as its documentation names it: $CUPY_CACHE_DIR, else
    ~/.cupy/kernel_cache."""
    folder = os.environ.get("CUPY_CACHE_DIR")
    return Path(folder) if folder else Path.home() / ".cupy" / "kernel_cache"


CUBIN_MAGIC = b"deggs cubin 1\n"  # then the payload's SHA-256, then the payload


def cached_cubin(folder: Path, key: str, compile_program: Callable[[], bytes]) -> bytes:
    """The compiled program for `key` from `folder` (a file named by the key's SHA-256),
    else compile_program()'s, stored there for the next start. A cached file that is
    not whole (a start killed while writing, a bad disk) is compiled again; a folder
    that cannot be written only costs the next start a compile."""
    path = folder / f"deggs-{hashlib.sha256(key.encode()).hexdigest()}.cubin"
    try:
        data = path.read_bytes()
        digest, payload = (
            data[len(CUBIN_MAGIC) : len(CUBIN_MAGIC) + 32],
            data[len(CUBIN_MAGIC) + 32 :],
        )
        if data.startswith(CUBIN_MAGIC) and hashlib.sha256(payload).digest() == digest:
            return payload
    except OSError:
        pass
    payload = compile_program()
    part = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=path.name, delete=False) as f:
            part = Path(f.name)
            os.fchmod(f.fileno(), file_mode())  # as any new file: NamedTemporaryFile's is 0600
            f.write(CUBIN_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(part, path)  # whole or not there, for the starts beside this one
    except OSError as e:
        if part is not None:
            part.unlink(missing_ok=True)
        log.warning("could not keep the compiled sm_90a program in %s: %s", folder, e)
    return payload


def gpu_available() -> bool:
    """CuPy imports and sees at least one CUDA device."""
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _load_cublas():
    """libcublas through ctypes, as loaded by CuPy (CuPy's own wrapper refuses to run
    while a stream is being captured, and the update is captured as a CUDA graph)."""
    import ctypes
    import ctypes.util

    cp.cuda.device.get_cublas_handle()  # makes CuPy load the library
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            name = line.split()[-1]
            if "libcublas.so" in name and name not in paths:
                paths.append(name)
    paths.append(ctypes.util.find_library("cublas") or "libcublas.so")
    lib = ctypes.CDLL(paths[0])
    c_int, c_void = ctypes.c_int, ctypes.c_void_p
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(c_void)]
    lib.cublasSetStream_v2.argtypes = [c_void, c_void]
    lib.cublasSetWorkspace_v2.argtypes = [c_void, c_void, ctypes.c_size_t]
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
    # ldc, computeType, algo: p a pointer, i an int
    kinds = {"p": c_void, "i": c_int}
    lib.cublasGemmEx.argtypes = [kinds[k] for k in "piiiiippiipiippiiii"]
    return lib


class Cublas:
    """One cuBLAS handle of our own, with a fixed workspace (capturable)."""

    WORKSPACE = 32 << 20

    def __init__(self):
        import ctypes

        self.lib = _load_cublas()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cp.empty(self.WORKSPACE, cp.uint8)
        self.one = np.ones(1, np.int32)
        self.zero = np.zeros(1, np.int32)
        self.stream = None

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def gemm_tn_i8(self, a, b, c, m, n, k, lda, ldb, ldc):
        """C (m x n, col-major, int32) = A^T B, A (k x m) and B (k x n) int8, col-major."""
        stream = cp.cuda.get_current_stream().ptr
        if stream != self.stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
            self._check(
                self.lib.cublasSetWorkspace_v2(
                    self.handle, self.workspace.data.ptr, self.WORKSPACE
                ),
                "cublasSetWorkspace",
            )
            self.stream = stream
        self._check(
            self.lib.cublasGemmEx(
                self.handle,
                OP_T,
                OP_N,
                m,
                n,
                k,
                self.one.ctypes.data,
                a,
                CUDA_R_8I,
                lda,
                b,
                CUDA_R_8I,
                ldb,
                self.zero.ctypes.data,
                c,
                CUDA_R_32I,
                ldc,
                CUBLAS_COMPUTE_32I,
                GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )


def to_device_layout(name: str, arr: np.ndarray) -> np.ndarray:
    """Matrices [.., in, out] -> [.., out, in] (K-contiguous for the GEMMs)."""
    if name in MATRICES:
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2))
    return np.ascontiguousarray(arr)


def from_device_layout(name: str, arr: np.ndarray) -> np.ndarray:
    if name in MATRICES:
        return np.ascontiguousarray(np.swapaxes(arr, -1, -2))
    return arr


class GpuBackend:
    name = "gpu"

    def __init__(
        self,
        cfg: Config,
        batch: int | None = None,
        use_graph: bool = True,
        device: int | None = None,
        defines: dict | None = None,
        fused: bool | None = None,
        hopper: bool | None = None,
    ):
        if not gpu_available():
            raise RuntimeError("the gpu backend needs CuPy and a CUDA device")
        if device is not None:
            cp.cuda.Device(device).use()
        self.cfg = cfg
        self.overrides = dict(defines or {})  # -D values replacing the computed ones
        m = cfg.model
        optin = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
        problems = supports(cfg, optin)
        if problems:  # checked before anything is compiled or launched
            raise ValueError("the gpu backend cannot run this config here: " + "; ".join(problems))
        self.tables = make_tables(cfg)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.module = self._compile()
        self.nt = self.defines["NT"]  # threads of the row kernels, as compiled (-D NT=...)
        self.kernels = launch.kernels(self.module, kernel_source())
        self.dynamic_shared = {k: dyn for k, (dyn, _) in shared_memory(cfg).items() if dyn}
        # The head's GEMM fused with the loss (head_loss.cu) where its tiles fit; else
        # cuBLAS writes the logits and sequence_loss reads them.
        self.tile_rows = 32 * self.defines["TILE_WARPS"]
        shared = head_loss_shared(cfg, self.defines)
        if fused and shared > optin:
            raise ValueError("head_loss needs more shared memory than the device allows")
        self.fused = shared <= optin if fused is None else fused
        if self.fused:
            self.dynamic_shared["head_loss"] = shared
        # On an H100 or H200 (hopper=None or True), the kernels on Hopper's warpgroup
        # MMAs (SM90_FILES) where their tiles fit; hopper=False keeps the portable ones.
        sm90 = cp.cuda.Device().compute_capability == "90"
        if hopper and not sm90:
            raise ValueError("the Hopper kernels need an sm_90 device (an H100 or H200)")
        self.hopper = sm90 and hopper is not False
        if self.hopper:
            self.kernels.update(self._compile_sm90a())

        def runs_sm90(name: str, dynamic: int | None) -> bool:
            """Whether the Hopper kernel `name` runs: built for this device, its layout
            possible at the config (not None) and fitting beside its static shared
            memory (barriers); if so, its dynamic shared memory is noted."""
            if not self.hopper or dynamic is None:
                return False
            if dynamic + self.kernels[name].function.shared_size_bytes > optin:
                return False
            self.dynamic_shared[name] = dynamic
            return True

        head = head_loss_sm90_shared(cfg, self.defines)
        self.head_kernel = (
            "head_loss_sm90" if self.fused and runs_sm90("head_loss_sm90", head) else "head_loss"
        )
        # The up-projection fused with mlp_up (up_gelu_sm90.cu) likewise; else cuBLAS
        # writes the int32 products and mlp_up reads them.
        self.fused_up = runs_sm90("up_gelu_sm90", up_gelu_sm90_shared(cfg, self.defines))
        # The q, k, v GEMM fused with qkv_rope (qkv_rope_sm90.cu) likewise.
        self.fused_qkv = runs_sm90("qkv_rope_sm90", qkv_rope_sm90_shared(cfg))
        # The o- and the down-projection's GEMMs writing residual_norm's terms in 16 bits
        # (terms_sm90.cu) where their tiles fit and the terms fit 16 bits, so that
        # residual_norm reads half the bytes of a product.
        q, terms = cfg.quantization, terms_sm90_shared(cfg, self.defines)
        o_fit = projection_terms_fit(cfg, m.hidden_dim, q.shift_out)
        down_fit = projection_terms_fit(cfg, 4 * m.hidden_dim, q.shift_mlp_down)
        self.o_terms = o_fit and runs_sm90("o_terms_sm90", terms)
        self.down_terms = down_fit and runs_sm90("down_terms_sm90", terms)
        self.sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        # Attention on the tensor cores (attention.cu) where a head fills whole MMAs.
        self.tensor_attention = m.head_dim % 32 == 0 and attention_shared(cfg) <= optin
        if self.tensor_attention:
            self.dynamic_shared["attention_mma"] = attention_shared(cfg)
        for name, size in self.dynamic_shared.items():
            if size > STATIC_SHARED - shared_memory(cfg).get(name, (0, 0))[1]:
                self.kernels[name].function.max_dynamic_shared_size_bytes = size
        self.blas = Cublas()
        self.d_exp = cp.asarray(self.tables.exp.astype(np.int32))
        self.d_gelu = cp.asarray(self.tables.gelu.astype(np.int32))
        self.d_rope = cp.asarray(self.tables.rope.astype(np.int32).ravel())
        # members a sub-batch: its row buffers within the budget (`batch`)
        self.budget = min(FORWARD_BUDGET, cp.cuda.runtime.memGetInfo()[0] // 4)
        self.fixed_batch = batch
        # device buffers, made on first use: forward, generation, update
        self._fwd: dict | None = None
        self._gen: dict | None = None
        self._upd: dict | None = None
        self._data: tuple | None = None  # (the host token stream, its device copy)
        self.use_graph = use_graph
        self.graph = None
        self.graph_error = None
        self.profile: dict | None = None  # {} times each kernel launch (not while capturing)
        self.load_state(init_params(cfg), init_overlays(cfg), OptimizerState.zeros(cfg))

    # --- state ------------------------------------------------------------------------

    def _compile(self):
        defines = kernel_defines(self.cfg, self.tables)
        defines.update(self.overrides)  # kernel variants, for scripts/kernels.py
        self.defines = defines
        options = ("--std=c++17", "--fmad=false") + tuple(f"-D{k}={v}" for k, v in defines.items())
        self.options = options
        return cp.RawModule(code=kernel_source(), options=options)

    def _compile_sm90a(self) -> dict:
        """The typed launchers of the SM90_FILES program, compiled by NVRTC for sm_90a
        (CuPy's RawModule always names plain sm_90, which has no wgmma) with the options
        RawModule gives the main program; kept in CuPy's kernel cache folder, as CuPy
        keeps the main program, so that only the first start compiles it."""
        from cupy_backends.cuda.libs import nvrtc

        source = kernel_source(SM90_FILES)
        options = [
            *self.options,
            "-ftz=true",
            "--device-as-default-execution-space",
            "-arch=sm_90a",
        ]

        def compile_program() -> bytes:
            program = nvrtc.createProgram(source, "deggs_sm90a.cu", [], [])
            try:
                try:
                    nvrtc.compileProgram(program, options)
                except nvrtc.NVRTCError as e:
                    raise RuntimeError(f"{e}: {nvrtc.getProgramLog(program)}") from e
                return nvrtc.getCUBIN(program)
            finally:
                nvrtc.destroyProgram(program)

        key = "\n".join([source, *options, f"nvrtc {nvrtc.getVersion()}"])
        cubin = cached_cubin(kernel_cache_folder(), key, compile_program)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "deggs_sm90a.cubin"
            path.write_bytes(cubin)
            # get_function loads the file, so the launchers outlive the folder
            return launch.kernels(cp.RawModule(path=str(path)), source)

    def load_state(self, params: dict, overlays: dict, state: OptimizerState | None = None):
        """Put weights, overlays and (optionally) optimizer state on the device."""
        shapes = param_shapes(self.cfg)
        self.dp = {
            k: cp.asarray(to_device_layout(k, np.asarray(params[k], np.int8))) for k in shapes
        }
        # A layer's q, k and v matrices side by side ([layers, 3, out, in]), so that one
        # GEMM projects all three; the table's names keep views of their parts.
        self.d_qkv = cp.stack([self.dp[k] for k in QKV], axis=1)
        self.dp.update({k: self.d_qkv[:, i] for i, k in enumerate(QKV)})
        self.dov = {k: cp.asarray(np.ascontiguousarray(v, np.int8)) for k, v in overlays.items()}
        if state is None:
            state = OptimizerState.zeros(self.cfg)
        self.dm = {
            k: cp.asarray(to_device_layout(k, np.asarray(state.m[k], np.float32))) for k in shapes
        }
        self.dv = {
            k: cp.asarray(to_device_layout(k, np.asarray(state.v[k], np.float32))) for k in shapes
        }
        self.dacc = {
            k: cp.asarray(to_device_layout(k, np.asarray(state.acc[k], np.float32))) for k in shapes
        }
        self.graph = None  # the captured update points at the old arrays
        self.cores = self._core_copies()
        cp.cuda.Device().synchronize()  # the arrays above came on the current stream
        with self.stream:
            self._copy_cores()
        self.stream.synchronize()  # before any stream reads them

    def _core_copies(self) -> dict:
        """The sm90 kernels' copies of their matrices (CoreCopy), by (name, layer): so a
        tile's copy into shared memory is contiguous, with no index arithmetic (that was a
        third of qkv_rope_sm90's warp samples). Only for the kernels this device runs."""
        m = self.cfg.model
        d, layers = m.hidden_dim, range(m.n_layers)
        copies = {}

        def keep(key, source, index, piece=16):
            copies[key] = CoreCopy(source, index, cp.empty(piece * index.size, cp.int8), piece)

        if self.fused_qkv:
            index = cp.asarray(core_pieces(np.arange(3 * d), d))
            for layer in layers:
                keep(("qkv", layer), self.d_qkv[layer], index)
        if self.fused_up:
            index = cp.asarray(core_pieces(up_order(d), d))
            for name, at in [(EMB_MLP.up, None), *((LAYER_MLP.up, layer) for layer in layers)]:
                keep((name, at), self._param(name, at)[0], index)
        slice_ = self.defines["SLICE"]
        if self.o_terms:
            index = cp.asarray(sliced_core_pieces(d, d, slice_))
            for layer in layers:
                keep(("w_o", layer), self._param("w_o", layer)[0], index)
        # The down-projection's: its slices for down_terms_sm90, and where up_gelu_sm90
        # writes its input in hidden_order, its inputs in that order (for cuBLAS, as a
        # plain matrix otherwise)
        if self.down_terms or self.fused_up:
            pieces = (
                sliced_core_pieces(d, 4 * d, slice_) if self.down_terms else np.arange(d * d // 4)
            )
            piece = 1 if self.fused_up else 16
            index = cp.asarray(in_hidden_order(pieces, 4 * d) if self.fused_up else pieces)
            for name, at in [(EMB_MLP.down, None), *((LAYER_MLP.down, layer) for layer in layers)]:
                keep((name, at), self._param(name, at)[0], index, piece)
        if "head_loss_sm90" in self.dynamic_shared:
            rows = np.arange(-(-m.vocab_size // TILE_N) * TILE_N)  # whole tiles
            order = np.where(rows < m.vocab_size, rows, -1)
            keep(("embedding", None), self.dp["embedding"], cp.asarray(core_pieces(order, d)))
        return copies

    def _copy_cores(self):
        """Make the sm90 kernels' copies again (after the weights changed; no allocation,
        so the update's graph captures it)."""
        for copy in self.cores.values():
            n = copy.index.size
            self._launch(
                "gather_pieces" if copy.piece == 16 else "gather_bytes",
                (-(-n // 256),),
                (256,),
                source=copy.source,
                index=copy.index,
                out=copy.out,
                n=n,
            )

    @property
    def params(self) -> dict:
        self.stream.synchronize()
        return {k: from_device_layout(k, v.get()) for k, v in self.dp.items()}

    @property
    def overlays(self) -> dict:
        self.stream.synchronize()
        return {k: v.get() for k, v in self.dov.items()}

    @property
    def state(self) -> OptimizerState:
        self.stream.synchronize()
        fetch = lambda d: {k: from_device_layout(k, v.get()) for k, v in d.items()}
        return OptimizerState(fetch(self.dm), fetch(self.dv), fetch(self.dacc))

    # --- helpers ----------------------------------------------------------------------

    def _launch(self, name, grid, block, shared_mem=None, **args):
        """Launch a kernel by name with keyword arguments (deggs/numerics/launch.py)."""
        if shared_mem is None:  # the kernel's dynamic shared memory at the training shapes
            shared_mem = self.dynamic_shared.get(name, 0)
        kernel = self.kernels[name]
        if self.profile is not None:
            return self._timed(name, lambda: kernel(grid, block, shared_mem, **args))
        kernel(grid, block, shared_mem, **args)

    def _timed(self, name, fn):
        """Run fn between two events; profile[name] collects the pairs (see `profile_report`)."""
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        self.profile.setdefault(name, []).append((start, end))

    def profile_report(self) -> dict:
        """Milliseconds per kernel name since profiling started (profile = {})."""
        assert self.profile is not None, "set profile = {} first"
        cp.cuda.get_current_stream().synchronize()
        self.stream.synchronize()
        return {
            k: round(sum(cp.cuda.get_elapsed_time(a, b) for a, b in v), 3)
            for k, v in sorted(self.profile.items())
        }

    def _gemm(self, a, b, c, m, n, k, lda, ldb, ldc):
        """C[n, ldc] (int32, row-major) = B[n, k] @ A[m, k]^T: cuBLAS TN, int8 in, int32 out."""
        if self.profile is not None:
            return self._timed(
                f"gemm {m}x{k}",
                lambda: self.blas.gemm_tn_i8(
                    a.data.ptr, b.data.ptr, c.data.ptr, m, n, k, lda, ldb, ldc
                ),
            )
        self.blas.gemm_tn_i8(a.data.ptr, b.data.ptr, c.data.ptr, m, n, k, lda, ldb, ldc)

    def _project(self, wt, x, out, n_out, rows, k):
        """out[rows, n_out] = x[rows, k] @ W, with Wt [n_out, k]."""
        self._gemm(wt, x, out, n_out, rows, k, k, k, n_out)

    # --- forward ----------------------------------------------------------------------

    @property
    def batch(self) -> int:
        """Members a forward sub-batch of training: as given, else as many as keep its
        row buffers within the budget, an even number (whole antithetic pairs: see
        seeds_in_pairs). Where every projection is fused no int32 product is written
        (`_product_words`), and at the default config a chunk is one sub-batch, one
        launch a kernel (32,768 + 8,192 members ran 1% slower on an H100)."""
        if self.fixed_batch:
            return self.fixed_batch
        if not self.fused:
            return self.logit_batch
        return self._members_within_budget(self._product_words(1, whole=True))

    @batch.setter
    def batch(self, members: int) -> None:
        self.fixed_batch = members

    @property
    def logit_batch(self) -> int:
        """Members a sub-batch whose logits are written (validation, the unfused head)."""
        words = max(self._product_words(1, whole=True), self.cfg.model.vocab_size)
        return self.fixed_batch or self._members_within_budget(words)

    def _members_within_budget(self, words: int) -> int:
        """Members whose row buffers, with `words` int32 product words a row, fit the
        budget: an even number, at least a pair."""
        row = 4 * words + sum(n * np.dtype(t).itemsize for n, t in self._row_fields().values())
        return max(2, self.budget // (self.cfg.model.seq_len * row) // 2 * 2)

    def _product_words(self, rows: int, whole: bool) -> int:
        """int32 words of the products the forward of `rows` rows writes to memory (a
        row buffer's "g"). On whole members the fused kernels that run write none, the
        terms kernels 16 bits a feature; elsewhere (generation) cuBLAS writes them all."""
        d = self.cfg.model.hidden_dim
        widths = [d // 2]
        if not (whole and self.fused_up):
            widths.append(4 * d)
        if not (whole and self.fused_qkv):
            widths.append(3 * d)
        if not (whole and self.o_terms and self.down_terms):
            widths.append(d)
        return rows * max(widths)

    def _buffers(self, nb: int, logits: bool):
        """Row buffers of nb members (with room for their logits when `logits`)."""
        r = nb * self.cfg.model.seq_len
        words = max(
            self._product_words(r, whole=True), r * self.cfg.model.vocab_size if logits else 0
        )
        fwd = self._fwd
        if fwd is not None and fwd["rows"] >= r and fwd["g"].size >= words:
            return fwd
        self._fwd = None  # freed before the new ones are made
        self._fwd = self._row_buffers(r, words)
        return self._fwd

    def _row_fields(self) -> dict:
        """A row's elements and dtype in each row buffer but the products ("g")."""
        d = self.cfg.model.hidden_dim
        return dict(
            x=(d, np.int8),
            y=(4 * d, np.int8),
            # up_gelu_sm90's output: y holds its input, rows other blocks still read
            hidden=(4 * d if self.fused_up else 0, np.int8),
            sb=(3, np.int32),
            sbd=(1, np.int32),
            qkv=(3 * d, np.int8),
        )

    def _row_buffers(self, r, words):
        """Activations of r rows, and `words` int32 words for their products or logits."""
        buffers = {name: cp.empty(r * n, t) for name, (n, t) in self._row_fields().items()}
        return dict(buffers, rows=r, g=cp.empty(words, cp.int32))

    def losses(
        self,
        data: np.ndarray,
        step: int,
        step_seed: int,
        members,
        progress: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """progress is told once, at the end: the sub-batches run asynchronously, and a
        chunk takes the GPU well under a second."""
        out = self.start_losses(data, step, step_seed, members)()
        if progress is not None and len(out):
            progress(len(out), len(out))
        return out

    def start_losses(self, data: np.ndarray, step: int, step_seed: int, members):
        """Queues the members' forward passes and the copy of their losses to pinned host
        memory on the stream; the function returned waits for that copy alone, so
        whatever the caller queued behind it keeps the GPU busy while the host takes the
        losses (Trainer.score_population queues the next chunk first)."""
        members = np.asarray(members, np.int64)
        n = len(members)
        if n == 0:
            return lambda: np.zeros(0, np.int32)
        t = self.cfg.model.seq_len
        seeds = pair_seed(int(step_seed), members // 2).astype(np.uint32)
        signs = member_sign(members).astype(np.int32)
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.int32, n)
        done = cp.cuda.Event(disable_timing=True)
        with self.stream:
            d_tok = self._member_tokens(data, step, members).ravel()
            d_seeds, d_signs = cp.asarray(seeds), cp.asarray(signs)
            loss = cp.empty(n, cp.int32)
            nb = min(self.batch, n)
            buf = self._buffers(nb, logits=not self.fused)
            for s in range(0, n, nb):
                e = min(n, s + nb)
                paired = seeds_in_pairs(seeds[s:e])
                self._forward(
                    buf, d_tok[s * (t + 1) :], d_seeds[s:e], d_signs[s:e], e - s, loss[s:e], paired
                )
            loss.data.copy_to_host_async(host.ctypes.data, host.nbytes, self.stream)
            done.record(self.stream)

        def finish() -> np.ndarray:
            # The device arrays freed above are safe to reuse meanwhile: CuPy's pool
            # hands them out again on this stream only, behind these kernels. The pinned
            # page is not: it goes back to its pool with this function, so the function
            # must be called (Backend.start_losses).
            done.synchronize()
            return host.copy()

        return finish

    def _member_tokens(self, data: np.ndarray, step: int, members: np.ndarray):
        """The members' windows (int32, [members, seq_len + 1]), gathered on the device
        from a copy of the stream kept there: gathering them on the host and copying them
        over took longer than a tenth of the forward, with the GPU idle. A stream too big
        for a quarter of the free device memory is gathered on the host. The copy is
        made once per array object: a caller must not change a stream in place
        (load_tokens's are read-only)."""
        if self._data is None or self._data[0] is not data:
            self._data = None  # the old copy freed before a new one is made
            fits = data.nbytes <= cp.cuda.runtime.memGetInfo()[0] // 4
            self._data = (data, cp.asarray(data) if fits else None)
        on_device = self._data[1]
        if on_device is None:
            return cp.asarray(member_tokens(self.cfg, data, step, members).astype(np.int32))
        pos = cp.asarray(window_starts(self.cfg, len(data), step, members))
        window = cp.arange(self.cfg.model.seq_len + 1)
        return on_device[pos[:, None] + window[None, :]].astype(cp.int32)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Integer logits [window, position, vocab] of the unperturbed model for windows of
        seq_len tokens: the training forward with every member's sign 0."""
        m = self.cfg.model
        tokens = np.asarray(tokens)
        w, t = tokens.shape
        if t != m.seq_len:
            raise ValueError(f"windows of {t} tokens: the gpu backend evaluates {m.seq_len}")
        padded = np.zeros((w, t + 1), np.int32)  # the kernels read windows of seq_len + 1
        padded[:, :t] = tokens
        out = np.empty((w, t, m.vocab_size), np.int64)
        with self.stream:
            d_tok = cp.asarray(padded.ravel())
            seeds, signs = cp.zeros(w, cp.uint32), cp.zeros(w, cp.int32)
            nb = min(self.logit_batch, w)
            buf = self._buffers(nb, logits=True)
            for s in range(0, w, nb):
                n = min(w, s + nb) - s
                ctx = (buf, seeds[s : s + n], signs[s : s + n], n, t, n * t)
                self._head(ctx, d_tok[s * (t + 1) :])
                g = buf["g"][: n * t * m.vocab_size].get(stream=self.stream)
                out[s : s + n] = (
                    g.reshape(n, t, -1).astype(np.int64) >> self.cfg.quantization.shift_logit
                )
        self.stream.synchronize()
        return out

    def _param(self, name: str, layer: int | None = None):
        """A parameter on the device (this layer's copy), its overlays (a matrix's input
        and output side) and its noise offsets (a, b), by its table name."""
        per_layer = PARAM[name].per_layer
        pick = (lambda a: a[layer]) if per_layer else (lambda a: a)
        overlays = [pick(self.dov[o]) for o in PARAM[name].overlays]
        return pick(self.dp[name]), overlays, offsets(self.cfg, name, layer if per_layer else None)

    # Each method below runs one kernel (or a block of them) on ctx = (buffers, seeds,
    # signs, members, positions, rows); scripts/kernels.py checks them one by one.

    def _forward(self, buf, tok, seeds, signs, nb, loss, paired: bool):
        """The members' losses; paired: members 2k and 2k + 1 share their seed, which
        head_loss_sm90 needs (`seeds_in_pairs`; else the portable head runs)."""
        seq = self.cfg.model.seq_len
        ctx = (buf, seeds, signs, nb, seq, nb * seq)
        if self.fused:
            self._hidden(ctx, tok)
            unpaired = not paired and self.head_kernel == "head_loss_sm90"
            self._head_loss(ctx, tok, loss, "head_loss" if unpaired else None)
        else:
            self._head(ctx, tok)
            self._loss(ctx, tok, loss)

    def _head(self, ctx, tok):
        """The forward pass of ctx's rows up to the logits (before >> shift) in buf["g"]."""
        buf, r, m = ctx[0], ctx[5], self.cfg.model
        self._hidden(ctx, tok)
        table = self._param("embedding")[0]
        self._project(table, buf["y"], buf["g"], m.vocab_size, r, m.hidden_dim)

    def _hidden(self, ctx, tok, cache=None, start=0):
        """Embedding, blocks and final norm of ctx's rows into buf["y"] (see `_attention`).
        Each block's residual also runs the norm that comes next (residual_norm)."""
        layers = range(self.cfg.model.n_layers)
        mlp_norm = lambda names, layer: Norm(names.ln, names.ln_bias, layer, (names.up,))
        norms = [mlp_norm(EMB_MLP, None)]
        for layer in layers:
            norms += [Norm("ln_1", "ln_1_bias", layer, QKV), mlp_norm(LAYER_MLP, layer)]
        norms.append(Norm("ln_f", "ln_f_bias", None, ("embedding",)))
        # the sm90 kernels take rows as whole members of seq_len positions: training's
        whole = cache is None and ctx[4] == self.cfg.model.seq_len
        self._embed(ctx, tok)
        self._norm(ctx, norms[0])
        self._mlp(ctx, EMB_MLP, None, norms[1], whole)
        for layer in layers:
            layer_cache = None if cache is None else cache[layer]
            self._attention(ctx, layer, norms[2 * layer + 2], layer_cache, start, whole)
            self._mlp(ctx, LAYER_MLP, layer, norms[2 * layer + 3], whole)

    def _embed(self, ctx, tok):
        buf, seeds, signs, nb, seq, r = ctx
        table, (ov_hidden, ov_vocab), (emb_a, _) = self._param("embedding")
        bias, (ov_bias,), (bias_a, bias_b) = self._param("emb_bias")
        self._launch(
            "embed",
            (nb,),
            (self.nt,),
            tokens=tok,
            seeds=seeds,
            signs=signs,
            emb_t=table,
            emb_bias=bias,
            ov_row=ov_vocab,
            ov_col=ov_hidden,
            ov_bias=ov_bias,
            off_emb=emb_a,
            off_bias_a=bias_a,
            off_bias_b=bias_b,
            x=buf["x"],
            seq=seq,
        )

    def _norm_arguments(self, norm: Norm) -> dict:
        """standard_norm's parameters and the input dots of the matrices that read its
        output next (at most three)."""
        w, (ov_w,), (w_a, w_b) = self._param(norm.weight, norm.layer)
        b, (ov_b,), (b_a, b_b) = self._param(norm.bias, norm.layer)
        dots = []
        for name in norm.readers:
            _, (ov_in, _), (_, off_b) = self._param(name, norm.layer)
            dots.append((ov_in, off_b))
        pad = dots + [(None, 0)] * (3 - len(dots))
        return dict(
            w=w, b=b, ov_w=ov_w, ov_b=ov_b, w_a=w_a, w_b=w_b, b_a=b_a, b_b=b_b,
            ndots=len(dots),
            ov0=pad[0][0], ov1=pad[1][0], ov2=pad[2][0],
            off0=pad[0][1], off1=pad[1][1], off2=pad[2][1],
        )  # fmt: skip

    def _norm(self, ctx, norm: Norm):
        """standard_norm of buf["x"] into buf["y"], and into buf["sb"] the input dots of
        norm.readers."""
        buf, seeds, signs, nb, seq, r = ctx
        self._launch(
            "standard_norm",
            (nb,),
            (self.nt,),
            x=buf["x"],
            y=buf["y"],
            seeds=seeds,
            signs=signs,
            sb=buf["sb"],
            seq=seq,
            rows=r,
            **self._norm_arguments(norm),
        )

    def _mlp(self, ctx, names: Mlp, layer, then: Norm, whole: bool = False):
        """MLP block of ctx's rows (its norm already in buf["y"]), then the norm `then`.
        `whole`: the rows are whole members (training), so the up-projection may run
        fused with mlp_up (`_up_gelu`) and the down-projection as residual_norm's terms
        (`_projection_terms`)."""
        buf, r, d = ctx[0], ctx[5], self.cfg.model.hidden_dim
        if self.fused_up and whole:
            self._up_gelu(ctx, names, layer)
            hidden = buf["hidden"]
        else:
            self._project(self._param(names.up, layer)[0], buf["y"], buf["g"], 4 * d, r, d)
            self._mlp_up(ctx, names, layer)
            hidden = buf["y"]
        shift = self.cfg.quantization.shift_mlp_down
        if self.down_terms and whole:
            self._projection_terms(ctx, "down_terms_sm90", names.down, layer, shift, hidden)
            self._residual(ctx, names.down, layer, shift, then, names.bias_down, terms=True)
        else:
            down = self._param(names.down, layer)[0]
            if self.fused_up and whole:  # its inputs in hidden_order, as up_gelu_sm90 wrote
                down = self.cores[names.down, layer].out.reshape(d, 4 * d)
            self._project(down, hidden, buf["g"], d, r, 4 * d)
            self._residual(ctx, names.down, layer, shift, then, names.bias_down)

    def _mlp_up_arguments(self, ctx, names: Mlp, layer) -> dict:
        """mlp_up's per-member parameters (the up matrix's output noise, the bias, the
        down matrix's input noise), shared by mlp_up and up_gelu_sm90."""
        _, seeds, signs = ctx[:3]
        _, (_, ov_up_out), (up_a, _) = self._param(names.up, layer)
        bias, (ov_bias,), (bias_a, bias_b) = self._param(names.bias_up, layer)
        _, (ov_down_in, _), (_, down_b) = self._param(names.down, layer)
        return dict(
            seeds=seeds, signs=signs, bias_up=bias, ov_up_out=ov_up_out, ov_bias_up=ov_bias,
            ov_down_in=ov_down_in, up_a=up_a, bias_a=bias_a, bias_b=bias_b, down_b=down_b,
            gelu=self.d_gelu,
        )  # fmt: skip

    def _mlp_up(self, ctx, names: Mlp, layer):
        """buf["g"] (the up-projection) -> GELU'd hidden in buf["y"], the down-projection's
        input dot in buf["sbd"]."""
        buf, nb, seq = ctx[0], ctx[3], ctx[4]
        self._launch(
            "mlp_up",
            (nb,),
            (self.nt,),
            g=buf["g"],
            sb_up=buf["sb"],
            hidden=buf["y"],
            sb_down=buf["sbd"],
            seq=seq,
            **self._mlp_up_arguments(ctx, names, layer),
        )

    def _up_gelu(self, ctx, names: Mlp, layer):
        """mlp_up of the up-projection of buf["y"] (its input dot in buf["sb"]) without
        writing the projection: the GEMM and mlp_up in one kernel (up_gelu_sm90.cu). The
        GELU'd hidden goes to buf["hidden"], the down-projection's input dot to
        buf["sbd"]."""
        buf, r = ctx[0], ctx[5]
        self._launch(
            "up_gelu_sm90",
            (-(-r // self.defines["UP_ROWS"]),),
            (4 * self.defines["UP_ROWS"],),  # a warpgroup of 128 threads for 32 rows
            y=buf["y"],
            up_cores=self.cores[names.up, layer].out,
            sb_up=buf["sb"],
            hidden=buf["hidden"],
            sb_down=buf["sbd"],
            rows=r,
            **self._mlp_up_arguments(ctx, names, layer),
        )

    def _residual(
        self, ctx, matrix: str, layer, shift: int, then: Norm, bias: str | None = None, terms=False
    ):
        """buf["x"] += (buf["g"] + the rank-1 term of `matrix`) >> shift [+ bias and its
        noise], max-abs normalised in place (the term's input dot is buf["sbd"]); then
        the norm `then` of x into buf["y"] and its input dots into buf["sb"]. With terms,
        the terms come from `_projection_terms` instead."""
        buf, seeds, signs, nb, seq, r = ctx
        _, (_, ov_out), (off_a, _) = self._param(matrix, layer)
        b, ov_b, b_a, b_b = None, None, 0, 0
        if bias is not None:
            b, (ov_b,), (b_a, b_b) = self._param(bias, layer)
        self._launch(
            "residual_norm",
            (nb,),
            (self.nt,),
            g=None if terms else buf["g"],
            terms=self._terms(buf, r) if terms else None,
            sb_in=None if terms else buf["sbd"],
            x=buf["x"],
            seeds=seeds,
            signs=signs,
            ov_out=None if terms else ov_out,
            off_a=off_a,
            shift=shift,
            bias=b,
            ov_bias=ov_b,
            bias_a=b_a,
            bias_b=b_b,
            y=buf["y"],
            sb_out=buf["sb"],
            seq=seq,
            rows=r,
            **self._norm_arguments(then),
        )

    def _projection_terms(
        self, ctx, kernel: str, matrix: str, layer, shift: int, inputs=None, blocks=None
    ):
        """The projection of `inputs` (buf["y"] by default) by `matrix` (its input dot in
        buf["sbd"]) as residual_norm's terms, (product + rank-1 term) >> shift in 16 bits,
        into buf["g"]'s memory (`_terms`): no product is written. kernel: o_terms_sm90 or
        down_terms_sm90 (terms_sm90.cu), `blocks` of them (at most one an SM, by
        default), each taking tiles of TERMS_ROWS rows in turn. The rows are whole
        members."""
        buf, seeds, signs, nb, seq, r = ctx
        _, (_, ov_out), (off_a, _) = self._param(matrix, layer)
        rows = self.defines["TERMS_ROWS"]
        self._launch(
            kernel,
            (blocks or min(self.sms, -(-r // rows)),),
            (2 * rows,),  # two warpgroups of 64 rows
            inputs=buf["y"] if inputs is None else inputs,
            w_cores=self.cores[matrix, layer].out,
            sb=buf["sbd"],
            seeds=seeds,
            signs=signs,
            ov_out=ov_out,
            off_a=off_a,
            shift=shift,
            terms=self._terms(buf, r),
            rows=r,
        )

    def _terms(self, buf, r):
        """terms_sm90.cu's output: 16 bits a feature in buf["g"]'s memory."""
        return buf["g"].view(cp.int16)[: r * self.cfg.model.hidden_dim]

    def _attention(self, ctx, layer, then: Norm, cache=None, start=0, whole=False):
        """Attention block of ctx's rows (its norm already in buf["y"]), then the norm
        `then`; with a cache (keys, values of the layer, flat [position, hidden]), the
        rows are positions start.. of one unperturbed sequence. `whole`: the rows are
        whole members (training), so q, k and v may come from qkv_rope_sm90."""
        buf, r, d = ctx[0], ctx[5], self.cfg.model.hidden_dim
        if self.fused_qkv and whole:
            self._qkv_rope_sm90(ctx, layer)
        else:
            self._project(self.d_qkv[layer], buf["y"], buf["g"], 3 * d, r, d)  # [rows, q | k | v]
            self._qkv(ctx, layer, start)
        if cache is None:
            self._attention_mix(ctx, layer, self.tensor_attention)
        else:
            self._cached_attention(ctx, cache, start)
        shift = self.cfg.quantization.shift_out
        if self.o_terms and whole:
            self._projection_terms(ctx, "o_terms_sm90", "w_o", layer, shift)
            self._residual(ctx, "w_o", layer, shift, then, terms=True)
        else:
            self._project(self._param("w_o", layer)[0], buf["y"], buf["g"], d, r, d)
            self._residual(ctx, "w_o", layer, shift, then)

    def _qkv_parts(self, ctx):
        buf, r, d = ctx[0], ctx[5], self.cfg.model.hidden_dim
        qkv = buf["qkv"]
        return qkv[: r * d], qkv[r * d : 2 * r * d], qkv[2 * r * d : 3 * r * d]

    def _qkv_arguments(self, ctx, layer) -> dict:
        """qkv_rope's per-member parameters (the output noise of q, k and v), shared by
        qkv_rope and qkv_rope_sm90."""
        buf, seeds, signs = ctx[:3]
        (_, (_, ov_q), (q_a, _)), (_, (_, ov_k), (k_a, _)), (_, (_, ov_v), (v_a, _)) = (
            self._param(w, layer) for w in QKV
        )
        return dict(
            sb=buf["sb"], out=buf["qkv"], seeds=seeds, signs=signs, ov_q=ov_q, ov_k=ov_k,
            ov_v=ov_v, q_a=q_a, k_a=k_a, v_a=v_a, rows=ctx[5],
        )  # fmt: skip

    def _qkv(self, ctx, layer, start=0):
        """buf["g"] ([rows, q | k | v]) -> RoPE'd, normalised q, k, v in buf["qkv"]."""
        rope = self.d_rope[start * self.cfg.model.head_dim :]
        self._launch(
            "qkv_rope",
            (ctx[3],),
            (self.nt,),
            g=ctx[0]["g"],
            rope_tab=rope,
            seq=ctx[4],
            **self._qkv_arguments(ctx, layer),
        )

    def _qkv_rope_sm90(self, ctx, layer):
        """qkv_rope of the q, k, v projections of buf["y"] (their input dots in buf["sb"])
        without writing them: the GEMM and qkv_rope in one kernel (qkv_rope_sm90.cu); the
        rows are whole members, from position 0."""
        self._launch(
            "qkv_rope_sm90",
            (-(-ctx[5] // QKV_ROWS),),
            (2 * QKV_ROWS,),  # a warpgroup of 128 threads for 64 rows
            y=ctx[0]["y"],
            w_cores=self.cores["qkv", layer].out,
            rope_tab=self.d_rope,
            **self._qkv_arguments(ctx, layer),
        )

    def _attention_mix(self, ctx, layer, tensor_cores=False):
        """q, k, v of buf["qkv"] -> mixed values in buf["y"], their o-input dot in
        buf["sbd"]: attention_mix on CUDA cores, attention_mma on the tensor cores."""
        buf, seeds, signs, nb, seq, r = ctx
        q, k, v = self._qkv_parts(ctx)
        _, (ov_o_in, _), (_, o_b) = self._param("w_o", layer)
        cp.cuda.runtime.memsetAsync(buf["sbd"].data.ptr, 0, r * 4, cp.cuda.get_current_stream().ptr)
        if tensor_cores:
            name, threads = "attention_mma", 32 * self.defines["ATT_WARPS"]
        else:
            name, threads = "attention_mix", (self.defines["ATT_SPLIT"] * seq + 31) // 32 * 32
        self._launch(
            name,
            (nb, self.cfg.model.n_heads),
            (threads,),
            q=q,
            k=k,
            v=v,
            mixed=buf["y"],
            sb_o=buf["sbd"],
            seeds=seeds,
            ov_o_in=ov_o_in,
            o_b=o_b,
            exp_tab=self.d_exp,
        )

    def _cached_attention(self, ctx, cache, start):
        """Generation (sign 0: the o-projection's input dot is never used): keys and values
        join the cache, the rows attend over it."""
        buf, seq, d = ctx[0], ctx[4], self.cfg.model.hidden_dim
        q, k, v = self._qkv_parts(ctx)
        keys, values = cache
        keys[start * d : (start + seq) * d] = k
        values[start * d : (start + seq) * d] = v
        self._launch(
            "cached_attention",
            (seq, self.cfg.model.n_heads),
            (128,),
            q=q,
            k_cache=keys,
            v_cache=values,
            mixed=buf["y"],
            pos0=start,
            exp_tab=self.d_exp,
            shared_mem=4 * (start + seq),
        )

    def _loss(self, ctx, tok, loss):
        """sequence_loss of the logits in buf["g"] (their input dot in buf["sb"])."""
        buf, seeds, signs, nb, seq, r = ctx
        _, (_, ov_vocab), (off_a, _) = self._param("embedding")
        self._launch(
            "sequence_loss",
            (nb,),
            (self.nt,),
            g=buf["g"],
            sb=buf["sb"],
            tokens=tok,
            seeds=seeds,
            signs=signs,
            ov_out=ov_vocab,
            off_a=off_a,
            exp_tab=self.d_exp,
            loss=loss,
        )

    def _head_loss(self, ctx, tok, loss, kernel: str | None = None):
        """sequence_loss of the logits of buf["y"] (the final norm, input dot in buf["sb"])
        without writing them: the head's GEMM and the loss in one kernel (`kernel`, by
        default the one chosen for this device)."""
        buf, seeds, signs, nb, seq, r = ctx
        table, (_, ov_vocab), (off_a, _) = self._param("embedding")
        kernel = kernel or self.head_kernel
        sm90 = kernel == "head_loss_sm90"
        cores = dict(emb_cores=self.cores["embedding", None].out) if sm90 else {}
        loss.fill(0)  # rows add to their member's loss
        self._launch(
            kernel,
            (-(-r // self.tile_rows),),
            (self.tile_rows * (2 if sm90 else 1),),  # sm90: warpgroups
            y=buf["y"],
            emb_t=table,
            **cores,
            sb=buf["sb"],
            tokens=tok,
            seeds=seeds,
            signs=signs,
            ov_out=ov_vocab,
            off_a=off_a,
            exp_tab=self.d_exp,
            loss=loss.view(cp.uint32),
            rows=r,
        )

    # --- update -----------------------------------------------------------------------

    def _update_buffers(self):
        if self._upd is not None:
            return self._upd
        cfg = self.cfg
        n_pairs = cfg.training.n_pairs
        pairs = (n_pairs + 15) // 16 * 16
        peak = cfg.noise.perturb_bound**2
        if n_pairs * peak >= 2**31:
            raise NotImplementedError("votes could overflow int32 at this population")
        plan = param_slices(cfg)
        dims = [s.shape for s in plan]
        max_in = max(s[0] for s in dims)
        max_out = max((s[1] for s in dims if len(s) == 2), default=1)
        max_n = max(math.prod(s) for s in dims)
        self._upd = dict(
            pairs=pairs,
            plan=plan,
            dims=dims,
            fit=cp.zeros(pairs, cp.int8),
            seed=cp.zeros(1, cp.uint32),
            lr=cp.zeros(2, cp.float32),
            changes=cp.zeros(1, cp.uint64),
            vote=cp.empty(max_n, cp.int32),
            a=cp.zeros(max_out * pairs, cp.int8),
            b=cp.zeros(max_in * pairs, cp.int8),
            rows=cp.zeros(max(max_in, max_out), cp.int32),
            cols=cp.zeros(max_out, cp.int32),
        )
        return self._upd

    def _update_body(self):
        cfg = self.cfg
        U = self._update_buffers()
        pairs = U["pairs"]
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(U["changes"].data.ptr, 0, 8, stream)
        a_cfg = cfg.adaptive_noise
        for u in U["plan"]:
            shape = u.shape
            sel = (lambda x: x) if u.layer is None else (lambda x, layer=u.layer: x[layer])
            w, m, v, acc = (sel(d[u.name]) for d in (self.dp, self.dm, self.dv, self.dacc))
            n = math.prod(shape)
            if u.param.is_matrix:
                n_in, n_out = shape
                self._noise_matrix(U["b"], None, u.off_b, n_in)
                self._noise_matrix(U["a"], U["fit"], u.off_a, n_out)
                # vote[out, in] (row-major) = sum_p (fit_p a_p[out]) b_p[in]
                self._gemm(U["b"], U["a"], U["vote"], n_in, n_out, pairs, pairs, pairs, n_in)
                inner, cols = n_in, U["cols"]
            else:
                self._vector_votes(U["vote"], u.off_a, u.off_b, n)
                inner, cols = n, None
            self._optimizer_step(
                w,
                m,
                v,
                acc,
                U["vote"],
                n,
                inner,
                U["lr"],
                int(u.param.bias_lr),
                U["rows"],
                cols,
                U["changes"],
            )
            if a_cfg.mode > 0:
                counts = [(u.param.overlays[0], U["rows"], shape[0])]
                if u.param.is_matrix:
                    counts.append((u.param.overlays[1], U["cols"], shape[1]))
                for name, cnt, size in counts:
                    self._launch(
                        "update_overlay",
                        ((size + 255) // 256,),
                        (256,),
                        ov=sel(self.dov[name]),
                        counts=cnt,
                        n=size,
                        inc=a_cfg.inc,
                        dec=a_cfg.dec,
                    )
            else:
                cp.cuda.runtime.memsetAsync(U["rows"].data.ptr, 0, U["rows"].nbytes, stream)
                cp.cuda.runtime.memsetAsync(U["cols"].data.ptr, 0, U["cols"].nbytes, stream)
        self._copy_cores()

    def _noise_matrix(self, out, fitness, off: int, n: int):
        """out[j, p] = pair p's noise j (times its fitness where given), for j < n (update.cu)."""
        U = self._update_buffers()
        self._launch(
            "noise_matrix",
            (-(-U["pairs"] // (4 * 256)), min(65535, max(1, n // 8))),  # ~8 rows a thread
            (256,),
            out=out,
            fitness=fitness,
            step_seed=U["seed"],
            off=off,
            n=n,
            pairs=U["pairs"],
        )

    def _vector_votes(self, vote, off_a: int, off_b: int, n: int):
        """vote[i] = sum_p fit_p a_p[i] b_p[i] for i < n (update.cu): the pairs split into
        enough blocks for about eight an SM."""
        U = self._update_buffers()
        blocks = -(-n // 256)
        share = -(-U["pairs"] * blocks // (8 * self.sms))
        share = max(16, -(-share // 16) * 16)
        stream = cp.cuda.get_current_stream().ptr
        cp.cuda.runtime.memsetAsync(vote.data.ptr, 0, 4 * n, stream)
        self._launch(
            "vector_votes",
            (blocks, -(-U["pairs"] // share)),
            (256,),
            vote=vote,
            fitness=U["fit"],
            step_seed=U["seed"],
            off_a=off_a,
            off_b=off_b,
            n=n,
            pairs_per_block=share,
            pairs=U["pairs"],
        )

    def _optimizer_step(
        self, w, m, v, acc, vote, n, inner, lr_buf, lr_index, row_counts, col_counts, changes
    ):
        """The optimizer step of one parameter slice held as [outer, inner] (update.cu)."""
        o, f = self.cfg.optimizer, np.float32
        self._launch(
            "optimizer_step",
            ((n + 255) // 256,),
            (256,),
            w=w,
            m=m,
            v=v,
            acc=acc,
            vote=vote,
            n=n,
            inner=inner,
            lr_buf=lr_buf,
            lr_index=lr_index,
            row_counts=row_counts,
            col_counts=col_counts,
            changes=changes,
            b1=f(o.beta1),
            omb1=f(1) - f(o.beta1),
            b2=f(o.beta2),
            omb2=f(1) - f(o.beta2),
            eps=f(o.eps),
            wd=f(o.weight_decay),
            sgd_scale=f(o.sgd_vote_scale),
        )

    def _capture(self):
        """Capture the update as a CUDA graph; on failure remember why and run eagerly."""
        stream = self.stream
        try:
            with stream:
                mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
                if mode is None:
                    stream.begin_capture()
                else:
                    stream.begin_capture(mode=mode)
                try:
                    self._update_body()
                finally:
                    graph = stream.end_capture()
            self.graph = graph
        except Exception as e:  # pragma: no cover - depends on the CUDA stack
            self.graph_error = f"{type(e).__name__}: {e}"
            self.use_graph = False
            self.graph = None

    def update(self, fitness, step: int, step_seed: int) -> int:
        cfg = self.cfg
        fitness = np.asarray(fitness)
        if fitness.shape != (cfg.training.n_pairs,):
            raise ValueError(f"fitness must have {cfg.training.n_pairs} entries")
        if np.abs(fitness).max(initial=0) > 1:
            raise ValueError("the gpu update takes ternary fitness (-1, 0, 1)")
        U = self._update_buffers()
        fit = np.zeros(U["pairs"], np.int8)
        fit[: len(fitness)] = fitness
        lr = np.float32(cfg.learning_rate(step))
        lrs = np.array([lr, lr * np.float32(cfg.optimizer.bias_lr_scale)], np.float32)
        with self.stream:
            U["fit"].set(fit, stream=self.stream)
            U["seed"].set(np.array([int(step_seed) & 0xFFFFFFFF], np.uint32), stream=self.stream)
            U["lr"].set(lrs, stream=self.stream)
            if self.use_graph and self.graph is None:
                self._capture()
            if self.graph is not None:
                self.graph.launch(self.stream)
            else:
                self._update_body()
            changes = U["changes"].get(stream=self.stream)
        self.stream.synchronize()
        return int(changes[0])

    # --- generation -------------------------------------------------------------------

    def generate(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
        """Prompt followed by n_tokens sampled tokens, as deggs.numerics.sampling.generate."""
        cfg = self.cfg
        m, s = cfg.model, cfg.sampling
        n_tokens = s.generate_tokens if n_tokens is None else n_tokens
        prompt = np.asarray(prompt, np.int64)
        total = len(prompt) + n_tokens
        buffer = np.zeros(total, np.int64)
        buffer[: len(prompt)] = prompt
        first = max(len(prompt), 1)  # positions run together before the first choice
        if total <= first:
            return buffer
        if total > self.tables.rope.shape[0]:
            self.tables = make_tables(cfg, total)
            self.d_rope = cp.asarray(self.tables.rope.astype(np.int32).ravel())
        if total >= 1 << 16:
            raise ValueError(f"{total} positions: the gpu's choose_token counts in 16 bits")
        if 4 * total > STATIC_SHARED:
            self.kernels["cached_attention"].function.max_dynamic_shared_size_bytes = 4 * total
        penalty, min_p_limit = sampler_limits(cfg)
        seed &= 0xFFFFFFFF
        d = m.hidden_dim
        with self.stream:
            buf = self._gen
            if buf is None or buf["rows"] < first:
                words = max(self._product_words(first, whole=False), m.vocab_size)
                buf = self._gen = self._row_buffers(first, words)
                buf["seed"] = cp.zeros(1, cp.uint32)
                buf["sign"] = cp.zeros(1, cp.int32)  # sign 0: the unperturbed model
            tokens = cp.asarray(buffer.astype(np.int32))
            cache = [
                (cp.zeros(total * d, cp.int8), cp.zeros(total * d, cp.int8))
                for _ in range(m.n_layers)
            ]
            start = 0
            for t in range(first - 1, total - 1):
                seq = t + 1 - start
                ctx = (buf, buf["seed"], buf["sign"], 1, seq, seq)
                self._hidden(ctx, tokens[start:], cache, start)
                self._project(
                    self.dp["embedding"], buf["y"][(seq - 1) * d :], buf["g"], m.vocab_size, 1, d
                )
                self._launch(
                    "choose_token",
                    (1,),
                    (self.defines["CT_THREADS"],),
                    g=buf["g"],
                    tokens=tokens,
                    t=t,
                    seed=seed,
                    penalty=penalty,
                    temperature=s.temperature,
                    min_p_limit=min_p_limit,
                    exp_tab=self.d_exp,
                )
                start = t + 1
            out = tokens.get(stream=self.stream)
        self.stream.synchronize()
        return out.astype(np.int64)
