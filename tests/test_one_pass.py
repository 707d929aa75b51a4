"""head_loss_sm90's one sweep over the vocabulary (deggs/numerics/gpu/one_pass.py):
wherever it is sure of a row, its floor(log2) of the row's sum is the two-pass one.

The rows are built to hurt it: peaks that rise tile after tile, terms piled just under
the peak, sums on and next to powers of two, tables whose last entry is not zero."""

import numpy as np
import pytest

from deggs.config import Config
from deggs.numerics.gpu.one_pass import exp_bounds, one_pass_log2, two_pass_log2
from deggs.numerics.gpu.plan import H100, exp_last, kernel_defines
from deggs.numerics.model import make_tables


def table(**softmax):
    cfg = Config().replace(softmax=softmax) if softmax else Config()
    exp = make_tables(cfg, positions=1).exp
    return exp, exp_last(exp), cfg.softmax.scale_bit


TABLES = {
    "default": {},
    "short table, last entry not zero": dict(lut_size=32),
    "wide exponent": dict(exp_scale=40.0, lut_size=1024),
    "30 bits": dict(scale_bit=30),
    "3 bits": dict(scale_bit=3, exp_scale=2.0),
}


def adversarial_rows(rng, vocab: int, last: int) -> np.ndarray:
    """Rows [row, vocab] of shifted logits."""
    v = np.arange(vocab)
    rows = [
        v // 64,  # the peak rises by one every tile, every term near it
        v // 64 * 3,  # by three
        v // 64 * (last // 2 + 1),  # by more than half the table
        np.where(v == vocab - 1, 1, 0),  # everything moved once, at the very end
        np.where(v == vocab - 1, last, last - 1),  # the same, only the peak's term left
        np.where(v >= vocab - 64, 5, 0) + v % 3,  # the last tile's rise over a plateau
        -v // 64,  # the peak first, falling
    ]
    # sums on and next to a power of two: 2^j terms at the peak, then one term more or
    # none, the peak reached only in the last tile
    for j in (0, 3, 7, 10):
        row = np.full(vocab, -10 * last)
        row[vocab - 2**j :] = 0
        rows.append(row)
        extra = row.copy()
        extra[0] = -1
        rows.append(extra)
        rises = row.copy()
        rises[: vocab - 2**j] = -(v[: vocab - 2**j] % 5)  # near terms, then the peak late
        rows.append(rises)
    rows += [rng.normal(0, s, vocab).round() for s in (1, 3, 6, 10, 20, 40) for _ in range(20)]
    rows += [(rng.standard_t(3, vocab) * 8).round() for _ in range(20)]
    rows += [np.sort(rng.normal(0, 10, vocab)).round() for _ in range(20)]  # ascending
    return np.array(rows, np.int64)


@pytest.mark.parametrize("live", [False, True], ids=["all values", "live values"])
@pytest.mark.parametrize("softmax", TABLES.values(), ids=TABLES.keys())
@pytest.mark.parametrize("vocab", [8192, 150, 4100])
def test_a_sure_row_has_the_two_pass_log2(softmax, vocab, live):
    exp, last, scale_bit = table(**softmax)
    if live and exp[last] != 0:  # every value may move inexactly: the plan counts all
        wide = Config().replace(softmax=softmax, model=dict(hidden_dim=1024, vocab_size=32768))
        assert kernel_defines(wide, H100)["HEAD_LIVE"] == 0
        return
    rows = adversarial_rows(np.random.default_rng(vocab), vocab, last)
    sure, log2 = one_pass_log2(rows, exp, last, scale_bit, live=live)
    expected = two_pass_log2(rows, exp, last)
    wrong = np.flatnonzero(sure & (log2 != expected))
    assert not len(wrong), f"rows {wrong}: {log2[wrong]} against {expected[wrong]}"
    assert sure.mean() > 0.5  # most rows are decided in one sweep


def test_both_outcomes_are_reached():
    """The interval is used, not only the exact sums: rows whose terms were moved are
    decided by it, and some rows are left open (the kernel sweeps again for those)."""
    exp, last, scale_bit = table()
    rng = np.random.default_rng(1)
    rows = np.array([rng.normal(0, 20, 8192).round() for _ in range(400)], np.int64)
    sure, log2 = one_pass_log2(rows, exp, last, scale_bit)
    assert (log2[sure] == two_pass_log2(rows, exp, last)[sure]).all()
    assert 0 < (~sure).sum() < 40


def test_counting_live_values_leaves_fewer_rows_open():
    """Over a wide vocabulary most values lie far below the peak, at the zero entry:
    counted out of the moves' error, they no longer widen the interval."""
    exp, last, scale_bit = table()
    rng = np.random.default_rng(2)
    rows = np.array([rng.normal(0, 40, 32768).round() for _ in range(200)], np.int64)
    expected = two_pass_log2(rows, exp, last)
    open_rows = {}
    for live in (False, True):
        sure, log2 = one_pass_log2(rows, exp, last, scale_bit, live=live)
        assert (log2[sure] == expected[sure]).all()
        open_rows[live] = int((~sure).sum())
    assert open_rows[True] < open_rows[False] / 4, open_rows


@pytest.mark.parametrize("softmax", TABLES.values(), ids=TABLES.keys())
def test_the_bounds_hold_for_every_entry_and_rise(softmax):
    """alpha_d e[k] - beta_d <= e[min(k + d, last)] <= alpha_d e[k] + gamma_d, checked in
    exact integers and fractions over the whole table."""
    from fractions import Fraction

    exp, last, _ = table(**softmax)
    bounds = exp_bounds(exp, last)
    e = [int(x) for x in exp[: last + 1]]
    for d in range(last + 1):
        alpha, beta, gamma = (Fraction(float(x)) for x in bounds[d, :3])
        assert beta >= 0 and gamma >= 0
        for k in range(last + 1):
            moved = e[min(k + d, last)]
            assert alpha * e[k] - beta <= moved <= alpha * e[k] + gamma, (d, k)
