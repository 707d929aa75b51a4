"""The GPU backend against the CPU backend and the golden vectors.

Every test is marked requires_gpu: conftest.py skips them without CuPy and a CUDA device
(fails them instead under DEGGS_REQUIRE_GPU=1). The module imports without CuPy.
"""

import re

import numpy as np
import pytest

from deggs.config import Config
from deggs.numerics.cpu import CpuBackend

pytestmark = pytest.mark.requires_gpu


def small_config(rng, **switches):
    hidden = int(rng.choice([32, 64]))
    head = int(rng.choice([h for h in (32, 64) if h <= hidden]))
    vocab = int(rng.choice([256, 512]))
    cfg = Config().replace(
        model=dict(
            hidden_dim=hidden,
            head_dim=head,
            n_layers=int(rng.integers(1, 3)),
            seq_len=int(rng.choice([8, 16, 32])),
            vocab_size=vocab,
        ),
        training=dict(
            population_size=64,
            chunk_size=32,
            seed=int(rng.integers(2**32)),
            init_seed=int(rng.integers(1, 2**31)),
        ),
        sampling=dict(prompt_tokens=8, generate_tokens=8),
    )
    return cfg.replace(**switches) if switches else cfg


def compare_states(cpu, gpu):
    for what in ("params", "overlays"):
        ours, theirs = getattr(gpu, what), getattr(cpu, what)
        for k, v in theirs.items():
            assert np.array_equal(ours[k], v), f"{what} {k}"
    gs, cs = gpu.state, cpu.state
    for part in ("m", "v", "acc"):
        for k, v in getattr(cs, part).items():
            assert np.array_equal(getattr(gs, part)[k], v), f"state {part} {k}"


SWITCHES = [
    {},
    dict(
        noise=dict(perturb_distribution="three_sample", init_distribution="three_sample"),
        adaptive_noise=dict(mode=2),
    ),
    dict(adaptive_noise=dict(mode=0)),
    dict(optimizer=dict(kind="sgd", sgd_vote_scale=0.25)),
]


@pytest.mark.parametrize("case", range(len(SWITCHES)))
def test_gpu_matches_cpu_on_random_configs(case):
    rng = np.random.default_rng(1000 + case)
    cfg = small_config(rng, **SWITCHES[case])
    data = rng.integers(0, cfg.model.vocab_size, 5000).astype(cfg.token_dtype)
    # case 2 runs the unfused head (cuBLAS logits, then sequence_loss), case 1 the
    # portable kernels; the others Hopper's (head_loss_sm90, up_gelu_sm90, and
    # qkv_rope_sm90 at hidden 64) on an H100 or H200
    batch = int(rng.integers(3, 40))
    cpu = CpuBackend(cfg, threads=1)
    gpu = GpuBackend_(cfg, batch=batch, fused=case != 2, hopper=False if case == 1 else None)
    plan = gpu.plan
    assert plan.fused == (case != 2)
    if case in (0, 3) and cp_device_is_hopper():
        assert plan.head == "head_loss_sm90" and plan.fused_up
        assert plan.fused_qkv == (cfg.model.hidden_dim == 64)
    if case == 1:
        assert plan.head == "head_loss" and not plan.fused_up and not plan.fused_qkv
    compare_states(cpu, gpu)
    seed = cfg.training.seed
    members = np.arange(cfg.training.population_size)
    updating, changed = None, 0  # the GPU's update, started and not yet waited for
    for step in range(3):
        picked = members if step != 1 else rng.permutation(members)[:17]
        # queued behind the update started below, before its count is waited for
        ours = gpu.losses(data, step, seed, picked)
        theirs = cpu.losses(data, step, seed, picked)
        assert np.array_equal(ours, theirs), f"losses at step {step}"
        if updating is not None:
            assert updating() == changed
            compare_states(cpu, gpu)
        fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
        updating = gpu.start_update(fitness, step, seed)
        changed = cpu.update(fitness, step, seed)
        seed = int(rng.integers(2**32))
    assert updating() == changed
    compare_states(cpu, gpu)
    prompt = data[: cfg.sampling.prompt_tokens]
    assert np.array_equal(gpu.generate(prompt, 7), cpu.generate(prompt, 7))


def test_windows_come_from_the_stream_given(monkeypatch):
    """The backend keeps a device copy of the token stream: another stream is copied in
    its place, and one too big for the device's free memory is gathered on the host;
    the losses are the CPU's every time."""
    import cupy

    rng = np.random.default_rng(9)
    cfg = small_config(rng)
    cpu, gpu = CpuBackend(cfg, threads=1), GpuBackend_(cfg)
    vocab, seed = cfg.model.vocab_size, cfg.training.seed
    members = rng.permutation(cfg.training.population_size)[:20]
    first, second, third = (
        rng.integers(0, vocab, n).astype(cfg.token_dtype) for n in (900, 4000, 3000)
    )
    for step, data in enumerate((first, second, first)):
        ours = gpu.losses(data, step, seed, members)
        assert np.array_equal(ours, cpu.losses(data, step, seed, members)), step
        assert gpu.tokens.device is not None  # gathered on the device
    monkeypatch.setattr(cupy.cuda.runtime, "memGetInfo", lambda: (0, 0))
    told = []
    ours = gpu.losses(third, 3, seed, members, lambda done, total: told.append((done, total)))
    assert told == [(20, 20)]  # once, at the end
    assert gpu.tokens.device is None  # gathered on the host
    assert np.array_equal(ours, cpu.losses(third, 3, seed, members))


def test_chunks_queued_behind_each_other_score_as_alone():
    """start_losses leaves a chunk scoring while the next is queued behind it (what
    Trainer.score_population does): the losses are the CPU's, collected in any order,
    also where a queued chunk reads another token stream (the device copy of the first
    is replaced while its kernels may still be reading it)."""
    from deggs.numerics.es import Trainer, chunk_members

    rng = np.random.default_rng(11)
    cfg = small_config(rng).replace(training=dict(population_size=96, chunk_size=32))
    cpu, gpu = CpuBackend(cfg, threads=1), GpuBackend_(cfg, batch=7)
    first, second = (
        rng.integers(0, cfg.model.vocab_size, n).astype(cfg.token_dtype) for n in (900, 4000)
    )
    seed = cfg.training.seed
    jobs = [(first, 0, chunk_members(cfg, 0)), (second, 0, chunk_members(cfg, 1))]
    jobs.append((first, 1, chunk_members(cfg, 2)))
    waits = [gpu.start_losses(data, step, seed, members) for data, step, members in jobs]
    got = [wait() for wait in reversed(waits)][::-1]
    for (data, step, members), ours in zip(jobs, got, strict=True):
        assert np.array_equal(ours, cpu.losses(data, step, seed, members)), members[0]
    ours, theirs = Trainer(gpu).score_population(second), Trainer(cpu).score_population(second)
    assert [r.losses.tolist() for r in ours] == [r.losses.tolist() for r in theirs]
    assert [r.packed for r in ours] == [r.packed for r in theirs]


# Sampling settings x model switches of the generation comparisons (vocab 256: bytes).
GENERATION = [
    (dict(temperature=0.6, min_p=0.08, presence_penalty=0.2), dict(model=dict(vocab_size=256))),
    (dict(temperature=1.0, min_p=0.01, presence_penalty=0.0), dict(model=dict(vocab_size=512))),
    (
        dict(temperature=0.3, min_p=0.5, presence_penalty=1.5),
        dict(model=dict(vocab_size=2048), adaptive_noise=dict(mode=2)),
    ),
    (
        dict(temperature=1.7, min_p=0.0001, presence_penalty=0.7),
        dict(model=dict(vocab_size=256), noise=dict(perturb_distribution="three_sample")),
    ),
    (dict(temperature=0.05, min_p=1.0, presence_penalty=3.0), dict(model=dict(vocab_size=1024))),
]


def shuffled_weights(rng, params, overlays):
    """Weights and overlays moved off their initial values, for livelier logits."""
    params = {
        k: np.clip(v.astype(np.int64) + rng.integers(-40, 41, v.shape), -127, 127).astype(np.int8)
        for k, v in params.items()
    }
    overlays = {k: rng.integers(-127, 128, v.shape).astype(np.int8) for k, v in overlays.items()}
    return params, overlays


@pytest.mark.parametrize("case", range(len(GENERATION)))
def test_generation_matches_cpu(case):
    sampling, switches = GENERATION[case]
    rng = np.random.default_rng(2000 + case)
    cfg = small_config(rng, sampling=sampling, **switches)
    cpu, gpu = CpuBackend(cfg, threads=1), GpuBackend_(cfg)
    params, overlays = shuffled_weights(rng, cpu.params, cpu.overlays)
    cpu.params, cpu.overlays = params, overlays
    gpu.load_state(params, overlays)
    t, v = cfg.model.seq_len, cfg.model.vocab_size
    # prompts shorter and longer than a window (and none); generations past the RoPE table
    for n_prompt, n_tokens in [
        (8, None),
        (1, 2 * t + 5),
        (2 * t + 3, t),
        (0, 6),
        (int(rng.integers(1, 20)), 0),
        (int(rng.integers(1, 20)), int(rng.integers(1, 40))),
    ]:
        prompt = rng.integers(0, v, n_prompt)
        seed = int(rng.integers(2**32))
        ours, theirs = gpu.generate(prompt, seed, n_tokens), cpu.generate(prompt, seed, n_tokens)
        assert np.array_equal(ours, theirs), (n_prompt, n_tokens, ours, theirs)
        assert np.array_equal(ours[:n_prompt], prompt)
    assert np.array_equal(gpu.generate(prompt, 3), cpu.generate(prompt, 3))  # the default length
    # One shape called again and again: its first call launches eagerly, its second
    # captures its graph, the later ones replay it with other prompts and seeds; after an
    # update (the weights changed in place) the same graph; after new weights (load_state
    # makes new arrays) a new one, from the shape's second call on.
    shape = (8, 8 + cfg.sampling.generate_tokens)

    def generations(n):
        for _ in range(n):
            prompt, seed = rng.integers(0, v, 8), int(rng.integers(2**32))
            assert np.array_equal(gpu.generate(prompt, seed), cpu.generate(prompt, seed))
        return gpu.generation.shapes[shape].graph

    graph = generations(4)
    assert graph is not None
    fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
    assert gpu.update(fitness, 1, 77) == cpu.update(fitness, 1, 77)
    assert generations(2) is graph
    params, overlays = shuffled_weights(rng, params, overlays)
    cpu.params, cpu.overlays = params, overlays
    gpu.load_state(params, overlays)
    assert generations(1) is None
    assert generations(2) not in (None, graph)


def test_a_generation_beside_chunks_and_updates_samples_as_alone():
    """A worker starts its sample before the chunk it is due at: the generation runs on a
    stream of its own beside the chunks, from the weights the update before left, and
    the update after waits for it, also one queued right behind it (as in a graph's
    replay, from the third sample on). Every sample, loss and weight is the CPU's."""
    from deggs.numerics.es import Trainer

    rng = np.random.default_rng(12)
    cfg = small_config(rng).replace(training=dict(population_size=96, chunk_size=32))
    cpu, gpu = Trainer(CpuBackend(cfg, threads=1)), Trainer(GpuBackend_(cfg))
    data = rng.integers(0, cfg.model.vocab_size, 2000).astype(cfg.token_dtype)
    for step in range(5):
        prompt = cpu.prompt(data)
        expected = cpu.sample(prompt)
        sampling = gpu.start_sample(prompt)
        if step % 2 == 0:  # the chunks beside it, then the update
            ours, theirs = gpu.train_step(data), cpu.train_step(data)
            assert [r.packed for r in ours] == [r.packed for r in theirs]
        else:  # the update at once
            fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
            assert gpu.start_apply(fitness)() == cpu.apply(fitness)
        assert np.array_equal(sampling(), expected), step
    compare_states(cpu.backend, gpu.backend)


def cp_device_is_hopper() -> bool:
    import cupy as cp

    return cp.cuda.Device().compute_capability == "90"


def GpuBackend_(cfg, **kw):
    from deggs.numerics.gpu import GpuBackend

    return GpuBackend(cfg, **kw)


def test_update_graph_is_captured():
    cfg = small_config(np.random.default_rng(5))
    gpu = GpuBackend_(cfg)
    gpu.update(np.ones(cfg.training.n_pairs, np.int32), 0, 42)
    assert gpu.graph is not None, gpu.graph_error


@pytest.mark.parametrize("name", ["tiny_bytes", "tiny_tok", "tiny_variant"])
def test_conformance_on_gpu(name, golden_path, golden_decoding, conformance, capsys):
    path = golden_path(name)
    ok = conformance.run(path, golden_decoding(path), backend="gpu")
    out = capsys.readouterr().out
    assert ok, out
    assert out.count("step ") == 8 and "MISMATCH" not in out


# The size limits: each at a small population, with weights moved off their initial values.
BIG = {
    "hidden 1024": dict(model=dict(hidden_dim=1024, head_dim=64, seq_len=16, vocab_size=1024)),
    "hidden 2048": dict(model=dict(hidden_dim=2048, head_dim=128, seq_len=8, vocab_size=512)),
    "vocab 65536": dict(model=dict(hidden_dim=64, head_dim=32, seq_len=8, vocab_size=65536)),
    "vocab 32768, mode 2": dict(
        model=dict(hidden_dim=64, head_dim=32, seq_len=8, vocab_size=32768),
        adaptive_noise=dict(mode=2),
    ),
    "seq 256": dict(model=dict(hidden_dim=64, head_dim=64, seq_len=256, vocab_size=256)),
}


@pytest.mark.parametrize("name", list(BIG))
def test_gpu_matches_cpu_at_the_size_limits(name):
    rng = np.random.default_rng(3000 + list(BIG).index(name))
    base = dict(n_layers=1)
    tables = {k: dict(v) for k, v in BIG[name].items()}
    tables["model"] = {**base, **tables["model"]}
    cfg = Config().replace(
        training=dict(population_size=8, chunk_size=8),
        sampling=dict(prompt_tokens=4, generate_tokens=6),
        **tables,
    )
    cpu, gpu = CpuBackend(cfg), GpuBackend_(cfg)
    params, overlays = shuffled_weights(rng, cpu.params, cpu.overlays)
    cpu.load_state(params, overlays)
    gpu.load_state(params, overlays)
    data = rng.integers(0, cfg.model.vocab_size, 4 * cfg.model.seq_len + 64).astype(cfg.token_dtype)
    members = np.arange(cfg.training.population_size)
    expected = cpu.losses(data, 0, 99, members)
    assert np.array_equal(gpu.losses(data, 0, 99, members), expected)
    picked = [5, 2, 7]  # apart from their partners: head_loss_sm90 scores them beside them
    assert np.array_equal(gpu.losses(data, 0, 99, picked), expected[picked])
    fitness = rng.integers(-1, 2, cfg.training.n_pairs).astype(np.int32)
    assert gpu.update(fitness, 0, 99) == cpu.update(fitness, 0, 99)
    compare_states(cpu, gpu)
    prompt = data[:4]
    assert np.array_equal(gpu.generate(prompt, 5), cpu.generate(prompt, 5))


def test_a_hopper_kernel_runs_only_where_its_barriers_fit_too():
    """head_loss_sm90 at the largest vocabulary whose dynamic shared memory fits the
    device (in wide blocks of 128 rows past 15,552 on an H100 or H200): beside it the
    kernel declares its copies' barriers (static shared memory). Where both do not fit,
    the backend runs the portable head (the launch would fail); either way the losses
    are the CPU's."""

    from deggs.numerics.gpu.cuda import device_figures
    from deggs.numerics.gpu.plan import head_loss_sm90_shared, kernel_defines

    device = device_figures()
    optin = device.shared_optin

    def config(vocab):
        return Config().replace(
            model=dict(n_layers=1, vocab_size=vocab),
            training=dict(population_size=4, chunk_size=4),
        )

    def dynamic(vocab):
        cfg = config(vocab)
        return head_loss_sm90_shared(cfg, kernel_defines(cfg, device))

    vocab = 8192
    while dynamic(vocab + 64) <= optin:
        vocab += 64
    cfg = config(vocab)
    gpu = GpuBackend_(cfg)
    if cp_device_is_hopper():
        static = gpu.launch.kernels["head_loss_sm90"].function.shared_size_bytes
        assert static > 0
        fits = dynamic(vocab) + static <= optin
        assert (gpu.plan.head == "head_loss_sm90") == fits, (vocab, dynamic(vocab), static)
    rng = np.random.default_rng(5)
    data = rng.integers(0, vocab, 400).astype(cfg.token_dtype)
    members = np.arange(4)
    cpu = CpuBackend(cfg)
    assert np.array_equal(gpu.losses(data, 0, 7, members), cpu.losses(data, 0, 7, members))


SMALL_MODEL = dict(hidden_dim=64, head_dim=32, n_layers=1, seq_len=16, vocab_size=512)


DEFAULT_MODEL = Config().to_dict()["model"]


# need hidden_dim 128 or 256, modes 0, 1
RESIDUAL = [
    "down_residual_sm90",
    "down_residual_sm90_unit",
    "o_residual_sm90",
    "o_residual_sm90_unit",
]


@pytest.mark.parametrize(
    "switches, not_used",
    [
        ({}, RESIDUAL),
        (
            dict(adaptive_noise=dict(mode=2), noise=dict(perturb_distribution="three_sample")),
            RESIDUAL,
        ),
        # attention_mma over 5 query tiles (one warp takes two) and three 32-key chunks,
        # the last padded; 80 x 2^18 x 127 >= 2^31, so its sums are 64-bit; residual_sm90's
        # tiles of 128 rows across members, the last tile partial
        (dict(model=dict(SMALL_MODEL, hidden_dim=128, head_dim=64, seq_len=80)), []),
        # the default shapes: head_loss_sm90's output noise, a pair's 8,192 words, fits
        # an H100's shared memory in mode 2 too; the fused residuals, whose tables hold
        # one-word dot entries, are not launched
        (dict(model=DEFAULT_MODEL, adaptive_noise=dict(mode=2)), RESIDUAL),
        # the head's sweep over an odd number of vocabulary tiles (three, the last
        # padded) and over one: its two buffers' copies and barriers' phases
        (dict(model=dict(SMALL_MODEL, vocab_size=150)), RESIDUAL),
        (dict(model=dict(SMALL_MODEL, vocab_size=50)), RESIDUAL),
    ],
    ids=[
        "default",
        "mode 2",
        "seq 80, 64-bit attention sums",
        "mode 2 at the default shapes",
        "three vocabulary tiles",
        "one vocabulary tile",
    ],
)
def test_every_kernel_matches_its_cpu_reference(switches, not_used):
    """scripts/kernels.py: each kernel alone, bit-exact with the CPU specification."""
    import kernels as harness

    cfg = Config().replace(
        **{"model": SMALL_MODEL, "training": dict(population_size=8, chunk_size=8), **switches}
    )
    lines = []
    ok = harness.run(cfg, sorted(harness.CHECKS), members=6, repeats=1, out=lines.append)
    assert ok and len(lines) == len(harness.CHECKS), "\n".join(lines)
    built = not any("not built" in line for line in lines)
    assert built == cp_device_is_hopper(), "\n".join(lines)  # the *_sm90 on Hopper
    skipped = [line.split()[0] for line in lines if "not used" in line]
    assert skipped == (not_used if built else []), "\n".join(lines)


@pytest.mark.parametrize("mask", [0, 1, 20, 31])
def test_the_update_noise_at_every_mask(mask):
    """noise_matrix and vector_votes make uniform noise four int8 lanes a word (update.cu's
    noise_word): at masks of one bit, of no bits, of some and of all five, every pair's
    entries times fitness -1, 0 and 1 are the CPU's (120 pairs, so words of four pairs
    with every fitness mixed)."""
    import kernels as harness

    cfg = Config().replace(
        model=SMALL_MODEL,
        training=dict(population_size=240, chunk_size=240),
        noise=dict(perturb_mask=mask),
    )
    lines = []
    ok = harness.run(cfg, ["noise_matrix", "vector_votes"], members=6, repeats=1, out=lines.append)
    assert ok and len(lines) == 2, "\n".join(lines)


@pytest.mark.parametrize("vocab, mode", [(8192, 1), (8192, 2), (8190, 1)])
def test_sequence_loss_over_a_wide_vocabulary(vocab, mode):
    """sequence_loss where a thread's logits do not stay in registers (the unfused head at
    hidden 1024): four a load where the vocabulary is a multiple of 4 (the output noise
    16 bits an entry in mode 1, 32 in mode 2), one a load elsewhere; each row read once
    where its peak lies close above its input and target tokens' logits (a histogram of
    the row), twice where not (random full-range products), both in one launch, and at
    the histogram's edges."""
    import kernels as harness

    cfg = Config().replace(
        model=dict(SMALL_MODEL, vocab_size=vocab),
        training=dict(population_size=8, chunk_size=8),
        adaptive_noise=dict(mode=mode),
    )
    lines = []
    names = ["sequence_loss", "sequence_loss_near", "sequence_loss_peaked", "sequence_loss_edges"]
    ok = harness.run(cfg, names, members=6, repeats=1, out=lines.append)
    assert ok and len(lines) == 4, "\n".join(lines)
    twice = [float(re.search(r"rows read twice ([\d.]+)%", line)[1]) for line in lines]
    assert twice[0] > 50 and twice[1] == 0 and 0 < twice[2] < 100, "\n".join(lines)
    seq = cfg.model.seq_len  # the edges: the rows t % 3 == 1 read twice
    assert abs(twice[3] - 100 * len(range(1, seq, 3)) / seq) < 0.01, "\n".join(lines)


def test_the_one_pass_head_sums_open_rows_both_ways():
    """head_loss_sm90 at the default shapes (deggs/numerics/gpu/one_pass.py): the rows its
    one sweep leaves open are summed again on the CUDA cores where a block has a few, by
    a second sweep where it has more than OPEN_ROWS (1 here), bit-exact with the CPU's
    two passes either way."""
    import kernels as harness

    if not cp_device_is_hopper():
        pytest.skip("head_loss_sm90 is built for H100s and H200s only")
    cfg = Config().replace(model=dict(DEFAULT_MODEL, n_layers=1))
    shares = {}
    for open_rows in (None, 1):
        lines = []
        defines = {"OPEN_ROWS": open_rows} if open_rows else None
        ok = harness.run(cfg, ["head_loss_sm90_near"], 64, 1, out=lines.append, defines=defines)
        assert ok, lines
        found = re.search(r"swept twice ([\d.]+)%, rows summed again ([\d.]+)%", lines[0])
        shares[open_rows] = float(found.group(1)), float(found.group(2))
    assert shares[None][1] > 0, shares  # a few open rows a block, summed on the CUDA cores
    assert shares[1][0] > 0, shares  # blocks with two or more open rows swept again


@pytest.mark.parametrize(
    "model, mode",
    [
        (dict(hidden_dim=1024, seq_len=64, vocab_size=2048), 1),
        # blocks mid-member, a padded tile, 32-bit noise
        (dict(hidden_dim=1024, seq_len=24, vocab_size=2000), 2),
        (dict(hidden_dim=512, seq_len=64, vocab_size=8192), 0),  # the default vocabulary
    ],
)
def test_the_wide_head_holds_its_rows_in_registers(model, mode):
    """head_loss_sm90 past hidden 256: blocks of 128 rows in registers, the tiles where
    the rows were staged, the output noise in av_t; bit-exact with the CPU on random
    rows and on rows near their peak, whose open rows the block sweeps again (with
    every value counted towards a move's error, HEAD_LIVE=0, near rows are left open
    for certain)."""
    import kernels as harness

    if not cp_device_is_hopper():
        pytest.skip("head_loss_sm90 is built for H100s and H200s only")
    cfg = Config().replace(
        model=dict(head_dim=64, n_layers=1, **model), adaptive_noise=dict(mode=mode)
    )
    names = ["head_loss_sm90", "head_loss_sm90_near"]
    for defines in (None, {"HEAD_LIVE": 0}):
        lines = []
        ok = harness.run(cfg, names, 16, 1, out=lines.append, defines=defines)
        assert ok and all(" ok " in line for line in lines), lines
    swept = float(re.search(r"swept twice ([\d.]+)%", lines[1])[1])
    assert swept > 0, lines


@pytest.mark.parametrize("mode", [0, 1])
def test_up_gelu_packs_its_entries_at_hidden_1024(mode):
    """up_gelu_sm90 at hidden 1024 (seq_len 64: a block's rows one member's): a feature's
    output noise and perturbed bias in one word (UP_PACK), one block an SM; bit-exact
    with the CPU, with mlp_up beside it."""
    import kernels as harness

    if not cp_device_is_hopper():
        pytest.skip("up_gelu_sm90 is built for H100s and H200s only")
    big = dict(hidden_dim=1024, head_dim=64, n_layers=1, seq_len=64, vocab_size=512)
    cfg = Config().replace(model=big, adaptive_noise=dict(mode=mode))
    lines = []
    ok = harness.run(cfg, ["up_gelu_sm90", "up_gelu_sm90_unit", "mlp_up"], 6, 1, out=lines.append)
    assert ok and all(" ok " in line for line in lines), lines


def test_the_one_pass_head_takes_a_peak_rising_past_int32():
    """At shift_logit 0 (no fold) a row's logits may lie 2^31 or more apart. The rows
    here have every logit of the first tile negative (no output noise there, y against
    the embedding) and a later one near 2^31: the sweep's rise must not wrap (as an int
    it indexed before exp_bounds: an illegal address)."""
    import kernels as harness
    from deggs.numerics.model import int_matmul, wrap32
    from deggs.numerics.params import PARAM, offsets

    if not cp_device_is_hopper():
        pytest.skip("head_loss_sm90 is built for H100s and H200s only")
    shifts = dict(shift_logit=0, fixed_point=0, sigma_shift=0)
    cfg = Config().replace(model=dict(DEFAULT_MODEL, n_layers=1), quantization=shifts)
    b = harness.Bench(cfg, 2)
    weights, v, tile = b.weights, cfg.model.vocab_size, 64
    overlay = weights.overlays[PARAM["embedding"].overlays[1]]
    overlay[:tile] = -1  # the first tile's output noise 0
    b.gpu.load_state(weights.params, weights.overlays)
    emb = weights.arrays("embedding")[0].astype(np.int64)
    off, cols = offsets(cfg, "embedding", None)[0], np.arange(v)
    noise = b.pert.scaled(b.pert.noise(off, cols), b.pert.factor(overlay, off, cols))
    y = np.linalg.lstsq(emb[:, :tile].T.astype(float), -np.ones(tile), rcond=None)[0]
    y = np.round(y * 127 / np.abs(y).max()).astype(np.int8)
    g = y.astype(np.int64) @ emb
    assert g[:tile].max() < 0
    rng, sb = np.random.default_rng(1), np.zeros((b.m, b.t), np.int64)
    for k in range(b.m):  # a member's input dot whose rank-1 terms make the rise
        for _ in range(100):
            c = rng.integers(-(2**31), 2**31, 4096)
            keys = wrap32(g + wrap32(c[:, None] * noise[k].astype(np.int64)))
            peaks = np.maximum.accumulate(keys.reshape(len(c), -1, tile).max(-1), 1)
            found = np.flatnonzero((peaks[:, 1:] - peaks[:, :-1]).max(1) >= 2**31)
            if len(found):
                break
        assert len(found), "no input dot found"
        sb[k] = wrap32(c[found[0]] * int(b.pert.signs[k]))
    ys = np.broadcast_to(y, (b.m, b.t, len(y))).copy()
    tokens = b.ints(0, v, (b.m, b.t + 1))
    loss = b.cp.empty(b.m, b.cp.int32)
    b.put("y", ys)
    b.put("sb", sb.astype(np.int32))
    b.forward.head_loss(b.batch, b.cp.asarray(tokens.ravel()), loss, "head_loss_sm90")
    expected = harness.head_loss_reference(b, int_matmul(ys, emb), sb.astype(np.int32), tokens)
    assert np.array_equal(loss.get(), expected)


@pytest.mark.parametrize(
    "model, members, mode",
    [
        # the default shapes in mode 1: 12 tiles of 128 rows in 2 blocks, the down
        # projection's K in 8 slices a tile, the o-projection's in 2
        (DEFAULT_MODEL, 24, 1),
        # hidden 128: the o-projection's K one slice, so its stages' barriers change phase
        # only across tiles; seq 24, so a warp's rows can be two members' (8 tiles, one
        # block, the last tile partial)
        (dict(SMALL_MODEL, hidden_dim=128, seq_len=24), 40, 1),
        # seq 200: a member's rows span tiles (tiles starting mid-member); adaptive mode 0
        (dict(SMALL_MODEL, hidden_dim=128, seq_len=200), 7, 0),
    ],
    ids=["default shapes", "hidden 128, seq 24", "hidden 128, seq 200, mode 0"],
)
def test_the_residual_kernels_take_many_tiles_a_block(model, members, mode):
    """residual_sm90.cu's blocks each take several tiles in turn, as at training sizes:
    the next tile's slices and inputs copied during this one's, every stage refilled."""
    import kernels as harness

    cfg = Config().replace(
        model=model,
        training=dict(population_size=8, chunk_size=8),
        adaptive_noise=dict(mode=mode),
    )
    lines = []
    names = [*RESIDUAL, "residual_norm"]
    ok = harness.run(cfg, names, members=members, repeats=1, out=lines.append)
    hopper = cp_device_is_hopper()  # elsewhere the sm90 kernels are not built
    expected = [" ok " if hopper or "_sm90" not in n else "not built" for n in names]
    assert ok and all(e in line for e, line in zip(expected, lines, strict=True)), lines


@pytest.mark.parametrize(
    "model, members",
    [
        # the default shapes: two staging buffers, four blocks of four warps an SM (528
        # on an H100 or H200), 1,600 items, so three or four a block
        (DEFAULT_MODEL, 400),
        # seq 80: five query tiles (warp 0 takes two), three key chunks, 64-bit sums
        (dict(SMALL_MODEL, hidden_dim=128, head_dim=64, seq_len=80), 700),
        # head_dim 128: one buffer (two would leave fewer blocks an SM), the queries
        # read from global memory
        (dict(SMALL_MODEL, hidden_dim=256, head_dim=128, seq_len=64), 700),
        # seq 16: one warp a block, sixteen blocks an SM
        (SMALL_MODEL, 2500),
    ],
    ids=["default shapes", "seq 80", "head_dim 128, one buffer", "one warp a block"],
)
def test_attention_blocks_take_many_items(model, members):
    """attention_mma's resident blocks each take several (member, head) items in turn,
    as at training sizes: the next item staged and prepared while one is scored, both
    buffers used in turn."""
    import kernels as harness

    cfg = Config().replace(model=model, training=dict(population_size=8, chunk_size=8))
    lines = []
    names = ["attention_mma", "attention_mma_unit"]  # the unit twin where overlays are >= 64
    ok = harness.run(cfg, names, members=members, repeats=1, out=lines.append)
    assert ok and len(lines) == 2 and all(" ok " in line for line in lines), lines


def test_a_chunk_is_one_sub_batch_where_every_projection_is_fused():
    """At the default shapes on an H100 or H200 every projection is fused: a sub-batch's
    product buffer holds nothing, and a default chunk is one sub-batch, an
    even number of members whose row buffers fit the budget. With cuBLAS's q, k, v chosen
    at construction (qkv=False), the product buffer is sized for cuBLAS's products, and
    the losses stay the CPU's both ways."""
    cfg = Config().replace(model=DEFAULT_MODEL, training=dict(population_size=6, chunk_size=6))
    gpu, cpu = GpuBackend_(cfg), CpuBackend(cfg, threads=1)
    m, plan = cfg.model, gpu.plan
    fused = plan.fused_up and plan.fused_qkv and plan.o_residual and plan.down_residual
    assert fused == cp_device_is_hopper()
    words = gpu.forward.product_words(1, whole=True)
    assert words == (0 if fused else 4 * m.hidden_dim)
    assert gpu.batch % 2 == 0
    if fused:
        assert gpu.batch >= Config().training.chunk_size
    rng = np.random.default_rng(5)
    data = rng.integers(0, m.vocab_size, 3000).astype(cfg.token_dtype)
    members, seed = np.arange(6), cfg.training.seed
    expected = cpu.losses(data, 0, seed, members)
    assert np.array_equal(gpu.losses(data, 0, seed, members), expected)
    rows = 6 * m.seq_len
    # the buffers as made (kept: asked again, the same), a row's share of them times a
    # sub-batch's rows
    made = gpu.forward.rows_for(6, logits=not plan.fused)
    assert gpu.forward.rows_for(6, logits=not plan.fused) is made
    assert gpu.batch * m.seq_len * made.nbytes <= gpu.forward.budget * rows
    assert made.g.size == rows * (words if plan.fused else max(words, m.vocab_size))
    cublas_qkv = GpuBackend_(cfg, qkv=False)
    assert not cublas_qkv.plan.fused_qkv
    assert np.array_equal(cublas_qkv.losses(data, 0, seed, members), expected)
    assert cublas_qkv.forward.rows_for(6, logits=False).g.size >= rows * 3 * m.hidden_dim


def test_a_variant_launches_as_compiled_and_timing_skips_the_check():
    """scripts/kernels.py -D NT=128: the row kernels launch with the thread count they
    were compiled with and still match the CPU; --no-check times without the CPU."""
    import kernels as harness

    cfg = Config().replace(model=SMALL_MODEL, training=dict(population_size=8, chunk_size=8))
    names = ["embed_norm", "mlp_up", "residual_norm", "sequence_loss"]
    lines = []
    ok = harness.run(cfg, names, members=6, repeats=1, out=lines.append, defines={"NT": 128})
    assert ok and all(line.split()[1] == "ok" for line in lines), "\n".join(lines)
    lines = []
    assert harness.run(cfg, ["embed_norm"], members=6, repeats=1, out=lines.append, check=False)
    assert lines[0].split()[1] == "unchecked", lines


def test_validation_logits_match_cpu():
    """Backend.logits (the validation loss's forward) on the GPU: the training forward with
    every member's sign 0, equal to the CPU's unperturbed logits."""
    from deggs.numerics.es import evaluate, validation_windows

    rng = np.random.default_rng(77)
    cfg = small_config(rng)
    cpu, gpu = CpuBackend(cfg, threads=1), GpuBackend_(cfg, batch=3)
    params, overlays = shuffled_weights(rng, cpu.params, cpu.overlays)
    cpu.load_state(params, overlays)
    gpu.load_state(params, overlays)
    val = rng.integers(0, cfg.model.vocab_size, 500)
    windows = validation_windows(cfg, val, 7)
    assert np.array_equal(gpu.logits(windows[:, :-1]), cpu.logits(windows[:, :-1]))
    assert evaluate(gpu, windows) == evaluate(cpu, windows)
