"""The one place tests find golden vectors and the GPU.

Golden files: `golden_path(name)` (a fixture returning a function) resolves NAME.npz
through scripts/golden.py's find ($DEGGS_GOLDEN, then the trimmed copies in
tests/golden). The trimmed copies are part of the repository, so a name that cannot be
found fails the test: that is a broken checkout, not a machine without data. Set
DEGGS_GOLDEN=../shared/golden to run the same tests against the complete files.

GPU: mark a test `@pytest.mark.requires_gpu`. Without CuPy and a CUDA device it is
skipped (with the reason shown under -rs), unless DEGGS_REQUIRE_GPU=1, where it fails:
a GPU machine that silently skipped its GPU tests would prove nothing.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import golden as goldens  # noqa: E402  (scripts/golden.py)

GOLDEN_NAMES = (*goldens.TINY, "default")
GPU_REASON = "needs CuPy and a CUDA device"


def find_golden(name: str) -> Path:
    """NAME.npz as scripts/golden.py finds it; fails the test when there is none."""
    path = goldens.find(name)
    if path is None:
        pytest.fail(
            f"golden file {name}.npz not found in $DEGGS_GOLDEN "
            f"({os.environ.get('DEGGS_GOLDEN') or 'unset'}) or {goldens.VENDORED}: "
            f"the trimmed copies belong to the repository "
            f"(rebuild them with scripts/vendor_golden.py)",
            pytrace=False,
        )
    return path


def decoding_beside(path: Path) -> Path | None:
    """NAME.decoding.bin beside a golden file, where there is one."""
    decoding = path.with_name(path.stem + ".decoding.bin")
    return decoding if decoding.exists() else None


@pytest.fixture
def golden_path():
    """A function: golden_path(name) -> Path of NAME.npz (fails when missing)."""
    return find_golden


@pytest.fixture
def golden_decoding():
    """A function: golden_decoding(path) -> NAME.decoding.bin beside a golden file, or None."""
    return decoding_beside


@pytest.fixture(scope="session")
def conformance():
    """scripts/conformance.py as a module."""
    return importlib.import_module("conformance")


@functools.cache
def gpu_present() -> bool:
    from deggs.numerics.backend import gpu_present as present

    return present()


def gpu_required() -> bool:
    return os.environ.get("DEGGS_REQUIRE_GPU") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"requires_gpu: {GPU_REASON}; skipped without one (fails instead when DEGGS_REQUIRE_GPU=1)",
    )
    # Run as a background job (`pytest &` in a script), the tests start with SIGINT
    # ignored, and so would every process they start: an ignored signal stays ignored
    # across exec, and the CLIs keep it so (as nohup's SIGHUP). The tests that press
    # Ctrl-C on a coordinator or run-workers.sh need it as a terminal delivers it: a
    # handled signal is reset to its default in a child.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("requires_gpu")]
    if not marked or gpu_present() or gpu_required():
        return
    skip = pytest.mark.skip(reason=f"{GPU_REASON} (set DEGGS_REQUIRE_GPU=1 to fail instead)")
    for item in marked:
        item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # (in the call phase rather than setup, so that it reports FAILED, not ERROR)
    if item.get_closest_marker("requires_gpu") and gpu_required() and not gpu_present():
        pytest.fail(
            f"DEGGS_REQUIRE_GPU=1 but no GPU is usable here ({GPU_REASON}: "
            "deggs.numerics.backend.gpu_present() is false)",
            pytrace=False,
        )
