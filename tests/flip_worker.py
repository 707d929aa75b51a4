"""`python -m deggs` with one fault injected, for tests only: the model flips one weight
when it first reaches step $DEGGS_TEST_FLIP_AT_STEP, as bad memory would, so that the
state digests can be seen to catch it (tests/test_snapshots.py). Nothing in deggs reads
that variable; this wrapper alone does."""

import os

import numpy as np

from deggs.cli import main
from deggs.numerics.es import Trainer

FLIP_AT = int(os.environ["DEGGS_TEST_FLIP_AT_STEP"])
_start_apply = Trainer.start_apply
flipped = False


def apply_then_flip(self, fitness):
    global flipped
    wait = _start_apply(self, fitness)  # params and load_state wait for the update
    if self.step == FLIP_AT and not flipped:
        flipped = True
        backend = self.backend
        params = backend.params
        params["embedding"][0, 0] = np.int8(params["embedding"][0, 0] ^ 0x40)
        backend.load_state(params, backend.overlays, backend.state)
        print(f"[test] flipped a weight at step {FLIP_AT}", flush=True)
    return wait


Trainer.start_apply = apply_then_flip
main(prog_name="python -m deggs")
