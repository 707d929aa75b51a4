"""GpuBackend: deggs.numerics.backend.Backend on CUDA through CuPy, bit for bit the CPU
backend's. It puts together the plan (plan.py), the compiled kernels (compile.py), the
device state (state.py) and the three paths: forward.py, update.py, generate.py."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ...config import Config
from ...seeds import member_sign, pair_seed
from ..model import init_overlays, init_params, make_tables, member_tokens, window_starts
from ..state import OptimizerState
from .compile import compile_main, compile_sm90a, static_shared
from .cuda import Launcher, cp, device_figures, why_no_gpu
from .forward import FORWARD_BUDGET, Batch, Forward, seeds_in_pairs
from .generate import Generate
from .plan import Plan, kernel_defines, make_plan, supports
from .state import DeviceState
from .update import Update

log = logging.getLogger(__name__)


class DeviceTokens:
    """The token stream on the device, copied once per stream, so that members' windows
    are gathered there (gathering them on the host and copying them over took longer
    than a tenth of the forward, with the GPU idle). A read-only stream (load_tokens's)
    is known by the memory it views, which it holds (that memory cannot be freed and
    reused meanwhile); a writable one by its content, compared with a copy of its own.
    A stream too big for a quarter of the free device memory stays on the host."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.held: np.ndarray | None = None
        self.device = None

    @staticmethod
    def _key(data: np.ndarray) -> tuple | None:
        if data.flags.writeable:
            return None
        return (data.__array_interface__["data"][0], data.nbytes, data.dtype.str, data.strides)

    def _same(self, data: np.ndarray) -> bool:
        if self.held is None:
            return False
        key = self._key(data)
        if key is not None:
            return key == self.key
        same = self.held.dtype == data.dtype and np.array_equal(self.held, data)
        return self.key is None and same

    def get(self, data: np.ndarray):
        """The stream's device copy, or None where it stays on the host."""
        if not self._same(data):
            self.held = self.device = None  # the old copy freed before a new one is made
            self.key = self._key(data)
            self.held = data if self.key is not None else np.array(data)
            fits = data.nbytes <= cp.cuda.runtime.memGetInfo()[0] // 4
            self.device = cp.asarray(data) if fits else None
        return self.device


class GpuBackend:
    """The GPU backend. Choices are made here, once: `batch` (members a forward
    sub-batch; default: as many as fit the budget), `fused` (False: the head as cuBLAS
    logits and sequence_loss), `hopper` (False: no sm90a kernel), `head` ("head_loss" or
    "head_loss_sm90"), `qkv` (False: q, k, v on cuBLAS; True: qkv_rope_sm90 or a
    ValueError), `defines` (-D values replacing the plan's: a kernel variant), `device`
    (the CUDA device's number), `use_graph` (False: the update and generations run
    eagerly)."""

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
        head: str | None = None,
        qkv: bool | None = None,
    ):
        reason = why_no_gpu()
        if reason:
            raise RuntimeError(f"the gpu backend needs CuPy and a CUDA device: {reason}")
        if device is not None:
            cp.cuda.Device(device).use()
        self.cfg = cfg
        figures = device_figures()
        problems = supports(cfg, figures.shared_optin)
        if problems:  # checked before anything is compiled or launched
            raise ValueError("the gpu backend cannot run this config here: " + "; ".join(problems))
        if hopper and not figures.hopper:
            raise ValueError("the Hopper kernels need an sm_90 device (an H100 or H200)")
        self.tables = make_tables(cfg)
        self.stream = cp.cuda.Stream(non_blocking=True)
        compiled_defines = {**kernel_defines(cfg, figures), **(defines or {})}
        kernels = compile_main(compiled_defines)
        if figures.hopper and hopper is not False:
            kernels.update(compile_sm90a(compiled_defines))
        self.plan: Plan = make_plan(
            cfg, figures, compiled_defines, static_shared(kernels), fused, hopper, head, qkv
        )
        for name, size in self.plan.opt_in.items():
            kernels[name].function.max_dynamic_shared_size_bytes = size
        self.launch = Launcher(kernels, self.plan.shared)
        self.device_state = DeviceState(cfg, self.plan, self.launch, self.stream)
        # members a sub-batch: its row buffers within the budget (Forward.batch)
        budget = min(FORWARD_BUDGET, cp.cuda.runtime.memGetInfo()[0] // 4)
        self.forward = Forward(
            cfg, self.plan, self.launch, self.device_state, self.tables, batch, budget, figures.sms
        )
        self.updates = Update(cfg, self.launch, self.device_state, self.stream, use_graph)
        self.generation = Generate(cfg, self.plan, self.launch, self.forward, use_graph)
        self.tokens = DeviceTokens()
        self.load_state(init_params(cfg), init_overlays(cfg), OptimizerState.zeros(cfg))

    # --- state ------------------------------------------------------------------------

    def load_state(self, params: dict, overlays: dict, state: OptimizerState | None = None):
        """Put weights, overlays and (optionally) optimizer state on the device."""
        # an update still queued (start_update) writes the arrays `load` frees: the
        # pool would hand their memory to the new ones on another stream
        self.stream.synchronize()
        self.generation.stream.synchronize()  # (a generation reads them too)
        # the graphs point at the arrays `load` replaces: dropped first, whatever happens
        self.updates.forget_graph()
        self.generation.forget_graphs()
        self.device_state.load(params, overlays, state)

    @property
    def params(self) -> dict:
        return self.device_state.params

    @property
    def overlays(self) -> dict:
        return self.device_state.host_overlays

    @property
    def state(self) -> OptimizerState:
        return self.device_state.optimizer_state

    # --- what was chosen ----------------------------------------------------------------

    @property
    def batch(self) -> int:
        """Members a forward sub-batch of training."""
        return self.forward.batch

    @property
    def graph(self):
        """The update's CUDA graph (None: not captured yet, or running eagerly)."""
        return self.updates.graph

    @property
    def graph_error(self) -> str | None:
        """Why the update could not be captured as a graph (None: it could)."""
        return self.updates.graph_error

    def start_profile(self) -> None:
        """Time every kernel launch from now on (profile_report ends it)."""
        self.launch.start_profile()

    def profile_report(self) -> dict[str, float]:
        """Milliseconds per kernel name since start_profile."""
        return self.launch.profile_report(self.stream)

    # --- the contract -----------------------------------------------------------------

    def losses(self, data: np.ndarray, step: int, step_seed: int, members, progress=None):
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
        if self.plan.head == "head_loss_sm90" and not seeds_in_pairs(seeds):
            # head_loss_sm90 keeps its output noise a pair: members picked apart from
            # their antithetic partners (validation, tests) are scored beside them
            partnered = self.start_losses(
                data, step, step_seed, np.stack([members, members ^ 1], 1).ravel()
            )
            return lambda: partnered()[0::2]
        signs = member_sign(members).astype(np.int32)
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.int32, n)
        done = cp.cuda.Event(disable_timing=True)
        with self.stream:
            d_tok = self.member_tokens(data, step, members).ravel()
            d_seeds, d_signs = cp.asarray(seeds), cp.asarray(signs)
            loss = cp.empty(n, cp.int32)
            nb = min(self.forward.batch, n)
            nb += nb % 2  # sub-batches of whole pairs, a given odd batch too
            rows = self.forward.rows_for(nb, logits=not self.plan.fused)
            for s in range(0, n, nb):
                e = min(n, s + nb)
                batch = Batch(rows, d_seeds[s:e], d_signs[s:e], members=e - s, positions=t)
                self.forward.losses(batch, d_tok[s * (t + 1) :], loss[s:e])
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

    def member_tokens(self, data: np.ndarray, step: int, members: np.ndarray):
        """The members' windows (int32, [members, seq_len + 1]) on the device, gathered
        there from the stream's device copy (DeviceTokens), else on the host."""
        on_device = self.tokens.get(data)
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
            nb = min(self.forward.logit_batch, w)
            rows = self.forward.rows_for(nb, logits=True)
            for s in range(0, w, nb):
                n = min(w, s + nb) - s
                batch = Batch(rows, seeds[s : s + n], signs[s : s + n], members=n, positions=t)
                self.forward.logits(batch, d_tok[s * (t + 1) :])
                g = rows.g[: n * t * m.vocab_size].get(stream=self.stream)
                out[s : s + n] = (
                    g.reshape(n, t, -1).astype(np.int64) >> self.cfg.quantization.shift_logit
                )
        self.stream.synchronize()
        return out

    def update(self, fitness, step: int, step_seed: int) -> int:
        return self.start_update(fitness, step, step_seed)()

    def start_update(self, fitness, step: int, step_seed: int) -> Callable[[], int]:
        """The update queued on the stream, ahead of whatever is queued next (Update.start),
        behind the generation last started (which reads the weights it writes)."""
        if self.generation.done is not None:
            self.stream.wait_event(self.generation.done)
        return self.updates.start(fitness, step, step_seed)

    def generate(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
        """Prompt followed by n_tokens sampled tokens, as deggs.numerics.sampling.generate."""
        return self.start_generate(prompt, seed, n_tokens)()

    def start_generate(self, prompt, seed: int, n_tokens: int | None = None):
        """`generate` started beside whatever is queued next on the stream (generate.py),
        from the weights as the work queued so far leaves them."""
        return self.generation.start(prompt, seed, n_tokens, after=self.stream)
