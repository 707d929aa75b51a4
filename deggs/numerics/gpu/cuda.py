"""CuPy, the device, cuBLAS and the kernel launcher: everything of the GPU backend that
talks to CUDA but is no part of the model (forward.py, update.py, generate.py are).

CuPy is optional: where it does not import, or imports but sees no device,
`gpu_available()` is False and says why in the log (`--backend auto` then runs the CPU
and names the reason).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import launch
from .plan import Device

log = logging.getLogger(__name__)

DeviceArray = Any  # a cupy.ndarray (CuPy ships no type information)

try:  # the backend is usable only where CuPy imports and sees a device
    import cupy as cp

    IMPORT_ERROR = ""
except Exception as e:  # pragma: no cover - depends on the machine
    cp = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

# cudaDeviceAttr values (CUDA runtime API): read by number, as every CuPy has them
ATTR_SHARED_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin
ATTR_SHARED_PER_SM = 81  # cudaDevAttrMaxSharedMemoryPerMultiprocessor
ATTR_RESERVED_PER_BLOCK = 111  # cudaDevAttrReservedSharedMemoryPerBlock
ATTR_SMS = 16  # cudaDevAttrMultiProcessorCount

# cuBLAS / CUDA enum values
CUDA_R_8I, CUDA_R_32I = 3, 10
CUBLAS_COMPUTE_32I = 72
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1


def why_no_gpu() -> str:
    """Why the GPU backend cannot run here ("" where it can): CuPy does not import, or
    it cannot count the devices, or there are none."""
    if cp is None:
        return f"CuPy does not import ({IMPORT_ERROR})"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # a CuPy without its CUDA libraries, a driver mismatch, ...
        return f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
    return "" if count > 0 else "CuPy sees no CUDA device (none present)"


def gpu_available() -> bool:
    """CuPy imports and sees at least one CUDA device; where not, the log says why."""
    reason = why_no_gpu()
    if reason:
        log.info("no GPU: %s", reason)
    return not reason


def device_figures() -> Device:
    """The current device's figures that the kernel plan needs, read from the device."""
    attribute = lambda number: cp.cuda.runtime.deviceGetAttribute(number, cp.cuda.Device().id)
    return Device(
        shared_optin=attribute(ATTR_SHARED_OPTIN),
        shared_per_sm=attribute(ATTR_SHARED_PER_SM),
        reserved_per_block=attribute(ATTR_RESERVED_PER_BLOCK),
        sms=attribute(ATTR_SMS),
        hopper=cp.cuda.Device().compute_capability == "90",
    )


def capture_graph(stream, body: Callable[[], None]):
    """The launches `body` makes on `stream`, captured as a CUDA graph (in the relaxed
    mode where CuPy has it, which does not refuse other calls, such as allocations,
    made meanwhile)."""
    mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", None)
    with stream:
        if mode is None:
            stream.begin_capture()
        else:
            stream.begin_capture(mode=mode)
        try:
            body()
        finally:
            graph = stream.end_capture()
    return graph


def _load_cublas():
    """libcublas through ctypes, as loaded by CuPy (CuPy's own wrapper refuses to run
    while a stream is being captured, and the update is captured as a CUDA graph)."""
    cp.cuda.device.get_cublas_handle()  # makes CuPy load the library
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            name = line.split()[-1]
            if "libcublas.so" in name and name not in paths:
                paths.append(name)
    paths.append(ctypes.util.find_library("cublas") or "libcublas.so")
    lib = ctypes.CDLL(paths[0])
    c_int, c_void = ctypes.c_int, ctypes.c_void_p
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(c_void)]
    lib.cublasSetStream_v2.argtypes = [c_void, c_void]
    lib.cublasSetWorkspace_v2.argtypes = [c_void, c_void, ctypes.c_size_t]
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
    # ldc, computeType, algo: p a pointer, i an int
    kinds = {"p": c_void, "i": c_int}
    lib.cublasGemmEx.argtypes = [kinds[k] for k in "piiiiippiipiippiiii"]
    return lib


class Cublas:
    """One cuBLAS handle of our own, with a fixed workspace (capturable), and one more
    for each stream whose GEMMs run beside the others' (`own_workspace`)."""

    WORKSPACE = 32 << 20

    def __init__(self) -> None:
        self.lib = _load_cublas()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cp.empty(self.WORKSPACE, cp.uint8)
        self.workspaces: dict[int, Any] = {}  # stream pointer -> a workspace of its own
        self.one = np.ones(1, np.int32)
        self.zero = np.zeros(1, np.int32)
        self.stream = None

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def own_workspace(self, stream) -> None:
        """A workspace for `stream` alone: its GEMMs may run while another stream's do."""
        self.workspaces[stream.ptr] = cp.empty(self.WORKSPACE, cp.uint8)

    def gemm_tn_i8(self, a, b, c, m, n, k, lda, ldb, ldc):
        """C (m x n, col-major, int32) = A^T B, A (k x m) and B (k x n) int8, col-major."""
        stream = cp.cuda.get_current_stream().ptr
        if stream != self.stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
            workspace = self.workspaces.get(stream, self.workspace)
            self._check(
                self.lib.cublasSetWorkspace_v2(self.handle, workspace.data.ptr, self.WORKSPACE),
                "cublasSetWorkspace",
            )
            self.stream = stream
        self._check(
            self.lib.cublasGemmEx(
                self.handle,
                OP_T,
                OP_N,
                m,
                n,
                k,
                self.one.ctypes.data,
                a,
                CUDA_R_8I,
                lda,
                b,
                CUDA_R_8I,
                ldb,
                self.zero.ctypes.data,
                c,
                CUDA_R_32I,
                ldc,
                CUBLAS_COMPUTE_32I,
                GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )


class Launcher:
    """The compiled kernels by name, launched with keyword arguments (launch.py checks
    them against the CUDA signatures), each with its dynamic shared memory from the plan
    unless a launch says otherwise; and the int8 GEMMs on cuBLAS. `start_profile()`
    times every launch after it with CUDA events, `profile_report()` sums them."""

    def __init__(self, kernels: dict[str, launch.Kernel], shared: dict[str, int]):
        self.kernels, self.shared = kernels, shared
        self.blas = Cublas()
        self.profile: dict[str, list] | None = None

    def __call__(self, name: str, grid, block, shared_mem: int | None = None, **args) -> None:
        """Launch a kernel by name (deggs/numerics/launch.py)."""
        if shared_mem is None:  # the kernel's dynamic shared memory at the training shapes
            shared_mem = self.shared.get(name, 0)
        kernel = self.kernels[name]
        if self.profile is not None:
            return self._timed(name, lambda: kernel(grid, block, shared_mem, **args))
        kernel(grid, block, shared_mem, **args)

    def gemm(self, a, b, c, m, n, k, lda, ldb, ldc) -> None:
        """C[n, ldc] (int32, row-major) = B[n, k] @ A[m, k]^T: cuBLAS TN, int8 in, int32 out."""
        run = lambda: self.blas.gemm_tn_i8(
            a.data.ptr, b.data.ptr, c.data.ptr, m, n, k, lda, ldb, ldc
        )
        if self.profile is not None:
            return self._timed(f"gemm {m}x{k}", run)
        run()

    def project(self, wt, x, out, n_out: int, rows: int, k: int) -> None:
        """out[rows, n_out] = x[rows, k] @ W, with Wt [n_out, k]."""
        self.gemm(wt, x, out, n_out, rows, k, k, k, n_out)

    def _timed(self, name: str, fn: Callable[[], None]) -> None:
        """Run fn between two events; profile[name] collects the pairs."""
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        assert self.profile is not None
        self.profile.setdefault(name, []).append((start, end))

    def start_profile(self) -> None:
        """Time each launch from now on (not while a graph is captured: replay it eagerly)."""
        self.profile = {}

    def profile_report(self, stream) -> dict[str, float]:
        """Milliseconds per kernel name since start_profile, which this ends."""
        if self.profile is None:
            raise RuntimeError("profile_report without start_profile")
        cp.cuda.get_current_stream().synchronize()
        stream.synchronize()
        report = {
            k: round(sum(cp.cuda.get_elapsed_time(a, b) for a, b in v), 3)
            for k, v in sorted(self.profile.items())
        }
        self.profile = None
        return report
