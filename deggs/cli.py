"""Command-line entry points (console scripts in pyproject.toml)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click
from tqdm import tqdm

from .config import ConfigError, CoordinatorConfig, load_config, override
from .numerics.backend import NAMES as BACKEND_NAMES
from .plot import plot_main
from .runtime.auth import SecretError, load_secret, new_secret
from .runtime.checkpoint import CheckpointError
from .runtime.coordinator import Coordinator
from .runtime.protocol import Reason
from .runtime.tensorboard import TensorBoardError

DEFAULT_CONFIG = Path("config.toml")
DEFAULT_PORT = CoordinatorConfig.port  # a worker's without a config
# Exit codes of every command.
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # a user's mistake, or a refusal that retrying cannot fix
EXIT_DISK_FAILURE = 3  # the coordinator could not make a step durable


def _load_optional_config(config_path, assignments=()):
    """--config, else ./config.toml if present, else the built-in defaults; then the
    --set assignments. Says which it used, with the fingerprint."""
    if config_path is None and DEFAULT_CONFIG.exists():
        config_path = DEFAULT_CONFIG
    config = override(load_config(config_path), assignments)
    source = str(config_path) if config_path is not None else "the built-in defaults"
    sets = f" with {len(assignments)} --set" if assignments else ""
    click.echo(f"config: {source}{sets}, fingerprint {config.fingerprint().hex()}")
    return config


def _set_option(command):
    """--set table.key=value (repeatable), on every command that reads a config."""
    return click.option(
        "--set",
        "assignments",
        multiple=True,
        metavar="TABLE.KEY=VALUE",
        help="change one config key (repeatable), typed and checked like the file's",
    )(command)


class _Bars:
    """Progress bars on stderr, shown only while it is a terminal (tqdm's disable=None)
    so that log files stay clean: bars(stage, done, total), one bar per stage."""

    def __init__(self, **options) -> None:
        self.options = options
        self.stage: str | None = None
        self.bar: tqdm | None = None

    def __call__(self, stage: str, done: int, total: int, note: str = ""):
        if self.bar is None or stage != self.stage:
            self.close()
            layout = {} if total else {"bar_format": "{desc}"}  # nothing to count: a label
            self.stage = stage
            self.bar = tqdm(
                desc=stage,
                total=total,
                initial=done,
                file=sys.stderr,
                disable=None,
                **layout,
                **self.options,
            )
        else:
            self.bar.update(done - self.bar.n)
        if note:
            self.bar.set_postfix_str(note, refresh=False)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _setup_logging():
    handler = logging.StreamHandler(sys.stdout)  # flushes after every record
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("deggs")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


async def _run_coordinator(coordinator: Coordinator) -> int:
    """Serve until --max-steps, a disk failure or SIGINT/SIGTERM; then tell the workers,
    flush, stop, and return the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await coordinator.start()
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(coordinator.ended.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if coordinator.failure is not None:
        await coordinator.stop(Reason.DISK_FAILURE)
        return EXIT_DISK_FAILURE
    if coordinator.finished.is_set():
        await coordinator.tell_latecomers(interrupted=stop)
        await coordinator.stop(Reason.FINISHED)
    else:
        logging.getLogger("deggs").info("signal received, shutting down")
        await coordinator.stop(Reason.SHUTTING_DOWN)
    return EXIT_OK


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="config.toml (default: ./config.toml if present, else built-in defaults)",
)
@click.option("--host", help="address to listen on (default: [coordinator] host)")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    help="port to listen on, 0 for any free one (default: [coordinator] port)",
)
@click.option(
    "--save-dir",
    type=click.Path(file_okay=False),
    default="checkpoints",
    show_default=True,
    help="where checkpoints, config.json and metrics.jsonl go",
)
@click.option(
    "--load-dir",
    type=click.Path(file_okay=False),
    help="resume from the newest checkpoint in this directory",
)
@click.option("--max-steps", type=click.IntRange(min=0), help="exit once the run reaches this step")
@click.option(
    "--tensorboard",
    "tensorboard_dir",
    type=click.Path(file_okay=False),
    help="also write each step's scalars here as TensorBoard events "
    "(needs pip install 'deggs[tensorboard]')",
)
@_set_option
def coordinator_main(
    config_path, host, port, save_dir, load_dir, max_steps, tensorboard_dir, assignments
):
    """Run the d-eggs coordinator.

    Workers must prove the shared secret in DEGGS_SECRET (or the file DEGGS_SECRET_FILE)
    when one is set. Exit codes: 0 finished or stopped, 2 bad input, 3 a step could not be
    saved (the save directory stays consistent: resume it with --load-dir).
    """
    _setup_logging()
    try:
        config = _load_optional_config(config_path, assignments)
        coordinator = Coordinator(
            config,
            save_dir=save_dir,
            load_dir=load_dir,
            max_steps=max_steps,
            host=host,
            port=port,
            secret=load_secret(),
            tensorboard_dir=tensorboard_dir,
        )
        code = asyncio.run(_run_coordinator(coordinator))
    except (ConfigError, CheckpointError, SecretError, TensorBoardError, OSError) as e:
        click.echo(f"deggs-coordinator: error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if code == EXIT_DISK_FAILURE:
        click.echo(f"deggs-coordinator: error: {coordinator.failure}", err=True)
    sys.exit(code)


# --- the worker side ---------------------------------------------------------------------


def _fail(command: str, error: Exception):
    click.echo(f"{command}: error: {error}", err=True)
    sys.exit(EXIT_BAD_INPUT)


class _StopOnSignal:
    """Turns SIGINT/SIGTERM into StopWorker, so a worker unwinds and exits cleanly."""

    def __enter__(self):
        from .runtime.worker import StopWorker

        def handler(signum, frame):
            raise StopWorker(signal.Signals(signum).name)

        self.previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)
        return False


def _backend_option(what: str):
    """--backend, for the commands that run the model."""
    return click.option(
        "--backend",
        type=click.Choice(BACKEND_NAMES),
        default="auto",
        show_default=True,
        help=f"{what} (auto: the GPU where CuPy sees one, else the CPU)",
    )


@click.command()
@click.argument("host")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help="the coordinator's port (default: [coordinator] port of the config, else 12345)",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="config.toml; without it (and without ./config.toml) the worker adopts "
    "the coordinator's config",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=".",
    show_default=True,
    help="directory holding input.bin and decoding.bin",
)
@_backend_option("compute backend")
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    help="threads of the CPU backend and of NumPy's BLAS/OpenMP pools (default: all cores)",
)
@_set_option
def worker_main(host, port, config_path, data_dir, backend, threads, assignments):
    """Run a worker against the coordinator at HOST.

    When the coordinator requires a shared secret, put it in DEGGS_SECRET or in a file
    named by DEGGS_SECRET_FILE (never on the command line, where other users see it).
    The worker reconnects whenever the coordinator goes away. Exit codes: 0 the run is
    finished (or stopped by SIGINT/SIGTERM), 2 bad input or a refusal that retrying
    cannot fix (another config, a secret missing or too short, a coordinator that lost
    this worker's history). With a secret, nothing a peer says before it proved the secret
    ends the worker: it retries.
    """
    from .data import DataError
    from .numerics.cpu import limit_threads
    from .runtime.worker import StopWorker, Worker, WorkerError

    if threads is not None:
        limit_threads(threads)  # for the process's lifetime
    try:
        secret = load_secret()
        config = None
        if config_path is not None or DEFAULT_CONFIG.exists() or assignments:
            config = _load_optional_config(config_path, assignments)
        if port is None:
            port = config.coordinator.port if config is not None else DEFAULT_PORT
        worker = Worker(
            host,
            port,
            config,
            data_dir,
            backend,
            threads,
            log=lambda text: click.echo(text),
            secret=secret,
        )
        with _StopOnSignal():
            worker.run()  # returns when the coordinator says the run is finished
    except StopWorker as e:
        click.echo(f"[worker] {e}: stopping at step {worker.step}")
    except (ConfigError, DataError, SecretError, WorkerError) as e:
        _fail("deggs-worker", e)
    sys.exit(EXIT_OK)


@click.command()
@click.argument("text", type=click.Path(exists=True, dir_okay=False), required=False)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=256),
    help="256 for raw bytes, more for a byte-level BPE (default: the config's)",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="config.toml: its vocab_size, and its seq_len that input.bin and val.bin must "
    "exceed (default: ./config.toml if present, else built-in defaults)",
)
@click.option("--out", type=click.Path(file_okay=False), default=".", show_default=True)
@click.option(
    "--val-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.05,
    show_default=True,
    help="share of the token stream held out at its end as val.bin (0: none)",
)
@click.option(
    "--errors",
    type=click.Choice(["strict", "replace", "ignore"]),
    default="strict",
    show_default=True,
    help="bytes of TEXT that are not UTF-8: refused (strict), replaced by U+FFFD, or dropped",
)
@_set_option
def prepare_main(text, vocab_size, config_path, out, val_fraction, errors, assignments):
    """Write input.bin, val.bin and meta.json (and for a vocab above 256 decoding.bin and
    tokenizer.json) from TEXT (default: a built-in corpus).

    The last --val-fraction of the tokens go to val.bin; input.bin + val.bin is the whole
    stream. meta.json records the vocab, token type, tokenizer hash and token counts; a
    worker refuses data that does not match it. TEXT is read and encoded a piece at a
    time (cut at whitespace, so the tokens are those of one encode), with a progress bar
    on a terminal."""
    from .prepare import default_corpus, prepare

    try:
        cfg = _load_optional_config(config_path, assignments)
        if vocab_size is None:
            vocab_size = cfg.model.vocab_size
        with _Bars(unit="B", unit_scale=True, unit_divisor=1024) as bars:
            info = prepare(
                Path(text) if text else default_corpus(),
                vocab_size,
                out,
                val_fraction=val_fraction,
                cfg=cfg,
                errors=errors,
                progress=bars,
            )
    except (ConfigError, ValueError, OSError) as e:
        _fail("deggs-prepare", e)
    source = text or "the built-in corpus (Python's pydoc topics)"
    held = f" + {info['val_tokens']} validation (val.bin)" if info["val_tokens"] else ""
    click.echo(
        f"{info['train_tokens']} training tokens (input.bin){held} of {source}, "
        f"vocab {info['vocab_size']}, written to {out}"
    )


@click.command()
@click.option(
    "--load-dir",
    type=click.Path(exists=True, file_okay=False),
    help="a coordinator's save directory: replay its steps",
)
@click.option(
    "--model",
    "model_file",
    type=click.Path(exists=True, dir_okay=False),
    help="a model written by deggs-export: sample from it, no replay",
)
@click.option(
    "--from",
    "from_file",
    type=click.Path(exists=True, dir_okay=False),
    help="with --load-dir: start the replay from this export (an earlier step of the run)",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    default=".",
    show_default=True,
    help="input.bin (default prompt), decoding.bin and tokenizer.json",
)
@click.option("--prompt", help="text to continue (default: the data at the last step)")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1), help="tokens to sample")
@click.option("--seed", type=int, help="sampling seed (default: the last step's seed + 999)")
@_backend_option("where the model runs")
def generate_main(load_dir, model_file, from_file, data_dir, prompt, n_tokens, seed, backend):
    """Sample from a model: the one trained in --load-dir (rebuilt by replaying its steps)
    or an export (--model)."""
    from .data import DataError, detokenize, load_decoding, load_tokens
    from .numerics.sampling import prompt_window
    from .prepare import encode_prompt
    from .runtime.export import load_model, trainer_from_model

    if (load_dir is None) == (model_file is None):
        _fail("deggs-generate", ValueError("give either --load-dir or --model"))
    if from_file is not None and load_dir is None:
        _fail("deggs-generate", ValueError("--from needs --load-dir (its steps are replayed)"))
    try:
        model = load_model(model_file) if model_file is not None else None
        cfg = model.cfg if model is not None else _saved_run_config(load_dir)
        # the data and the prompt first: a replay can take a while
        decoding = Path(data_dir) / "decoding.bin"
        pieces = (
            load_decoding(decoding, cfg.model.vocab_size)
            if not cfg.model.byte_tokens and decoding.exists()
            else None
        )
        if prompt is None:
            tokens = load_tokens(Path(data_dir) / "input.bin", cfg)
        else:
            ids = encode_prompt(prompt, cfg.model.vocab_size, data_dir)
            if len(ids) == 0:
                raise ValueError("the prompt is empty")
        if model is not None:
            trainer = trainer_from_model(model, backend)
        else:
            trainer = _replay_run(load_dir, from_file, cfg, backend)
        step = trainer.step
        if prompt is None:
            ids = prompt_window(cfg, tokens, step)
        out = trainer.sample(ids, n_tokens, seed)
    except (ConfigError, CheckpointError, DataError, ValueError, OSError) as e:
        _fail("deggs-generate", e)
    n = len(ids)
    click.echo(f"step {step}:")
    click.echo(
        detokenize(out[:n], cfg, pieces) + click.style(detokenize(out[n:], cfg, pieces), fg="cyan")
    )


@click.command()
@click.option(
    "--load-dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="a coordinator's save directory",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="the model file to write (safetensors)",
)
@click.option(
    "--from",
    "from_file",
    type=click.Path(exists=True, dir_okay=False),
    help="start the replay from this export (an earlier step of the same run)",
)
@_backend_option("where the steps are replayed")
def export_main(load_dir, out, from_file, backend):
    """Rebuild the model trained in LOAD_DIR and write it to OUT as a safetensors file:
    its weights, overlays and optimizer state at the newest step, which deggs-generate
    --model samples from and --from resumes a replay from."""
    from .runtime.export import save_model

    try:
        if not Path(out).resolve().parent.is_dir():
            raise ValueError(f"{Path(out).parent} is not a directory")
        cfg = _saved_run_config(load_dir)
        trainer = _replay_run(load_dir, from_file, cfg, backend)
        with _Bars(unit="B", unit_scale=True, unit_divisor=1024) as bars:
            save_model(out, trainer, lambda done, total: bars(f"writing {out}", done, total))
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        _fail("deggs-export", e)
    size = Path(out).stat().st_size
    click.echo(f"step {trainer.step}: wrote {out} ({size / 2**20:.1f} MiB)")


def _saved_run_config(load_dir):
    from .runtime.checkpoint import saved_config

    cfg = saved_config(load_dir)
    if cfg is None:
        raise ConfigError(f"{load_dir} holds no config.json: is it a coordinator's save dir?")
    return cfg


def _replay_run(load_dir, from_file, cfg, backend):
    """The model of LOAD_DIR's newest step, replayed from scratch or from an export."""
    from .numerics.backend import make_backend
    from .numerics.es import Trainer
    from .runtime.checkpoint import list_checkpoints
    from .runtime.export import resume
    from .runtime.replay import replay

    if from_file is not None:
        trainer = resume(from_file, backend, save_dir=load_dir)
    else:
        trainer = Trainer(make_backend(cfg, backend))
    last = max(list_checkpoints(load_dir), default=0)
    with _Bars(unit="step") as bars:
        bars("replaying", trainer.step, last)  # shown before the first step, which may be slow
        show = lambda step, last, changed: bars("replaying", step, last, f"{changed} changed")
        return replay(load_dir, trainer, last, show)


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False))
@_set_option
def print_arch_main(config_path, assignments):
    """Print the model's parameter table."""
    from .numerics.params import parameter_table

    try:
        cfg = _load_optional_config(config_path, assignments)
    except (ConfigError, OSError) as e:
        _fail("deggs-print-arch", e)
    m = cfg.model
    click.echo("Configuration:")
    click.echo(f"  Hidden Dim: {m.hidden_dim}\n  Heads:      {m.n_heads} (Head Dim: {m.head_dim})")
    click.echo(
        f"  Layers:     {m.n_layers}\n  Vocab Size: {m.vocab_size}\n  Seq Len:    {m.seq_len}\n"
    )
    click.echo(f"{'Component':<25} {'Dimensions':<20} {'Params':<15} {'Size (MB)':<10}")
    click.echo("-" * 80)
    total = 0
    for name, dims, count in parameter_table(cfg):
        click.echo(f"{name:<25} {dims:<20} {count:<15} {count / 2**20:.4f}")
        total += count
    click.echo("=" * 80)
    click.echo(f"Total Parameters: {total}")
    click.echo(f"Total Size:       {total / 2**20:.2f} MB")


@click.command()
def secret_main():
    """Print a fresh shared secret: 256 random bits as 64 hex digits.

    Put it in a file only you can read and name that file in DEGGS_SECRET_FILE on the
    coordinator and every worker:

        deggs secret > ~/.deggs-secret && chmod 600 ~/.deggs-secret

    A password a person chose is not enough: one HELLO gets anyone the coordinator's HMAC
    proof, against which guesses can be tested offline. Secrets shorter than 32
    characters are refused.
    """
    click.echo(new_secret())


# --- every command: -h beside --help, and --version ---------------------------------------

from . import __version__  # noqa: E402  (deggs/__init__.py defines it and imports nothing)

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


def _standard_options(command: click.Command, prog_name: str) -> click.Command:
    """Give COMMAND -h beside --help, and --version ("PROG_NAME, version X")."""
    command.context_settings = {**HELP_OPTIONS, **command.context_settings}
    return click.version_option(__version__, prog_name=prog_name)(command)


@click.group(context_settings=HELP_OPTIONS)
@click.version_option(__version__, prog_name="deggs")
def main():
    """deggs: distributed EGGROLL, gradient-free training of int8 transformers.

    Each COMMAND is also installed as its own script, deggs-COMMAND (deggs-coordinator,
    deggs-worker, ...), and runs as python -m deggs COMMAND too. COMMAND -h shows its options.
    """


for _name, _command in [
    ("coordinator", coordinator_main),
    ("worker", worker_main),
    ("prepare", prepare_main),
    ("generate", generate_main),
    ("export", export_main),
    ("plot", plot_main),
    ("print-arch", print_arch_main),
    ("secret", secret_main),
]:
    main.add_command(_standard_options(_command, f"deggs-{_name}"), _name)
