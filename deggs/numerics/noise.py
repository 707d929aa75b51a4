"""Counter-based noise: every worker regenerates the same perturbations from (seed, index).

`hash_u32` is deggs.seeds.hash_rng compiled by numba, `hash_np` the same over NumPy
arrays (all arithmetic wraps at 2^32). `noise_from_hash` turns one hash into a small
signed int8: uniform in [-mask, mask] by default, or the sum of three such samples (the
reference's "Gaussian"). The initial weights come from a xorshift32 stream instead, in
parameter order.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(inline="always")
def hash_u32(seed, idx):
    x = np.uint32(np.uint32(seed) + np.uint32(idx) * np.uint32(0x9E3779B9))
    x ^= x >> np.uint32(16)
    x = np.uint32(x * np.uint32(0x85EBCA6B))
    x ^= x >> np.uint32(13)
    x = np.uint32(x * np.uint32(0xC2B2AE35))
    x ^= x >> np.uint32(16)
    return x


@numba.njit(inline="always")
def sample_from_bits(r, mask, three_sample):
    """Signed sample(s) from a random word: bit 0 the sign, the next bits the magnitude."""
    r = np.uint32(r)
    m = np.uint32(mask)
    n = np.int32(r >> np.uint32(1) & m)
    if not (r & np.uint32(1)):
        n = -n
    if three_sample:
        n2 = np.int32(r >> np.uint32(6) & m)
        if not (r & np.uint32(32)):
            n2 = -n2
        n3 = np.int32(r >> np.uint32(11) & m)
        if not (r & np.uint32(1024)):
            n3 = -n3
        n = n + n2 + n3  # |n| <= 3 * 31 fits the reference's int8
    return n


@numba.njit(inline="always")
def noise_from_hash(seed, idx, mask, three_sample):
    return sample_from_bits(hash_u32(seed, idx), mask, three_sample)


@numba.njit(cache=True, nogil=True)
def noise_table(seeds, idx, mask, three_sample):
    """out[r, j] = noise_from_hash(seeds[r], idx[j]): one row per member (or pair).

    Serial and GIL-free: the backend runs batches of members on several threads.
    """
    out = np.empty((seeds.shape[0], idx.shape[0]), np.int32)
    for r in range(seeds.shape[0]):
        s = np.uint32(seeds[r])
        for j in range(idx.shape[0]):
            out[r, j] = noise_from_hash(s, idx[j], mask, three_sample)
    return out


@numba.njit(cache=True)
def xorshift_noise(state, n, mask, three_sample):
    """n int8 samples from a xorshift32 stream; returns (samples, new_state)."""
    out = np.empty(n, np.int8)
    x = np.uint32(state)
    for i in range(n):
        x ^= np.uint32(x << np.uint32(13))
        x ^= x >> np.uint32(17)
        x ^= np.uint32(x << np.uint32(5))
        out[i] = sample_from_bits(x, mask, three_sample)
    return out, x


# --- NumPy forms, broadcasting over arrays of seeds and indices --------------------


def hash_np(seed, idx):
    """hash_rng over broadcast uint32 arrays (NumPy integer arithmetic wraps)."""
    x = np.asarray(seed, dtype=np.uint32) + np.asarray(idx, dtype=np.uint32) * np.uint32(0x9E3779B9)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


def samples_np(r, mask: int, three_sample: bool):
    """Signed samples from random words, as int64 (see sample_from_bits)."""
    r = r.astype(np.int64)
    n = np.where(r & 1, 1, -1) * ((r >> 1) & mask)
    if three_sample:
        n = n + np.where(r & 32, 1, -1) * ((r >> 6) & mask)
        n = n + np.where(r & 1024, 1, -1) * ((r >> 11) & mask)
    return n


def noise_np(seed, idx, mask: int, three_sample: bool):
    """noise_from_hash over broadcast arrays of seeds and indices, as int64."""
    return samples_np(hash_np(seed, idx), mask, three_sample)
