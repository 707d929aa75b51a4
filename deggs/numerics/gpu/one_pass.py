"""Why head_loss_sm90 may score a row in one sweep over the vocabulary, and when not.

sequence_loss needs of each row only floor(log2 T), T = sum over the vocabulary of
e[min(peak - l, last)]: e the exp table up to `last` (plan.exp_last), l a logit, peak
the row's largest. A sweep does not know the peak until its end. head_loss_sm90 sums
against the running peak (its quad of threads shares it, tile by tile); when the peak
rises by d, every term already summed must move from entry k to entry min(k + d, last),
and those terms are gone. What it keeps instead is an interval: for each d, trying
every entry of the table gives an affine pair with

    alpha_d e[k] - beta_d  <=  e[min(k + d, last)]  <=  alpha_d e[k] + gamma_d

for all k, so n terms whose sum lies in [X_lo, X_hi] move to a sum in
[alpha_d X_lo - n beta_d, alpha_d X_hi + n gamma_d] (n at most the values seen). Where
e[last] = 0, a value summed at entry `last` stays there under every later peak and moves
exactly (both sides 0), so n need count only the values summed at an entry up to
`last` ("live": HEAD_LIVE, in head_loss_sm90's wide blocks, which sweep again for one
open row; elsewhere the count's instruction a logit costs more than it saves). At the
end T lies in [L, H], and T >= e[0] = 2^scale_bit (the peak's own term). Where
floor(log2 L) = floor(log2 H), that is T's: exact. Else the row is left open and
summed again with its peak known, the two-pass result: on the CUDA cores where its
block has a few such rows (OPEN_ROWS), by a second sweep of the block where it has
more. The kernel rounds every bound outward (float32 in directed rounding), so it may
leave more rows open than the model below, never decide one less exactly.

`one_pass_log2` is that decision on the CPU, the kernel's order of values included;
tests/test_one_pass.py checks it against the two-pass result on adversarial rows.
"""

from __future__ import annotations

import numpy as np

# Headroom for float64's rounding in `exp_bounds` (alpha e[k] has up to 55 bits).
SLACK = 2.0**-16


def exp_bounds(exp: np.ndarray, last: int) -> np.ndarray:
    """float32 [last + 1, 4]: row d holds alpha_d, beta_d, gamma_d (and a zero) for a
    rise of d (d >= last: every term at entry `last`). alpha_d = e[d] / e[0]; beta and
    gamma are the largest misses over every entry, never negative, rounded up."""
    e = np.asarray(exp[: last + 1], np.float64)
    k = np.arange(last + 1)
    out = np.zeros((last + 1, 4), np.float32)
    for d in range(last + 1):
        alpha = np.float32(e[d] / e[0])
        moved = e[np.minimum(k + d, last)]
        for col, miss in ((1, float(alpha) * e - moved), (2, moved - float(alpha) * e)):
            # alpha 0: every product is 0 and every miss an exact integer, no slack
            bound = max(0.0, float(miss.max()) + (SLACK if alpha else 0.0))
            up = np.float32(bound)
            if float(up) < bound:  # compared in float64: a float32 compare rounds bound
                up = np.nextafter(up, np.float32(np.inf))
            out[d, col] = up
        out[d, 0] = alpha
    return out


def _down(x):
    return np.nextafter(x, -np.inf)


def _up(x):
    return np.nextafter(x, np.inf)


def one_pass_log2(
    logits: np.ndarray,
    exp: np.ndarray,
    last: int,
    scale_bit: int,
    tile_n: int = 64,
    live: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(sure, log2) of each row of `logits` [row, vocab] as the one sweep finds them:
    where `sure`, log2 is floor(log2 T); elsewhere the kernel sums the row again. A
    quad's thread `tig` holds columns 8 j + 2 tig + {0, 1} of each tile of `tile_n`.
    live: a move's n counts the live values only (the kernel's HEAD_LIVE, which the plan
    sets only where e[last] = 0)."""
    lgt = np.asarray(logits, np.int64)
    rows, vocab = lgt.shape
    bounds = exp_bounds(exp, last).astype(np.float64)
    e = np.asarray(exp[: last + 1], np.int64)
    peak = np.full(rows, np.iinfo(np.int64).min)
    total = np.zeros((4, rows), np.int64)
    seen = np.zeros((4, rows), np.int64)  # live values a thread summed
    lo, hi = np.zeros((4, rows)), np.zeros((4, rows))
    cols = np.arange(tile_n).reshape(tile_n // 8, 4, 2).transpose(1, 0, 2).reshape(4, -1)
    for t0 in range(0, vocab, tile_n):
        mine = [c[c < vocab - t0] + t0 for c in cols]  # each thread's columns of the tile
        top = lgt[:, t0 : t0 + tile_n].max(-1)
        rise = (top > peak) & (t0 > 0)
        if rise.any():
            d = np.minimum(top[rise] - peak[rise], last)
            alpha, beta, gamma = bounds[d, 0], bounds[d, 1], bounds[d, 2]
            # values a thread summed (live ones): at least the terms moved inexactly
            n = seen[:, rise] if live else t0 // 4
            lo[:, rise] = np.maximum(
                0.0, _down(_down(alpha * _down(lo[:, rise] + total[:, rise])) - n * beta)
            )
            hi[:, rise] = _up(_up(alpha * _up(hi[:, rise] + total[:, rise])) + n * gamma)
            total[:, rise] = 0
        peak = np.maximum(peak, top)
        for tig in range(4):
            below = peak[:, None] - lgt[:, mine[tig]]
            total[tig] += e[np.minimum(below, last)].sum(-1)
            seen[tig] += (below <= last).sum(-1)
    exact = hi.sum(0) == 0
    # four threads' bounds summed: a few roundings, well inside 2^-40 relative
    low = np.maximum((lo.sum(0) + total.sum(0)) * (1 - 2.0**-40), float(2**scale_bit))
    high = (hi.sum(0) + total.sum(0)) * (1 + 2.0**-40)
    low_log2, high_log2 = np.frexp(low)[1] - 1, np.frexp(high)[1] - 1
    sure = exact | (low_log2 == high_log2)
    log2 = np.where(exact, np.frexp(total.sum(0).astype(np.float64))[1] - 1, low_log2)
    return sure, log2


def two_pass_log2(logits: np.ndarray, exp: np.ndarray, last: int) -> np.ndarray:
    """floor(log2 T) with the peak known first (model.sequence_loss's)."""
    lgt = np.asarray(logits, np.int64)
    e = np.asarray(exp[: last + 1], np.int64)
    total = e[np.minimum(lgt.max(-1)[:, None] - lgt, last)].sum(-1)
    return np.frexp(total.astype(np.float64))[1] - 1
