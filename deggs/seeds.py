"""Seed math shared by the coordinator and the workers, in plain Python.

A run's randomness is a function of two 32-bit numbers: the step seed, which every step
derives from the one before it, and the population member. Keeping this module free of
NumPy and numba lets the coordinator (and every command's --help) start without them.
"""

from __future__ import annotations

U32 = 0xFFFFFFFF


def hash_rng(seed: int, idx: int) -> int:
    """The reference's counter-based hash: MurmurHash3's finaliser of seed + idx * phi.

    All arithmetic wraps at 2^32.
    """
    x = (seed + idx * 0x9E3779B9) & U32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & U32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & U32
    x ^= x >> 16
    return x


def next_step_seed(seed: int, new_step: int) -> int:
    """Seed of step `new_step`, from the seed of the step before it."""
    return hash_rng(seed & U32, new_step & U32)


def pair_seed(step_seed, pair):
    """The noise seed of antithetic pair `pair` (members 2 pair and 2 pair + 1) at a step.

    Works on Python ints and on NumPy integer arrays alike.
    """
    return (step_seed + pair) & U32


def member_sign(member):
    """+1 for the even member of a pair (it adds the noise), -1 for the odd one."""
    return 1 - 2 * (member % 2)
