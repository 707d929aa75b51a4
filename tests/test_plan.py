"""The kernel plan without a GPU: which kernels a config runs on a device, and the choices
a caller makes at construction (deggs/numerics/gpu/plan.py is pure: config and device
figures in, plan out)."""

import dataclasses

import pytest

from deggs.config import Config
from deggs.numerics.gpu.plan import (
    H100,
    KERNELS,
    PROGRAMS,
    STATIC_SHARED,
    UNIT_TWINS,
    VOTE_PARAMS,
    VOTE_SPAN,
    blocks_fit,
    exp_copies,
    exp_last,
    kernel_defines,
    make_plan,
)
from deggs.numerics.gpu.update import GEMM_K_STEP, VectorClusters, vector_starts, vote_gemms
from deggs.numerics.model import make_tables
from deggs.numerics.params import param_slices

# Each kernel's static shared memory as ptxas reports it at the default config (sm_90,
# nvcc 13; tests/test_kernels.py reads the real figures where nvcc is installed)
STATIC = {
    "embed_norm": 2592, "qkv_rope": 3072, "attention_mix": 1280,
    "residual_norm": 2592, "mlp_up": 1024, "sequence_loss": 5504, "attention_mma": 0,
    "head_loss": 0, "cached_attention": 384, "choose_token": 2320, "noise_matrix": 0,
    "vector_votes": 18448, "update_overlay": 0, "gather_pieces": 0, "gather_bytes": 0,
    "adamw_step": 0, "sgd_step": 0, "head_loss_sm90": 128, "up_gelu_sm90": 128,
    "qkv_rope_sm90": 128, "o_residual_sm90": 2048, "down_residual_sm90": 2048,
    "attention_mma_unit": 0,
}  # fmt: skip
MAIN = {k: v for k, v in STATIC.items() if KERNELS[k] in PROGRAMS["main"]}  # no sm90a built
A100 = dataclasses.replace(H100, shared_optin=166912, shared_per_sm=167936, sms=108, hopper=False)
SM90 = ("head_loss_sm90", "up_gelu_sm90", "qkv_rope_sm90", "o_residual_sm90", "down_residual_sm90")


def plan(cfg=None, device=H100, static=STATIC, **choices):
    cfg = cfg or Config()
    return make_plan(cfg, device, kernel_defines(cfg, device), static, **choices)


def test_the_static_table_covers_every_kernel():
    assert set(STATIC) == set(KERNELS)


def test_an_h100_runs_every_hopper_kernel_at_the_default():
    p = plan()
    assert p.hopper and p.fused and p.head == "head_loss_sm90"
    assert p.fused_up and p.fused_qkv and p.o_residual and p.down_residual and p.tensor_attention
    assert set(SM90) <= set(p.shared)
    # a unit twin is launched beside its kernel, with its shared memory
    assert all(p.shared[twin] == p.shared[name] for name, twin in UNIT_TWINS.items())
    # the kernels past 48 KiB with their static part are the ones that opt in
    assert (
        p.opt_in == {k: v for k, v in p.shared.items() if v + STATIC[k] > STATIC_SHARED}
        and "head_loss_sm90" in p.opt_in
    )


def test_elsewhere_the_portable_kernels():
    for p in (plan(hopper=False), plan(device=A100, static=MAIN)):
        assert not p.hopper and p.head == "head_loss" and p.fused
        assert not (p.fused_up or p.fused_qkv or p.o_residual or p.down_residual)
        assert not set(SM90) & set(p.shared)
    with pytest.raises(ValueError, match="need an sm_90 device"):
        plan(device=A100, static=MAIN, hopper=True)


def test_choices_are_made_through_arguments_and_refused_where_they_cannot_run():
    unfused = plan(fused=False)
    assert not unfused.fused and "head_loss" not in unfused.shared
    assert "head_loss_sm90" not in unfused.shared
    portable_head = plan(head="head_loss")
    assert portable_head.head == "head_loss" and "head_loss_sm90" not in portable_head.shared
    assert portable_head.fused_up  # the other choices stay the device's
    no_qkv = plan(qkv=False)
    assert not no_qkv.fused_qkv and "qkv_rope_sm90" not in no_qkv.shared
    assert plan(qkv=True).fused_qkv
    wide = Config().replace(model=dict(hidden_dim=512))  # a row's products past the registers
    with pytest.raises(ValueError, match="qkv_rope_sm90 does not run"):
        plan(wide, qkv=True)
    with pytest.raises(ValueError, match="head_loss_sm90 does not run"):
        plan(hopper=False, head="head_loss_sm90")
    with pytest.raises(ValueError, match="unknown head kernel"):
        plan(head="head_loss_sm100")
    with pytest.raises(ValueError, match="fused head"):
        plan(fused=False, head="head_loss")


def test_a_kernel_runs_only_where_its_static_shared_memory_fits_beside_the_dynamic():
    """head_loss_sm90's barriers (static) beside its tiles (dynamic): at the largest
    vocabulary whose tiles fit alone, the barriers leave no room and the portable head
    runs."""
    cfg = Config()
    p = plan(cfg)
    room = H100.shared_optin - p.shared["head_loss_sm90"]
    assert plan(cfg, static={**STATIC, "head_loss_sm90": room}).head == "head_loss_sm90"
    crowded = plan(cfg, static={**STATIC, "head_loss_sm90": room + 1})
    assert crowded.head == "head_loss" and "head_loss_sm90" not in crowded.shared


def test_a_row_kernel_too_big_for_the_device_is_named_after_compiling():
    mode2 = Config().replace(model=dict(vocab_size=65536), adaptive_noise=dict(mode=2))
    assert kernel_defines(mode2, H100)["LOSS_BINS"] == 0  # no room for the bins
    with pytest.raises(ValueError, match="sequence_loss needs 263552 bytes of shared memory"):
        plan(mode2, static={**STATIC, "sequence_loss": 1408})  # 4 x 65536 dynamic + 1408


@pytest.mark.parametrize(
    "change, bins",
    [
        ({}, True),
        ({"model": dict(vocab_size=57344), "adaptive_noise": dict(mode=2)}, False),
        ({"model": dict(vocab_size=53248), "adaptive_noise": dict(mode=2)}, True),
        ({"quantization": dict(shift_logit=0)}, False),  # logits 2^31 or more apart
        ({"softmax": dict(lut_size=32)}, False),  # the table's last entry is not 0
        ({"softmax": dict(lut_size=4096, exp_scale=200.0)}, False),  # past the bins
    ],
)
def test_sequence_loss_reads_a_row_once_where_its_bins_work(change, bins):
    """LOSS_BINS (forward.cu's sequence_loss): a row counted once in bins only where the
    exp table is 0 from its last entry on, within the bins, logits differ by less than
    2^31 and the bins fit shared memory; else every row is read twice."""
    cfg = Config().replace(**change)
    assert (kernel_defines(cfg, H100)["LOSS_BINS"] > 0) is bins


def test_wide_rows_run_the_hopper_head_in_blocks_of_128_rows():
    """At hidden 1024 (scripts/bench_1024.toml's model) 256 rows do not fit beside two
    tiles: head_loss_sm90 takes 128, held in registers, and runs the head fused where
    the portable head_loss cannot; past hidden 1024 the rows do not fit the registers
    and cuBLAS writes the logits."""
    big = dict(hidden_dim=1024, head_dim=64, n_layers=8, vocab_size=32768)
    p = plan(Config().replace(model=big))
    assert p.fused and p.head == "head_loss_sm90" and "head_loss" not in p.shared
    assert p.defines["HEAD_ROWS"] == p.tile_rows(p.head) == 128 and p.defines["EXP_COPIES"] == 32
    assert p.shared["head_loss_sm90"] + STATIC["head_loss_sm90"] <= H100.shared_optin
    assert plan().defines["HEAD_ROWS"] == plan().tile_rows("head_loss_sm90") == 256
    assert p.tile_rows("head_loss") == 256  # head_loss's 8 warps of 32 rows, whatever runs
    assert not plan(Config().replace(model=dict(big, hidden_dim=2048, head_dim=128))).fused
    with pytest.raises(ValueError, match="head_loss needs more"):
        plan(Config().replace(model=big), head="head_loss")


def test_up_gelu_packs_its_entries_where_eight_bytes_do_not_fit():
    """At hidden 1024 up_gelu_sm90's rows, two tiles and 8-byte entries pass the shared
    memory: its entries go in one word (UP_PACK), one block an SM; in mode 2 they do
    not fit 16 bits and cuBLAS writes the products."""
    big = dict(hidden_dim=1024, head_dim=64, n_layers=8, vocab_size=32768)
    p = plan(Config().replace(model=big))
    assert p.fused_up and (p.defines["UP_PACK"], p.defines["UP_BLOCKS"]) == (1, 1)
    assert not plan(Config().replace(model=big, adaptive_noise=dict(mode=2))).fused_up
    assert not plan(Config().replace(model=dict(big, seq_len=32))).fused_up  # two members a block
    assert (plan().defines["UP_PACK"], plan().defines["UP_BLOCKS"]) == (0, 3)


def test_attention_stages_the_next_item_where_two_buffers_fit():
    """attention_mma's resident blocks: two staging buffers (the next item loading while
    one is scored) at the default, four blocks an SM; one where two would not fit or
    would leave fewer blocks an SM; the tensor cores at every sequence length up to 512
    at head_dim 32 to 128, where its layout of one buffer fits."""
    p = plan()
    assert (p.defines["ATT_BUFFERS"], p.attention_per_sm) == (2, 4)
    for d in (32, 64, 128):
        for seq in (16, 64, 80, 200, 512):
            model = dict(hidden_dim=256, head_dim=d, n_layers=1, seq_len=seq, vocab_size=512)
            cfg = Config().replace(model=model)
            p = plan(cfg)
            assert p.tensor_attention and p.attention_per_sm >= 1, (d, seq)
            if p.defines["ATT_BUFFERS"] == 1:  # two: too big, or fewer blocks an SM
                two = make_plan(cfg, H100, {**p.defines, "ATT_BUFFERS": 2}, STATIC)
                assert two.attention_per_sm < p.attention_per_sm, (d, seq)


def test_the_down_projections_residual_only_beside_up_gelu():
    """down_residual_sm90 writes y into rows.y: its inputs must be up_gelu_sm90's own
    buffer (rows.hidden), or a tile's y would land on rows other tiles still read."""
    p = plan(static={**STATIC, "up_gelu_sm90": 1 << 20})  # up_gelu_sm90 does not fit
    assert not p.fused_up and not p.down_residual and p.o_residual


def test_mode_2_runs_no_fused_residual():
    """residual_sm90.cu's tables hold one-word dot entries: not adaptive mode 2's."""
    p = plan(Config().replace(adaptive_noise=dict(mode=2)))
    assert not p.o_residual and not p.down_residual and p.head == "head_loss_sm90"


def test_the_device_sizes_the_exp_table_copies_and_up_gelus_blocks():
    """Read from the device, not an H100's figures applied to any: with a smaller SM the
    exp table's copies shrink so that two head_loss blocks still share one."""
    cfg = Config()
    last = exp_last(make_tables(cfg).exp)
    assert exp_copies(cfg, last, H100) == 32
    small = dataclasses.replace(H100, shared_per_sm=2 * (110_000 + H100.reserved_per_block))
    copies = exp_copies(cfg, last, small)
    assert copies < 32 and kernel_defines(cfg, small)["EXP_COPIES"] == copies
    assert kernel_defines(cfg, H100)["UP_BLOCKS"] == 3
    assert kernel_defines(cfg, dataclasses.replace(H100, shared_per_sm=100_000))["UP_BLOCKS"] == 2
    assert blocks_fit(2, 1000, H100) and not blocks_fit(2, H100.shared_per_sm // 2, H100)


def test_every_kernel_has_a_harness_check_or_says_what_covers_it():
    """scripts/kernels.py: a check a kernel (variants beside), or the test that covers it."""
    import kernels as harness  # scripts/kernels.py

    assert set(KERNELS) <= set(harness.CHECKS) | set(harness.UNCHECKED)
    assert not set(harness.UNCHECKED) & set(harness.CHECKS)


def test_auto_names_why_it_chose_the_cpu(monkeypatch, caplog):
    import deggs.numerics.gpu as gpu
    from deggs.numerics import backend

    monkeypatch.setattr(gpu, "why_no_gpu", lambda: "CuPy sees no CUDA device (none present)")
    with caplog.at_level("INFO", logger="deggs.numerics.backend"):
        chosen = backend.make_backend(Config().replace(model=dict(n_layers=1)), "auto", 1)
    assert chosen.name == "cpu"
    assert "backend auto: the CPU, since CuPy sees no CUDA device (none present)" in caplog.text
    with pytest.raises(backend.BackendError, match="needs CuPy and a CUDA device: CuPy sees no"):
        backend.make_backend(Config(), "gpu")


def test_vector_votes_clusters_hold_every_slice_once_within_their_bounds():
    """update.cu's vector_votes adds into a cluster's slices from one hash a seed: each
    cluster one seed distance, its offsets within VOTE_SPAN, at most VOTE_PARAMS slices,
    the longest first; every vector slice in exactly one."""
    cfg = Config()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=12))
    slices = param_slices(cfg)
    # one layer's input seeds moved apart, as the embedding's are
    slices = [dataclasses.replace(s, off_b=s.off_a + 7) if s.layer == 5 else s for s in slices]
    vector_at, _ = vector_starts(slices)
    table = VectorClusters.layout(slices, vector_at).astype(int)
    seen = []
    for cluster in table:
        (off, span, count, d), rows = cluster[0], cluster[1 : cluster[0, 2] + 1]
        assert 0 < count <= VOTE_PARAMS and span <= VOTE_SPAN
        assert list(rows[:, 1]) == sorted(rows[:, 1], reverse=True)  # the longest first
        assert rows[:, 0].min() == 0 and rows[:, 0].max() == span
        for r, length, at, _ in rows:
            (i,) = [i for i, a in vector_at.items() if a == at]
            s = slices[i]
            assert (s.off_a, s.off_b - s.off_a, s.shape[0]) == (off + r, d, length)
            seen.append(i)
    assert sorted(seen) == sorted(vector_at) and len(table) > 2


@pytest.mark.parametrize("pairs", [163840, 1008, 8])
def test_vote_gemms_cover_every_matrix_pair_once_and_take_a_layers_qkvo_together(pairs):
    """update.py's VoteGemm: a GEMM over a window of the noise fields sums seeds base ..
    base + k, which must hold each of its slices' pairs (seeds off_a .. off_a + pairs),
    start 16-byte aligned and run a multiple of GEMM_K_STEP; a layer's q, k, v and o take
    one GEMM at every layer (at 163,840 pairs, a multiple of 256, q's offset in odd layers
    is a multiple of 16 and k, v and o's are not); every matrix slice is in one GEMM."""
    cfg = Config()
    slices = param_slices(cfg)
    gemms = vote_gemms(slices, pairs)
    seen = [i for g in gemms for i in g.slices]
    assert sorted(seen) == [i for i, s in enumerate(slices) if s.param.is_matrix]
    for g in gemms:
        members = [slices[i] for i in g.slices]
        assert g.inputs == members[0].shape[0] and g.outputs == sum(s.shape[1] for s in members)
        if g.shared is None:  # the embedding: its input seeds are not its output seeds + 1
            assert [s.name for s in members] == ["embedding"] and g.k == pairs
            continue
        assert g.base % 16 == 0 and g.k % GEMM_K_STEP == 0 and g.k <= pairs + GEMM_K_STEP
        for s in members:
            assert s.off_b == s.off_a + 1 and g.base <= s.off_a <= s.off_a + pairs <= g.base + g.k
    together = [[slices[i].name for i in g.slices] for g in gemms if len(g.slices) > 1]
    assert together == [["w_q", "w_k", "w_v", "w_o"]] * cfg.model.n_layers
