"""Generation on the device (sampling.py's generate, bit for bit): the forward's row
kernels run the one sequence as a single member of sign 0 (no perturbation), the
prompt's positions together and then each new position alone, with a key/value cache per
layer; cached_attention attends over the cache and choose_token samples the next token
into the token buffer on the device, so nothing returns to the host until the end.

Its row buffers and its RoPE table are its own: a generation longer than any before
makes a longer table here, and the training forward's are never touched.
"""

from __future__ import annotations

import numpy as np

from ...config import Config
from ..model import make_tables
from ..sampling import sampler_limits
from .cuda import Launcher, cp
from .forward import Batch, Cache, Forward, Rows
from .plan import STATIC_SHARED, Plan


class Generate:
    def __init__(self, cfg: Config, plan: Plan, launch: Launcher, forward: Forward, stream):
        self.cfg, self.plan, self.launch, self.forward = cfg, plan, launch, forward
        self.stream = stream
        self.rows: Rows | None = None  # made for the longest prompt so far
        self.seed = None  # one member's seed and sign (0: the unperturbed model)
        self.sign = None
        self.rope = forward.rope  # RoPE table of `self.positions` positions
        self.positions = forward.rope_positions

    def _rope_for(self, total: int):
        """A RoPE table covering `total` positions (its own, longer, where needed)."""
        if total > self.positions:
            tables = make_tables(self.cfg, total)
            self.rope = cp.asarray(tables.rope.astype(np.int32).ravel())
            self.positions = total
        return self.rope

    def __call__(self, prompt, seed: int, n_tokens: int | None = None) -> np.ndarray:
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
        if total >= 1 << 16:
            raise ValueError(f"{total} positions: the gpu's choose_token counts in 16 bits")
        rope = self._rope_for(total)
        attention = self.launch.kernels["cached_attention"].function
        if 4 * total + attention.shared_size_bytes > STATIC_SHARED:  # a word a visible key
            attention.max_dynamic_shared_size_bytes = 4 * total
        penalty, min_p_limit = sampler_limits(cfg)
        seed &= 0xFFFFFFFF
        d = m.hidden_dim
        with self.stream:
            if self.rows is None or self.rows.n < first:
                words = max(self.forward.product_words(first, whole=False), m.vocab_size)
                self.rows = self.forward.make_rows(first, words)
                self.seed = cp.zeros(1, cp.uint32)
                self.sign = cp.zeros(1, cp.int32)  # sign 0: the unperturbed model
            rows = self.rows
            tokens = cp.asarray(buffer.astype(np.int32))
            layers = [
                (cp.zeros(total * d, cp.int8), cp.zeros(total * d, cp.int8))
                for _ in range(m.n_layers)
            ]
            start = 0
            for t in range(first - 1, total - 1):
                seq = t + 1 - start
                batch = Batch(rows, self.seed, self.sign, members=1, positions=seq)
                self.forward.hidden(batch, tokens[start:], Cache(layers, start, rope))
                table = self.forward.state.weights["embedding"]
                self.launch.project(table, rows.y[(seq - 1) * d :], rows.g, m.vocab_size, 1, d)
                self.launch(
                    "choose_token",
                    (1,),
                    (self.plan.defines["CT_THREADS"],),
                    g=rows.g,
                    tokens=tokens,
                    t=t,
                    seed=seed,
                    penalty=penalty,
                    temperature=s.temperature,
                    min_p_limit=min_p_limit,
                    exp_tab=self.forward.exp,
                )
                start = t + 1
            out = tokens.get(stream=self.stream)
        self.stream.synchronize()
        return out.astype(np.int64)
