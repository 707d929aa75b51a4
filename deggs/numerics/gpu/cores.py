"""The orders in which the sm90a kernels copy their matrices into shared memory (pure
NumPy index arithmetic, tested without a GPU in tests/test_kernels.py).

A CoreCopy keeps a weight matrix on the device in the order its kernel copies it into
shared memory as it is, so a tile's copy is contiguous, with no index arithmetic in the
kernel (it was much of qkv_rope_sm90's time). state.DeviceState makes the
copies again after every update (update.cu's gather_pieces and gather_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cuda import DeviceArray
from .plan import TILE_N


@dataclass(frozen=True)
class CoreCopy:
    """A weight matrix in an sm90 kernel's order, made again from `source` after every
    update: out's piece i is source's piece index[i], of `piece` bytes (16; 1 where the
    inputs are reordered too, in_hidden_order)."""

    source: DeviceArray  # the matrix, K-contiguous int8 on the device
    index: DeviceArray  # on the device
    out: DeviceArray
    piece: int = 16


def sliced_core_pieces(order: np.ndarray, k: int, slice_: int) -> np.ndarray:
    """core_pieces for residual_sm90.cu: a copy whose row i is row order[i] of a
    K-contiguous matrix of k bytes a row, cut into slices of slice_ bytes, each slice
    (all rows) in the core-matrix layout, slice after slice."""
    pieces, per = k // 16, slice_ // 16
    s, group, piece, r = np.meshgrid(
        np.arange(k // slice_),
        np.arange(len(order) // 8),
        np.arange(per),
        np.arange(8),
        indexing="ij",
    )
    row = np.asarray(order)[group * 8 + r]
    return (row * pieces + s * per + piece).astype(np.int32).ravel()


def residual_order(hidden: int) -> np.ndarray:
    """The output features of residual_sm90.cu's accumulator columns: column 64 c + 8 j
    + 2 tig + e (a thread's, tig its place in its quad) is feature tig hidden / 4 + 16 c
    + 2 j + e, so that a thread's features of a row are contiguous."""
    n = np.arange(hidden)
    c, j, tig, e = n >> 6, (n >> 3) & 7, (n >> 1) & 3, n & 1
    return tig * (hidden // 4) + 16 * c + 2 * j + e


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
    matrix's inputs in this order (DeviceState's copies)."""
    p = np.arange(4 * hidden)
    return p // 4 + p % 4 * hidden


def in_hidden_order(index: np.ndarray, k: int) -> np.ndarray:
    """A copy's piece index (core_pieces, sliced_core_pieces) over a matrix of k inputs a
    row taken in hidden_order, as the index of each of its bytes in the matrix itself:
    the down-projection's copies where up_gelu_sm90 writes its input."""
    byte = (index[:, None] * 16 + np.arange(16)).ravel()
    return (byte - byte % k + hidden_order(k // 4)[byte % k]).astype(np.int32)
