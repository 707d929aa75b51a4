#!/usr/bin/env python3
"""Write the trimmed golden files kept in the repository (tests/golden/NAME.npz).

    python scripts/vendor_golden.py [--source ../shared/golden] [--dest tests/golden]

The complete golden vectors (../shared/golden, ~26 MB) live outside the repository; the
tests must run without them, so this keeps just enough of each file for
scripts/conformance.py to check everything it checks, in a few MB:

* tiny_bytes, tiny_tok, tiny_variant (full mode): config, switches, model_init/* (the
  init check), every stepS/* (losses, fitness, sum_loss, packed bytes, generations),
  every afterS/fitness_used and afterS/updates; the weights and overlays after the
  update only at after1, after4 and after8; the Adam state only at after4 and only for
  the vector parameters and the embedding (conformance compares the arrays present).
* default (slice mode, --members 1 --update-slice 8): config, switches, step0/*,
  after1/fitness_used and after1/updates, the corner of after1's weights a slice of 8
  reads (first 8 entries of each matrix's last two axes, of each vector's last axis,
  layer axis whole) and every overlay (the reference's update changed no weight at this
  step, so the slice decides every overlay entry). No model_init (too big;
  conformance skips the init check without it) and no step 1.

Each file carries its token stream as the key `input` (for default: zeros except the
windows step 0's first member of each chunk trains on and the generation's prompt, found
with the real deggs.numerics functions; original length). tiny_tok's decoding.bin is
copied beside it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import golden as goldens  # noqa: E402
from deggs.numerics.model import member_tokens  # noqa: E402
from deggs.numerics.params import PARAM  # noqa: E402
from deggs.numerics.sampling import prompt_window  # noqa: E402

TINY_AFTER_STATE = (1, 4, 8)  # after-update weights and overlays kept at these steps
TINY_ADAM = 4  # optimizer state kept after this update
SLICE = 8  # default: corner of each parameter / overlay kept
SLICE_MEMBERS = 1  # default: members of each chunk whose windows are kept


def trim_tiny(golden) -> dict[str, np.ndarray]:
    out = {}
    vectors = {name for name, p in PARAM.items() if not p.is_matrix} | {"embedding"}
    for key in golden.files:
        parts = key.split("/")
        top = parts[0]
        if top in ("config", "switches") or top == "model_init" or top.startswith("step"):
            keep = True
        elif top.startswith("after"):
            after = int(top[5:])
            what = parts[1]
            if what in ("fitness_used", "updates"):
                keep = True
            elif what in ("model", "scales"):
                keep = after in TINY_AFTER_STATE
            elif what.startswith("adam_"):
                keep = after == TINY_ADAM and parts[2] in vectors
            else:
                raise click.ClickException(f"unexpected key {key}")
        else:
            raise click.ClickException(f"unexpected key {key}")
        if keep:
            out[key] = golden[key]
    return out


def needed_positions(cfg, n: int) -> np.ndarray:
    """Token positions the slice check reads at step 0: member windows and the prompt."""
    positions = np.arange(n, dtype=np.int64)  # a stream whose tokens are their positions
    c = cfg.training.chunk_size
    members = (
        np.arange(cfg.training.n_chunks)[:, None] * c + np.arange(min(SLICE_MEMBERS, c))[None, :]
    ).ravel()
    windows = member_tokens(cfg, positions, 0, members).ravel()
    prompt = prompt_window(cfg, positions, 0)
    return np.unique(np.concatenate([windows, prompt]))


def trim_default(golden, data: np.ndarray, cfg) -> dict[str, np.ndarray]:
    out = {k: golden[k] for k in ("config", "switches") if k in golden.files}
    out.update({k: golden[k] for k in golden.files if k.startswith("step0/")})
    out["after1/fitness_used"] = golden["after1/fitness_used"]
    out["after1/updates"] = golden["after1/updates"]
    for key in golden.files:
        if key.startswith("after1/model/"):
            name = key.split("/")[2]
            corner = (slice(0, SLICE),) * (2 if PARAM[name].is_matrix else 1)
            out[key] = np.ascontiguousarray(golden[key][(Ellipsis, *corner)])
        elif key.startswith("after1/scales/"):  # whole: the step changed no weight, so
            out[key] = golden[key]  # every entry is decided (and they compress to nothing)
    keep = needed_positions(cfg, len(data))
    sparse = np.zeros_like(data)
    sparse[keep] = data[keep]
    out["input"] = sparse
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--source",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=goldens.SHARED,
    show_default=True,
    help="the complete golden files",
)
@click.option(
    "--dest",
    type=click.Path(file_okay=False, path_type=Path),
    default=goldens.VENDORED,
    show_default=True,
    help="where the trimmed copies go",
)
def main(source: Path, dest: Path):
    dest.mkdir(parents=True, exist_ok=True)
    for name in (*goldens.TINY, "default"):
        path = source / f"{name}.npz"
        with np.load(path) as golden:
            cfg = goldens.golden_config(golden)
            data = goldens.tokens(golden, path, cfg)
            out = trim_default(golden, data, cfg) if name == "default" else trim_tiny(golden)
            if name != "default":
                out["input"] = data
        np.savez_compressed(dest / f"{name}.npz", **out)
        print(f"{name}.npz: {len(out)} keys, {(dest / f'{name}.npz').stat().st_size} bytes")
    shutil.copyfile(source / "tiny_tok.decoding.bin", dest / "tiny_tok.decoding.bin")


if __name__ == "__main__":
    main()
