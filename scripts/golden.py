"""Golden vectors recorded from the d-eggs reference: finding, opening and reading them.

A golden file is an .npz (see ../shared/golden/README.md for its keys) with the token
stream beside it (NAME.input.bin, NAME.decoding.bin) or, in the trimmed copies kept in
tests/golden/ (made by scripts/vendor_golden.py), inside it as `input`. Its config is a
shape row plus the reference's compile-time switches, which REFERENCE_SWITCHES maps onto
deggs config keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from deggs.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]
VENDORED = ROOT / "tests" / "golden"
SHARED = ROOT.parent / "shared" / "golden"
TINY = ("tiny_bytes", "tiny_tok", "tiny_variant")

_BOOL = lambda v: bool(int(v))
_DIST = lambda v: "three_sample" if int(v) else "uniform"
REFERENCE_SWITCHES = {
    "HIDDEN_DIM": ("model", "hidden_dim", int),
    "HEAD_DIM": ("model", "head_dim", int),
    "N_LAYERS": ("model", "n_layers", int),
    "SEQ_LEN": ("model", "seq_len", int),
    "VOCAB_SIZE": ("model", "vocab_size", int),
    "CHUNK_SIZE": ("training", "chunk_size", int),
    "USE_SAME_DATA": ("training", "same_data", _BOOL),
    "FIXED_POINT": ("quantization", "fixed_point", int),
    "SIGMA_SHIFT": ("quantization", "sigma_shift", int),
    "SIGMA_SHIFT_VECTOR": ("quantization", "sigma_shift_vector", int),
    "SHIFT_ATTN": ("quantization", "shift_attn", int),
    "SHIFT_OUT": ("quantization", "shift_out", int),
    "SHIFT_LOGIT": ("quantization", "shift_logit", int),
    "SHIFT_MLP_UP": ("quantization", "shift_mlp_up", int),
    "SHIFT_MLP_DOWN": ("quantization", "shift_mlp_down", int),
    "SOFTMAX_SCALE_BIT": ("softmax", "scale_bit", int),
    "SOFTMAX_LUT_SIZE": ("softmax", "lut_size", int),
    "SOFTMAX_EXP_SCALE": ("softmax", "exp_scale", float),
    "ROPE_SCALE_BIT": ("rope", "scale_bit", int),
    "HOST_GAUSSIAN": ("noise", "init_distribution", _DIST),
    "DEVICE_GAUSSIAN": ("noise", "perturb_distribution", _DIST),
    "HOST_MASK": ("noise", "init_mask", int),
    "DEVICE_MASK": ("noise", "perturb_mask", int),
    "ADAPTIVE_NOISE_MODE": ("adaptive_noise", "mode", int),
    "ADAPTIVE_NOISE_INC": ("adaptive_noise", "inc", int),
    "ADAPTIVE_NOISE_DEC": ("adaptive_noise", "dec", int),
    "ADAPTIVE_NOISE_INIT": ("adaptive_noise", "init", int),
    "CHUNK_MEAN_FILTER": ("fitness", "chunk_mean_filter", _BOOL),
    "CHUNK_MEAN_EXPONENT": ("fitness", "chunk_mean_exponent", float),
    "USE_ADAPTIVE_THRESHOLD": ("fitness", "adaptive_threshold", _BOOL),
    "ADAPTIVE_THRESHOLD_ALPHA": ("fitness", "adaptive_threshold_alpha", float),
    "ADAM_BETA1": ("optimizer", "beta1", float),
    "ADAM_BETA2": ("optimizer", "beta2", float),
    "ADAM_EPS": ("optimizer", "eps", float),
    "ADAM_WEIGHT_DECAY": ("optimizer", "weight_decay", float),
    "SAMPLING_TEMP": ("sampling", "temperature", float),
    "SAMPLING_MIN_P": ("sampling", "min_p", float),
    "SAMPLING_PRESENCE_PENALTY": ("sampling", "presence_penalty", float),
}


def apply_switches(config: Config, switches) -> Config:
    """Apply reference-style 'NAME=VALUE' switches (as golden files list them)."""
    changes: dict[str, dict] = {}
    for item in switches:
        name, sep, value = str(item).partition("=")
        if not sep or name not in REFERENCE_SWITCHES:
            raise ConfigError(f"unknown reference switch {item!r}")
        table, key, conv = REFERENCE_SWITCHES[name]
        changes.setdefault(table, {})[key] = conv(value.rstrip("f"))
    return config.replace(**changes)


def golden_config(golden) -> Config:
    """The config a golden file was recorded with: its shape row plus its switches."""
    h, hd, layers, seq, vocab, chunk, population = (int(v) for v in golden["config"])
    cfg = Config().replace(
        model=dict(hidden_dim=h, head_dim=hd, n_layers=layers, seq_len=seq, vocab_size=vocab),
        training=dict(chunk_size=chunk, population_size=population),
    )
    if "switches" in golden.files:
        cfg = apply_switches(cfg, golden["switches"])
    return cfg


def golden_steps(golden) -> list[int]:
    """The steps whose member losses the file holds."""
    return sorted(
        int(k[4:].split("/")[0])
        for k in golden.files
        if k.startswith("step") and k.endswith("/losses")
    )


def find(name: str) -> Path | None:
    """NAME.npz in $DEGGS_GOLDEN (DEGGS_GOLDEN=../shared/golden for the complete files),
    else the trimmed copies in tests/golden, so the tests check what a clone carries."""
    dirs = [Path(os.environ["DEGGS_GOLDEN"])] if os.environ.get("DEGGS_GOLDEN") else []
    for d in dirs + [VENDORED]:
        if (d / f"{name}.npz").exists():
            return d / f"{name}.npz"
    return None


def tokens(golden, path: Path, cfg: Config) -> np.ndarray:
    """The token stream a golden run trained on."""
    if "input" in golden.files:
        return golden["input"]
    return np.fromfile(path.with_suffix(".input.bin"), dtype=cfg.token_dtype)
