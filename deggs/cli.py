"""Command-line entry points (console scripts in pyproject.toml)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click

from .checkpoint import CheckpointError
from .config import ConfigError, load_config
from .coordinator import Coordinator

DEFAULT_CONFIG = Path("config.toml")
EXIT_BAD_INPUT = 2


def _setup_logging():
    handler = logging.StreamHandler(sys.stdout)  # flushes after every record
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("deggs")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


async def _run_coordinator(coordinator: Coordinator):
    """Serve until --max-steps is reached or SIGINT/SIGTERM arrives, then flush and stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await coordinator.start()
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(coordinator.finished.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    if stop.is_set():
        logging.getLogger("deggs").info("signal received, shutting down")
    await coordinator.stop()


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="config.toml (default: ./config.toml if present, else built-in defaults)")
@click.option("--host", help="address to listen on (default: [coordinator] host)")
@click.option("--port", type=click.IntRange(0, 65535),
              help="port to listen on, 0 for any free one (default: [coordinator] port)")
@click.option("--save-dir", type=click.Path(file_okay=False), default="checkpoints",
              show_default=True, help="where checkpoints, config.json and metrics.jsonl go")
@click.option("--load-dir", type=click.Path(file_okay=False),
              help="resume from the newest checkpoint in this directory")
@click.option("--max-steps", type=click.IntRange(min=0),
              help="exit once the run reaches this step")
def coordinator_main(config_path, host, port, save_dir, load_dir, max_steps):
    """Run the d-eggs coordinator."""
    _setup_logging()
    try:
        if config_path is None and DEFAULT_CONFIG.exists():
            config_path = DEFAULT_CONFIG
        config = load_config(config_path)
        coordinator = Coordinator(config, save_dir=save_dir, load_dir=load_dir,
                                  max_steps=max_steps, host=host, port=port)
        asyncio.run(_run_coordinator(coordinator))
    except (ConfigError, CheckpointError, OSError) as e:
        click.echo(f"deggs-coordinator: error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
