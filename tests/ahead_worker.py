"""`python -m deggs` whose CPU backend counts as asynchronous, for tests only: the worker
asks for its next chunk before it collects the one it started, as a GPU worker does
(runtime/worker.py, _serve), and says how many chunks it had started at once at most."""

import atexit

from deggs.cli import main
from deggs.numerics.es import Trainer
from deggs.runtime.worker import Worker

Trainer.asynchronous = property(lambda self: True)  # type: ignore[method-assign]
_start, _finish = Worker._start_chunk, Worker._finish_chunk
out = {"now": 0, "most": 0}


def start(self, sock, response):
    out["now"] += 1
    out["most"] = max(out["most"], out["now"])
    return _start(self, sock, response)


def finish(self, chunk):
    out["now"] -= 1
    return _finish(self, chunk)


Worker._start_chunk, Worker._finish_chunk = start, finish
atexit.register(lambda: print(f"[test] at most {out['most']} chunks started at once", flush=True))
main(prog_name="python -m deggs")
