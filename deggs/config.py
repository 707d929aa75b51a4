"""The one config object: model shape, training math and coordinator settings.

Read at run time from config.toml (the reference recompiles config.h instead). Each
table of the file is a frozen dataclass; `Config` holds them all and is passed
explicitly to every function that needs a setting. Values are validated when the
config is built, with errors that name the offending key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    hidden_dim: int = 256
    head_dim: int = 64
    n_layers: int = 4
    seq_len: int = 64
    vocab_size: int = 8192

    @property
    def n_heads(self) -> int:
        return self.hidden_dim // self.head_dim

    @property
    def byte_tokens(self) -> bool:
        """Vocab 256 means raw bytes: input.bin holds uint8, otherwise uint32."""
        return self.vocab_size == 256


@dataclass(frozen=True)
class TrainingConfig:
    population_size: int = 327680
    chunk_size: int = 40960
    seed: int = 42
    init_seed: int = 42
    same_data: bool = False

    @property
    def n_chunks(self) -> int:
        return self.population_size // self.chunk_size

    @property
    def n_pairs(self) -> int:
        return self.population_size // 2


@dataclass(frozen=True)
class QuantizationConfig:
    fixed_point: int = 4
    sigma_shift: int = 3
    sigma_shift_vector: int = 4
    shift_attn: int = 8
    shift_out: int = 9
    shift_logit: int = 8
    shift_mlp_up: int = 8
    shift_mlp_down: int = 10


@dataclass(frozen=True)
class SoftmaxConfig:
    scale_bit: int = 18
    lut_size: int = 256
    exp_scale: float = 6.0


@dataclass(frozen=True)
class RopeConfig:
    scale_bit: int = 20


@dataclass(frozen=True)
class NoiseConfig:
    init_distribution: str = "uniform"
    init_mask: int = 15
    perturb_distribution: str = "uniform"
    perturb_mask: int = 15

    @property
    def perturb_bound(self) -> int:
        """The largest magnitude of one perturbation noise entry (three_sample sums three)."""
        return self.perturb_mask * (3 if self.perturb_distribution == "three_sample" else 1)


@dataclass(frozen=True)
class AdaptiveNoiseConfig:
    mode: int = 1
    inc: int = 5
    dec: int = 1
    init: int = 64


@dataclass(frozen=True)
class FitnessConfig:
    chunk_mean_filter: bool = True
    chunk_mean_exponent: float = 1.2
    adaptive_threshold: bool = True
    adaptive_threshold_alpha: float = 0.1


@dataclass(frozen=True)
class OptimizerConfig:
    kind: str = "adamw"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    sgd_vote_scale: float = 0.001
    lr_schedule: tuple = ((0, 0.5), (100, 0.25), (200, 0.125))
    bias_lr_scale: float = 0.1


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.6
    min_p: float = 0.08
    presence_penalty: float = 0.2
    prompt_tokens: int = 32
    generate_tokens: int = 64
    every_steps: int = 5


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = 10  # the validation loss of every this many steps (0: never)
    windows: int = 64  # fixed windows of val.bin it is measured on
    health_every_steps: int = 50  # weight and activation statistics (0: never)
    saturation_warning: float = 0.05  # the coordinator warns above this share at +-127


@dataclass(frozen=True)
class CoordinatorConfig:
    host: str = "0.0.0.0"
    port: int = 12345
    straggler_timeout_s: float = 90.0
    max_history: int = 5000
    handshake_timeout_s: float = 10.0  # connect -> first complete frame (and AUTH)
    frame_timeout_s: float = 30.0  # a frame, once begun, must complete
    idle_timeout_s: float = 300.0  # a connection holding no chunk must ask for work this often
    max_connections: int = 1024  # lowered to what the descriptor limit allows
    max_send_buffer: int = 1 << 20  # bytes queued to one peer before we stop reading it
    disk_retry_s: float = 60.0  # how long a failing checkpoint write is retried
    # Weight snapshots (runtime/snapshot.py): a GPU replays ~24 ms a step, so 1000 steps
    # keep a rejoin's replay near 25 s. 0: no snapshots.
    snapshot_every_steps: int = 1000
    keep_snapshots: int = 2  # the newest this many snapshot files stay on disk
    prune_history: bool = False  # delete the checkpoints before the oldest kept snapshot
    # State digests every this many steps, and at every snapshot step (0: those alone).
    digest_every_steps: int = 100


@dataclass(frozen=True)
class WorkerConfig:
    reply_timeout_s: float = 60.0  # a coordinator silent this long is taken as gone
    frame_timeout_s: float = 30.0  # a frame, once begun, must complete
    retry_max_s: float = 10.0  # the longest pause between reconnects
    resolve_tries: int = 3  # a host name that does not resolve this often is an error


# Upper bounds of the model's shape: beyond them no backend has the memory (the GPU's own,
# smaller limits are checked by deggs.numerics.gpu.plan.supports).
MODEL_LIMITS = {"hidden_dim": 2048, "n_layers": 256, "seq_len": 8192, "vocab_size": 1 << 20}

# Tables that do not change the math, and so stay out of the fingerprint.
NON_MATH_SECTIONS = ("coordinator", "worker", "eval")

CHOICES = {
    ("noise", "init_distribution"): ("uniform", "three_sample"),
    ("noise", "perturb_distribution"): ("uniform", "three_sample"),
    ("optimizer", "kind"): ("adamw", "sgd"),
    ("adaptive_noise", "mode"): (0, 1, 2),
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    softmax: SoftmaxConfig = field(default_factory=SoftmaxConfig)
    rope: RopeConfig = field(default_factory=RopeConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    adaptive_noise: AdaptiveNoiseConfig = field(default_factory=AdaptiveNoiseConfig)
    fitness: FitnessConfig = field(default_factory=FitnessConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        _validate(self)

    # --- conversions -----------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        if not isinstance(data, dict):
            raise ConfigError("config must be a table of tables")
        sections = {}
        known = {f.name: f for f in fields(cls)}
        for name, table in data.items():
            if name not in known:
                raise ConfigError(f"unknown table [{name}]{_did_you_mean(name, known)}")
            if not isinstance(table, dict):
                raise ConfigError(f"[{name}] must be a table")
            section_cls = known[name].default_factory
            sections[name] = _build_section(name, section_cls, table)
        return cls(**sections)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            section = dataclasses.asdict(getattr(self, f.name))
            if "lr_schedule" in section:
                section["lr_schedule"] = [list(p) for p in section["lr_schedule"]]
            out[f.name] = section
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_toml(self) -> str:
        """The config as config.toml text, every key written (JSON's numbers, strings,
        booleans and arrays are TOML's too)."""
        lines = []
        for table, values in self.to_dict().items():
            lines.append(f"[{table}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Parse config JSON, which may come from a peer: bounded in size, depth and
        number length, and free of NaN and infinities."""
        return cls.from_dict(_parse_json(text))

    def replace(self, **sections) -> Config:
        """A copy with some tables' keys changed: replace(model={'seq_len': 16})."""
        data = self.to_dict()
        for name, changes in sections.items():
            if name not in data:
                raise ConfigError(f"unknown table [{name}]{_did_you_mean(name, data)}")
            data[name].update(changes)
        return Config.from_dict(data)

    # --- identity --------------------------------------------------------------

    def math_dict(self) -> dict:
        return {k: v for k, v in self.to_dict().items() if k not in NON_MATH_SECTIONS}

    def fingerprint(self) -> bytes:
        """8 bytes that identify every setting that changes the training math."""
        text = json.dumps(self.math_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()[:8]

    def differences(self, other: Config) -> list[str]:
        """Keys whose math-relevant values differ, as 'table.key: ours != theirs'."""
        a, b = self.math_dict(), other.math_dict()
        out = []
        for table in sorted(a):
            for key in sorted(a[table]):
                if a[table][key] != b[table][key]:
                    out.append(f"{table}.{key}: {a[table][key]!r} != {b[table][key]!r}")
        return out

    # --- derived settings --------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """The schedule's rate for a step, as a Python float (the worker casts to float32)."""
        lr = self.optimizer.lr_schedule[0][1]
        for first_step, rate in self.optimizer.lr_schedule:
            if step >= first_step:
                lr = rate
        return lr

    @property
    def token_dtype(self):
        import numpy as np

        return np.uint8 if self.model.byte_tokens else np.uint32


MAX_JSON_CHARS = 64 * 1024
MAX_JSON_DEPTH = 4  # a config is a table of tables; lr_schedule adds two levels
MAX_NUMBER_CHARS = 40


def _json_depth(text: str) -> int:
    """How deep JSON text nests, in one pass (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _parse_json(text: str) -> Any:
    if len(text) > MAX_JSON_CHARS:
        raise ConfigError(f"config JSON is {len(text)} characters, more than {MAX_JSON_CHARS}")
    deepest = _json_depth(text)
    if deepest > MAX_JSON_DEPTH:
        raise ConfigError(f"config JSON nests {deepest} levels deep, at most {MAX_JSON_DEPTH}")

    def number(kind):
        def parse(s: str):
            if len(s) > MAX_NUMBER_CHARS:
                raise ConfigError(f"config JSON holds a number of {len(s)} characters")
            value = kind(s)
            if not math.isfinite(value):
                raise ConfigError(f"config JSON holds {s}, which is not a finite number")
            return value

        return parse

    def no_constant(name: str):
        raise ConfigError(f"config JSON holds {name}, which no setting takes")

    try:
        return json.loads(
            text, parse_int=number(int), parse_float=number(float), parse_constant=no_constant
        )
    except json.JSONDecodeError as e:
        raise ConfigError(f"config JSON is malformed: {e}") from None


def override(config: Config, assignments) -> Config:
    """A config with `table.key=value` assignments applied (--set on the command line).

    The value is read as TOML (3, 0.5, true, "text", [[0, 0.5]]), or as a bare string
    where that fails, and then typed and validated like the file's own values.
    """
    changes: dict[str, dict] = {}
    for item in assignments:
        name, sep, text = str(item).partition("=")
        table, dot, key = name.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"--set {item!r}: expected table.key=value")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        changes.setdefault(table, {})[key] = value
    try:
        return config.replace(**changes)
    except ConfigError as e:
        raise ConfigError(f"--set: {e}") from None


def named_configs() -> dict[str, Any]:
    """The configs shipped in the package (deggs/configs/NAME.toml), by NAME."""
    folder = resources.files("deggs") / "configs"
    return {
        entry.name.removesuffix(".toml"): entry
        for entry in folder.iterdir()
        if entry.name.endswith(".toml")
    }


def is_named_config(name: str | Path | None) -> bool:
    """Whether --config NAME means a packaged config: NAME is not a file but a name of one."""
    return name is not None and not Path(name).exists() and str(name) in named_configs()


def load_config(path: str | Path | None = None) -> Config:
    """Read a config.toml, or a packaged config by name (`small`) when no such file is
    there; None gives the reference defaults."""
    if path is None:
        return Config()
    if is_named_config(path):
        entry = named_configs()[str(path)]
        try:
            return Config.from_dict(tomllib.loads(entry.read_text()))
        except ConfigError as e:  # (a packaged config is tested; this names it all the same)
            raise ConfigError(f"the packaged config {path}: {e}") from None
    data = _read_toml(Path(path))
    try:
        return Config.from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        names = sorted(named_configs())
        close = difflib.get_close_matches(str(path), names, n=1)
        hint = f"did you mean {close[0]}?" if close else f"packaged configs: {', '.join(names)}"
        raise ConfigError(f"config file not found: {path} ({hint})") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return data


def sets_key(path: str | Path | None, table: str, key: str) -> bool:
    """Whether the user's config file at PATH sets table.key itself (a packaged config,
    or none, does not: its values are defaults, which the data's meta.json may replace)."""
    if path is None or is_named_config(path):
        return False
    section = _read_toml(Path(path)).get(table)
    return isinstance(section, dict) and key in section


def _did_you_mean(word: str, known) -> str:
    """' (did you mean X?)' for the closest known name, else the list of them."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (known: {', '.join(known)})"


# --- validation -------------------------------------------------------------------


def _build_section(name: str, cls, table: dict):
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"unknown key {name}.{key}{_did_you_mean(key, known)}")
        default = known[key].default
        values[key] = _coerce(f"{name}.{key}", value, default)
    return cls(**values)


def _coerce(where: str, value: Any, default: Any):
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, not {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, not {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            raise ConfigError(f"{where} must be a finite number, not {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, not {value!r}")
        return value
    if isinstance(default, tuple):  # lr_schedule
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{where} must be a non-empty list of [first_step, lr] pairs")
        pairs = []
        for p in value:
            if (
                not isinstance(p, (list, tuple))
                or len(p) != 2
                or isinstance(p[0], bool)
                or not isinstance(p[0], int)
                or isinstance(p[1], bool)
                or not isinstance(p[1], (int, float))
                or not _finite(p[1])
            ):
                raise ConfigError(f"{where} entries must be [first_step, lr], not {p!r}")
            pairs.append((p[0], float(p[1])))
        return tuple(pairs)
    raise ConfigError(f"{where}: unsupported value {value!r}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _require(ok: bool, key: str, message: str):
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _validate(c: Config):
    m, t, q = c.model, c.training, c.quantization
    for section in fields(c):
        obj = getattr(c, section.name)
        for f in fields(obj):
            v = getattr(obj, f.name)
            choices = CHOICES.get((section.name, f.name))
            if choices is not None:
                _require(
                    v in choices,
                    f"{section.name}.{f.name}",
                    f"must be one of {', '.join(map(repr, choices))}, not {v!r}",
                )
    for key in ("hidden_dim", "head_dim", "n_layers", "seq_len", "vocab_size"):
        _require(getattr(m, key) > 0, f"model.{key}", "must be positive")
    for key, most in MODEL_LIMITS.items():
        _require(getattr(m, key) <= most, f"model.{key}", f"at most {most}")
    _require(
        m.hidden_dim % m.head_dim == 0,
        "model.hidden_dim",
        f"{m.hidden_dim} is not a multiple of model.head_dim = {m.head_dim}",
    )
    _require(m.hidden_dim % 32 == 0, "model.hidden_dim", f"{m.hidden_dim} is not a multiple of 32")
    _require(
        m.head_dim % 32 == 0,
        "model.head_dim",
        f"{m.head_dim} is not a multiple of 32 (a head spans whole warps)",
    )
    _require(m.vocab_size >= 2, "model.vocab_size", "must be at least 2")
    _require(
        t.chunk_size > 0 and t.chunk_size % 2 == 0,
        "training.chunk_size",
        f"must be a positive even number (antithetic pairs), not {t.chunk_size}",
    )
    _require(t.population_size > 0, "training.population_size", "must be positive")
    _require(
        t.population_size % t.chunk_size == 0,
        "training.population_size",
        f"{t.population_size} is not a multiple of training.chunk_size = {t.chunk_size}",
    )
    _require(t.population_size < 2**31, "training.population_size", "must be below 2^31")
    _require(0 <= t.seed < 2**32, "training.seed", "must fit in 32 bits")
    _require(
        0 < t.init_seed < 2**32,
        "training.init_seed",
        "must be a non-zero 32-bit value (xorshift32 stays at 0 forever)",
    )
    for f in fields(q):
        _require(0 <= getattr(q, f.name) < 31, f"quantization.{f.name}", "must be in 0..30")
    _require(1 <= c.softmax.scale_bit <= 30, "softmax.scale_bit", "must be in 1..30")
    _require(1 <= c.softmax.lut_size <= 4096, "softmax.lut_size", "must be in 1..4096")
    _require(c.softmax.exp_scale > 0, "softmax.exp_scale", "must be positive")
    _require(1 <= c.rope.scale_bit <= 30, "rope.scale_bit", "must be in 1..30")
    for key in ("init_mask", "perturb_mask"):
        _require(0 <= getattr(c.noise, key) <= 31, f"noise.{key}", "must be in 0..31 (int8 noise)")
    a = c.adaptive_noise
    for key in ("inc", "dec"):
        _require(0 <= getattr(a, key) <= 127, f"adaptive_noise.{key}", "must be in 0..127")
    _require(-127 <= a.init <= 127, "adaptive_noise.init", "must be in -127..127")
    _require(c.fitness.chunk_mean_exponent > 0, "fitness.chunk_mean_exponent", "must be positive")
    _require(
        c.fitness.adaptive_threshold_alpha >= 0,
        "fitness.adaptive_threshold_alpha",
        "must not be negative",
    )
    o = c.optimizer
    _require(0 <= o.beta1 < 1, "optimizer.beta1", "must be in [0, 1)")
    _require(0 <= o.beta2 < 1, "optimizer.beta2", "must be in [0, 1)")
    _require(o.eps > 0, "optimizer.eps", "must be positive")
    for key in ("weight_decay", "sgd_vote_scale", "bias_lr_scale"):
        _require(getattr(o, key) >= 0, f"optimizer.{key}", "must not be negative")
    _require(
        all(lr >= 0 for _, lr in o.lr_schedule),
        "optimizer.lr_schedule",
        "learning rates must not be negative",
    )
    _require(o.lr_schedule[0][0] == 0, "optimizer.lr_schedule", "must start at step 0")
    steps = [p[0] for p in o.lr_schedule]
    _require(steps == sorted(set(steps)), "optimizer.lr_schedule", "first steps must increase")
    s = c.sampling
    _require(s.temperature > 0, "sampling.temperature", "must be positive")
    _require(0 < s.min_p <= 1, "sampling.min_p", "must be in (0, 1]")
    _require(s.prompt_tokens >= 1, "sampling.prompt_tokens", "must be at least 1")
    _require(s.generate_tokens >= 0, "sampling.generate_tokens", "must not be negative")
    _require(s.every_steps >= 1, "sampling.every_steps", "must be at least 1")
    _require(c.eval.every_steps >= 0, "eval.every_steps", "must not be negative")
    _require(1 <= c.eval.windows <= 65536, "eval.windows", "must be in 1..65536")
    _require(c.eval.health_every_steps >= 0, "eval.health_every_steps", "must not be negative")
    _require(0 <= c.eval.saturation_warning <= 1, "eval.saturation_warning", "must be in [0, 1]")
    k = c.coordinator
    _require(0 <= k.port <= 65535, "coordinator.port", "must be in 0..65535")
    _require(k.straggler_timeout_s > 0, "coordinator.straggler_timeout_s", "must be positive")
    _require(k.max_history >= 1, "coordinator.max_history", "must be at least 1")
    for key in ("snapshot_every_steps", "digest_every_steps"):
        _require(getattr(k, key) >= 0, f"coordinator.{key}", "must not be negative (0: off)")
    _require(k.keep_snapshots >= 1, "coordinator.keep_snapshots", "must be at least 1")
    _require(
        not k.prune_history or k.snapshot_every_steps > 0,
        "coordinator.prune_history",
        "needs coordinator.snapshot_every_steps > 0 (without snapshots the history is the model)",
    )
    _require(bool(k.host), "coordinator.host", "must not be empty")
    for key in ("handshake_timeout_s", "frame_timeout_s", "idle_timeout_s", "disk_retry_s"):
        _require(
            0 < getattr(k, key) < 1e6,
            f"coordinator.{key}",
            "must be positive and below 1e6 seconds",
        )
    _require(k.max_connections >= 1, "coordinator.max_connections", "must be at least 1")
    _require(
        k.max_send_buffer >= 1 << 16,
        "coordinator.max_send_buffer",
        "must be at least 65536 (a catch-up reply must fit)",
    )
    w = c.worker
    for key in ("reply_timeout_s", "frame_timeout_s", "retry_max_s"):
        _require(
            0 < getattr(w, key) < 1e6, f"worker.{key}", "must be positive and below 1e6 seconds"
        )
    _require(
        w.reply_timeout_s >= 2,
        "worker.reply_timeout_s",
        "must be at least 2 seconds (a coordinator may hold a request for work for 1 s)",
    )
    _require(w.resolve_tries >= 1, "worker.resolve_tries", "must be at least 1")
