"""Command-line entry points (console scripts in pyproject.toml)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from .config import (
    ConfigError,
    CoordinatorConfig,
    is_named_config,
    load_config,
    named_configs,
    override,
    sets_key,
)
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


def _config_path(config_path):
    """--config (a file, or a packaged config's name), else ./config.toml if present."""
    if config_path is None and DEFAULT_CONFIG.exists():
        return DEFAULT_CONFIG
    return config_path


def _load_optional_config(config_path, assignments=()):
    """--config, else ./config.toml if present, else the built-in defaults; then the
    --set assignments. Says which it used, with the fingerprint."""
    found = _config_path(config_path)
    config = override(load_config(found), assignments)
    if found is None:
        source = "the built-in defaults"
    elif config_path is None:  # easy to miss: say where it came from
        source = f"{found} (found in this directory; --config names another)"
    elif is_named_config(found):
        source = f"{found} (packaged)"
    else:
        source = str(found)
    sets = f" with {len(assignments)} --set" if assignments else ""
    click.echo(f"config: {source}{sets}, fingerprint {config.fingerprint().hex()}")
    return config


def _vocab_from_data(config, config_path, assignments, data_dir):
    """--data-dir: the vocabulary (and so the token type) that deggs-prepare recorded in
    DATA_DIR/meta.json, unless the user's file or a --set names another one."""
    from .data import META_FILE, check_meta, dtype_name, read_meta

    meta_path = Path(data_dir) / META_FILE
    meta = read_meta(data_dir)
    if meta is None:
        raise ConfigError(
            f"{meta_path} not found: --data-dir takes the vocabulary from the meta.json "
            "that deggs-prepare writes beside input.bin"
        )
    vocab = meta["vocab_size"]
    if meta["token_dtype"] != dtype_name(vocab):
        raise ConfigError(
            f"{meta_path}: token_dtype {meta['token_dtype']} does not go with vocab_size {vocab}"
        )
    config_path = _config_path(config_path)
    said = [f"--set {a}" for a in assignments if a.partition("=")[0].strip() == "model.vocab_size"]
    if not said and sets_key(config_path, "model", "vocab_size"):
        said = [f"{config_path}"]
    if said and config.model.vocab_size != vocab:
        raise ConfigError(
            f"{meta_path} says vocab_size {vocab}, {said[-1]} sets model.vocab_size = "
            f"{config.model.vocab_size}: say it once (leave it out of the config, or "
            "prepare the data again with --vocab-size)"
        )
    if config.model.vocab_size != vocab:
        config = config.replace(model={"vocab_size": vocab})
    check_meta(data_dir, config)  # the files there are the ones meta.json describes
    click.echo(
        f"vocab_size {vocab} ({meta['token_dtype']} tokens) from {meta_path}, "
        f"fingerprint {config.fingerprint().hex()}"
    )
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


# Signals that stop the coordinator: the first set ends the run (its workers exit too);
# the second means "back soon" (a restart with --load-dir), and its workers keep waiting.
END_SIGNALS = (signal.SIGINT, signal.SIGTERM)
AWAY_SIGNALS = (signal.SIGUSR1, signal.SIGHUP)


async def _run_coordinator(coordinator: Coordinator) -> int:
    """Serve until --max-steps, a disk failure or a signal; then tell the workers, flush,
    stop, and return the exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals):
        received.append(sig)
        stop.set()

    for sig in END_SIGNALS + AWAY_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            loop.add_signal_handler(sig, on_signal, sig)
    await coordinator.start()
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(coordinator.ended.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    log = logging.getLogger("deggs")
    if coordinator.failure is not None:
        await coordinator.stop(Reason.DISK_FAILURE)
        return EXIT_DISK_FAILURE
    if coordinator.finished.is_set():
        await coordinator.tell_latecomers(interrupted=stop)
        await coordinator.stop(Reason.FINISHED)
    elif received[0] in AWAY_SIGNALS:
        log.info(
            "%s: going away for now; the workers wait for a coordinator resumed with --load-dir",
            received[0].name,
        )
        await coordinator.stop(Reason.SHUTTING_DOWN)
    else:
        log.info("%s: the run ends here, and its workers are told to exit", received[0].name)
        await coordinator.stop(Reason.STOPPED)
    return EXIT_OK


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help=f"config file, or a packaged config: {', '.join(sorted(named_configs()))} "
    "(default: ./config.toml if present, else built-in defaults)",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="the data the workers train on: its meta.json gives model.vocab_size",
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
    config_path, data_dir, host, port, save_dir, load_dir, max_steps, tensorboard_dir, assignments
):
    """Run the d-eggs coordinator.

    Workers must prove the shared secret in DEGGS_SECRET (or the file DEGGS_SECRET_FILE)
    when one is set. Ctrl-C or SIGTERM ends the run, its workers too; SIGUSR1 (or SIGHUP)
    stops it for a restart with --load-dir, and the workers wait. Exit codes: 0 finished
    or stopped, 2 bad input, 3 a step could not be saved (the save directory stays
    consistent: resume it with --load-dir).
    """
    _setup_logging()
    try:
        config = _load_optional_config(config_path, assignments)
        if data_dir is not None:
            config = _vocab_from_data(config, config_path, assignments, data_dir)
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
    except (ConfigError, CheckpointError, SecretError, TensorBoardError, ValueError) as e:
        click.echo(f"deggs-coordinator: error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as e:
        click.echo(f"deggs-coordinator: error: {_os_error(e)}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    if code == EXIT_DISK_FAILURE:
        click.echo(f"deggs-coordinator: error: {coordinator.failure}", err=True)
    sys.exit(code)


def _os_error(e: OSError) -> str:
    """An OSError in one line, with the way out where there is a common one."""
    if e.errno == errno.EADDRINUSE:
        return f"{e} (another program listens there: --port 0 picks a free port)"
    return str(e)


# --- the worker side ---------------------------------------------------------------------


def _fail(command: str, error: Exception):
    click.echo(f"{command}: error: {error}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _stamped(text: str) -> None:
    """A worker's line, with the time as the coordinator's log lines have it."""
    click.echo(f"{time.strftime('%H:%M:%S')} {text}")


class _StopOnSignal:
    """SIGINT/SIGTERM: said at once, then the worker stops (StopWorker) as soon as it can:
    at once, or at the next batch of a chunk it is scoring; a second signal, at once."""

    def __init__(self, worker):
        self.worker = worker

    def __enter__(self):
        def handler(signum, frame):
            name = signal.Signals(signum).name
            # os.write: the handler may have interrupted a print to the same stream
            now = time.strftime("%H:%M:%S")
            line = f"{now} [worker] {name}: stopping at step {self.worker.step}\n"
            os.write(sys.stdout.fileno(), line.encode())
            self.worker.stop(name)

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
    help="config file or packaged config name; without it (and without ./config.toml) "
    "the worker adopts "
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
    finished or its coordinator was stopped (or this worker was, by SIGINT/SIGTERM:
    within a batch of the chunk under way), 2 bad input or a refusal that retrying
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
            log=_stamped,
            secret=secret,
        )
        with _StopOnSignal(worker):
            worker.run()  # returns when the coordinator says the run is over
    except StopWorker as e:
        _stamped(f"[worker] {e}: stopped at step {worker.step}")
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
    help="config file or packaged config name: its vocab_size, and its seq_len that "
    "input.bin and val.bin must exceed (default: ./config.toml if present, else built-in "
    "defaults)",
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
    help="input.bin (default prompt), decoding.bin and tokenizer.json (an export that "
    "carries the last two needs only --prompt)",
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    help="with --load-dir: the model at this step (default: the newest)",
)
@click.option("--prompt", help="text to continue (default: the data at the last step)")
@click.option("--tokens", "n_tokens", type=click.IntRange(min=1), help="tokens to sample")
@click.option("--seed", type=int, help="sampling seed (default: the last step's seed + 999)")
@_backend_option("where the model runs")
def generate_main(load_dir, model_file, from_file, data_dir, step, prompt, n_tokens, seed, backend):
    """Sample from a model: the one trained in --load-dir (rebuilt by replaying its steps)
    or an export (--model)."""
    from .data import DataError, detokenize, load_decoding, load_tokens, parse_decoding
    from .numerics.sampling import prompt_window
    from .prepare import encode_prompt
    from .runtime.export import load_model, trainer_from_model

    if (load_dir is None) == (model_file is None):
        _fail("deggs-generate", ValueError("give either --load-dir or --model"))
    if (from_file is not None or step is not None) and load_dir is None:
        _fail("deggs-generate", ValueError("--from and --step need --load-dir"))
    try:
        model = load_model(model_file) if model_file is not None else None
        cfg = model.cfg if model is not None else _saved_run_config(load_dir)
        # the data and the prompt first: a replay can take a while
        carried = model.files if model is not None else {}  # an export's own vocabulary
        decoding = Path(data_dir) / "decoding.bin"
        pieces = None
        if cfg.model.byte_tokens:
            pass
        elif "decoding.bin" in carried:
            pieces = parse_decoding(carried["decoding.bin"], model_file, cfg.model.vocab_size)
        elif decoding.exists():
            pieces = load_decoding(decoding, cfg.model.vocab_size)
        if prompt is None:
            if not (Path(data_dir) / "input.bin").exists():
                raise DataError(
                    f"{Path(data_dir) / 'input.bin'} not found: give --prompt TEXT, or "
                    "--data-dir with the training data (its window of the step is the prompt)"
                )
            tokens = load_tokens(Path(data_dir) / "input.bin", cfg)
        else:
            ids = encode_prompt(
                prompt, cfg.model.vocab_size, data_dir, carried.get("tokenizer.json")
            )
            if len(ids) == 0:
                raise ValueError("the prompt is empty")
        if model is not None:
            trainer = trainer_from_model(model, backend)
        else:
            trainer = _replay_run(load_dir, from_file, cfg, backend, step)
        step = trainer.step
        if prompt is None:
            ids = prompt_window(cfg, tokens, step)
        out = trainer.sample(ids, n_tokens, seed)
    except (ConfigError, CheckpointError, DataError, ValueError, OSError) as e:
        _fail("deggs-generate", e)
    n = len(ids)
    click.echo(f"step {step}: the prompt, >>>, then the model's {len(out) - n} tokens")
    click.echo(
        detokenize(out[:n], cfg, pieces)
        + click.style(" >>> ", bold=True)
        + click.style(detokenize(out[n:], cfg, pieces), fg="cyan")
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
@click.option(
    "--step", type=click.IntRange(min=0), help="the model at this step (default: the newest)"
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False),
    help="the training data: its decoding.bin and tokenizer.json go into OUT, so that "
    "deggs-generate --model OUT --prompt TEXT needs nothing else",
)
@_backend_option("where the steps are replayed")
def export_main(load_dir, out, from_file, step, data_dir, backend):
    """Rebuild the model trained in LOAD_DIR and write it to OUT as a safetensors file:
    its weights, overlays and optimizer state at the newest step (or --step), which
    deggs-generate --model samples from and --from resumes a replay from. The replay
    starts from the newest snapshot at or before that step."""
    from .runtime.export import save_model

    try:
        if not Path(out).resolve().parent.is_dir():
            raise ValueError(f"{Path(out).parent} is not a directory")
        cfg = _saved_run_config(load_dir)
        files = _vocabulary_files(data_dir, cfg) if data_dir is not None else {}
        trainer = _replay_run(load_dir, from_file, cfg, backend, step)
        with _Bars(unit="B", unit_scale=True, unit_divisor=1024) as bars:
            save_model(out, trainer, lambda done, total: bars(f"writing {out}", done, total), files)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        _fail("deggs-export", e)
    if not cfg.model.byte_tokens and not files:
        click.echo(
            "note: no --data-dir, so the model file carries no tokenizer: deggs-generate "
            "--model will need --data-dir for the prompt and the text"
        )
    size = Path(out).stat().st_size
    click.echo(f"step {trainer.step}: wrote {out} ({size / 2**20:.1f} MiB)")


def _vocabulary_files(data_dir, cfg) -> dict[str, bytes]:
    """decoding.bin and tokenizer.json of the run's data (none for a byte vocabulary),
    checked against the config and the data's meta.json."""
    from .data import TOKENIZER_FILE, check_meta, load_decoding

    if cfg.model.byte_tokens:
        return {}
    check_meta(data_dir, cfg)  # the tokenizer is the one the data was made with
    decoding = Path(data_dir) / "decoding.bin"
    load_decoding(decoding, cfg.model.vocab_size)  # whole, and of this vocabulary
    files = {"decoding.bin": decoding.read_bytes()}
    tokenizer = Path(data_dir) / TOKENIZER_FILE
    if tokenizer.exists():
        files["tokenizer.json"] = tokenizer.read_bytes()
    return files


def _saved_run_config(load_dir):
    from .runtime.checkpoint import saved_config

    cfg = saved_config(load_dir)
    if cfg is None:
        raise ConfigError(f"{load_dir} holds no config.json: is it a coordinator's save dir?")
    return cfg


def _replay_run(load_dir, from_file, cfg, backend, step=None):
    """The model of LOAD_DIR at `step` (default: its newest): from an export (--from),
    else from the newest snapshot at or before it, else from scratch; then the steps
    after it replayed."""
    from .numerics.backend import make_backend
    from .numerics.es import Trainer
    from .runtime.checkpoint import list_checkpoints
    from .runtime.export import resume, trainer_from_model
    from .runtime.replay import replay
    from .runtime.snapshot import newest_valid

    newest = max(list_checkpoints(load_dir), default=0)
    last = newest if step is None else step
    if last > newest:
        raise ValueError(f"--step {last}: {load_dir}'s history ends at step {newest}")
    found = newest_valid(load_dir, cfg, last) if from_file is None else None
    if from_file is not None:
        trainer = resume(from_file, backend, save_dir=load_dir)
        if trainer.step > last:
            raise ValueError(f"{from_file} is at step {trainer.step}, past --step {last}")
    elif found is not None:
        trainer = trainer_from_model(found[0], backend)
        click.echo(f"starting from the snapshot of step {trainer.step}", err=True)
    else:
        trainer = Trainer(make_backend(cfg, backend))
    with _Bars(unit="step") as bars:
        bars("replaying", trainer.step, last)  # shown before the first step, which may be slow
        show = lambda step, last, changed: bars("replaying", step, last, f"{changed} changed")
        return replay(load_dir, trainer, last, show)


@click.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="config file or packaged config name (default: ./config.toml if present, else "
    "built-in defaults)",
)
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
    deggs-worker, deggs-prepare, deggs-generate, deggs-export, deggs-plot,
    deggs-print-arch, deggs-secret), and runs as python -m deggs COMMAND too. COMMAND -h
    shows its options.
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
