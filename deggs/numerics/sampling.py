"""Text generation with the reference's integer sampler.

After a prompt, each new token is drawn from the unperturbed model's logits with
- a presence penalty: penalty * 2^shift_logit off a token's logit per earlier occurrence,
- temperature: (logit - max) / temperature, truncated to an integer,
- min-p: tokens whose scaled logit is below log(min_p) * exp_scale are dropped,
- a hash-driven choice: r = hash_rng(seed + SAMPLE_STRIDE t, 0) mod (sum of table weights) picks
  the token where the running sum of weights first exceeds r.

The running sum follows the reference's thread order: thread j of a block of
hidden_dim threads owns tokens j, j + hidden_dim, ..., and threads are scanned in order.
"""

from __future__ import annotations

import numpy as np

from ..config import Config
from ..seeds import hash_rng
from .model import KVCache, Tables, Weights, forward, logits

SAMPLE_STRIDE = 555  # token t is drawn with the hash of seed + 555 t, as the reference


def prompt_window(cfg: Config, data: np.ndarray, step: int) -> np.ndarray:
    """The prompt a worker uses at a step: prompt_tokens of data from step * seq_len.

    The reference reads past the end of the data when the window starts near it; we
    move such a window back so that it ends at the last token.
    """
    n, t, size = len(data), cfg.model.seq_len, cfg.sampling.prompt_tokens
    start = min((step * t) % (n - t), n - size)
    return data[start : start + size].astype(np.int64)


def scan_order(cfg: Config) -> np.ndarray:
    """Token ids in the order the reference's block scan visits them."""
    v = np.arange(cfg.model.vocab_size)
    threads = cfg.model.hidden_dim
    return v[np.lexsort((v // threads, v % threads))]


def sampler_limits(cfg: Config) -> tuple[int, int]:
    """(presence penalty per occurrence, min-p cut-off) in the integer logits' units."""
    s, f = cfg.sampling, np.float32
    penalty = int(f(s.presence_penalty) * f(1 << cfg.quantization.shift_logit))
    min_p_limit = int(float(np.log(f(s.min_p))) * float(cfg.softmax.exp_scale))
    return penalty, min_p_limit


def choose_token(
    cfg: Config,
    tables: Tables,
    lgt: np.ndarray,
    history: np.ndarray,
    seed: int,
    t: int,
    order: np.ndarray,
) -> int:
    """Sample one token from integer logits, given the tokens so far."""
    s = cfg.sampling
    penalty, min_p_limit = sampler_limits(cfg)
    counts = np.bincount(history, minlength=cfg.model.vocab_size)[: cfg.model.vocab_size]
    lgt = lgt - penalty * counts
    shifted = lgt - lgt.max()
    scaled = np.trunc(shifted.astype(np.float32) / np.float32(s.temperature)).astype(np.int64)
    index = np.clip(-scaled, 0, cfg.softmax.lut_size - 1)
    weights = np.where(scaled >= min_p_limit, tables.exp[index], 0)
    total = int(weights.sum())
    if total <= 0:
        return 0
    threshold = hash_rng((seed + t * SAMPLE_STRIDE) & 0xFFFFFFFF, 0) % total
    running = np.cumsum(weights[order])
    return int(order[np.searchsorted(running, threshold, side="right")])


def generate(
    cfg: Config,
    tables: Tables,
    params,
    overlays,
    prompt: np.ndarray,
    seed: int,
    n_tokens: int | None = None,
) -> np.ndarray:
    """Prompt followed by n_tokens sampled tokens (default: sampling.generate_tokens)."""
    n_tokens = cfg.sampling.generate_tokens if n_tokens is None else n_tokens
    prompt = np.asarray(prompt, np.int64)
    total = len(prompt) + n_tokens
    if tables.rope.shape[0] < total - 1:
        raise ValueError(f"RoPE table covers {tables.rope.shape[0]} positions, need {total - 1}")
    buffer = np.zeros(total, np.int64)
    buffer[: len(prompt)] = prompt
    cache = KVCache.empty(cfg, 1, total)
    weights = Weights(cfg, params, overlays, None)
    order = scan_order(cfg)
    seed &= 0xFFFFFFFF
    for t in range(total - 1):
        pos = np.array([t])
        normed = forward(cfg, tables, weights, buffer[None, t : t + 1], cache, pos)
        if t >= len(prompt) - 1:
            lgt = logits(cfg, weights, normed)[0, 0]
            buffer[t + 1] = choose_token(cfg, tables, lgt, buffer[: t + 1], seed, t, order)
    return buffer
