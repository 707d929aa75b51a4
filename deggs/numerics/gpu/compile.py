"""Compiling the kernels: the sources (the repository's kernels/ folder, installed as the
package data of deggs.kernels), one program a plan's program, and the compiled sm_90a
program kept between starts.

Each .cu file includes the headers it uses and compiles alone with nvcc (kernels/README.md).
A program is its files with every `#include "..."` replaced by the header's text, once
(as `#pragma once` does): one self-contained text, so that CuPy's kernel cache and ours
key on every line that was compiled, and the launchers read every signature from it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from ...files import file_mode
from .. import launch
from .plan import PROGRAMS

log = logging.getLogger(__name__)

KERNEL_PACKAGE = "deggs.kernels"
INCLUDE = re.compile(r'^#include "([^"]+)"\s*(//.*)?$')  # a comment may follow
OPTIONS = ("--std=c++17", "--fmad=false")  # every float rounds where the CPU's does


def kernel_folder() -> Traversable:
    """The CUDA sources of this copy of deggs: in a source checkout the kernels/ folder
    beside its deggs/ (so that a script run from one checkout never compiles another's,
    whatever the environment installed), else the installed package data."""
    checkout = Path(__file__).resolve().parents[3] / "kernels"
    if (checkout / "common.cuh").is_file():
        return checkout
    return resources.files(KERNEL_PACKAGE)


def read_kernel_file(name: str) -> str:
    """A kernel source file of this copy of deggs."""
    return kernel_folder().joinpath(name).read_text()


def kernel_files() -> list[str]:
    """Every CUDA source file (*.cu and *.cuh)."""
    return sorted(p.name for p in kernel_folder().iterdir() if p.name.endswith((".cu", ".cuh")))


def source(files: Iterable[str], read: Callable[[str], str] = read_kernel_file) -> str:
    """The files as one program: each `#include "header"` replaced by the header (itself
    expanded) the first time, dropped after; `#pragma once` lines dropped."""
    seen: set[str] = set()

    def expand(name: str) -> list[str]:
        if name in seen:
            return []
        seen.add(name)
        lines = []
        for line in read(name).splitlines():
            match = INCLUDE.match(line)
            if match:
                lines += expand(match.group(1))
            elif line.strip() != "#pragma once":
                lines.append(line)
        return lines

    return "\n".join(line for name in files for line in expand(name)) + "\n"


def program_source(program: str) -> str:
    """The source of one of plan.PROGRAMS ("main", "sm90a")."""
    return source(PROGRAMS[program])


def compile_options(defines: Mapping[str, int]) -> tuple[str, ...]:
    return OPTIONS + tuple(f"-D{k}={v}" for k, v in defines.items())


def compile_main(defines: Mapping[str, int]) -> dict[str, launch.Kernel]:
    """The main program for the current device (CuPy's RawModule and its cache)."""
    import cupy as cp

    code = program_source("main")
    module = cp.RawModule(code=code, options=compile_options(defines))
    return launch.kernels(module, code)


def compile_sm90a(defines: Mapping[str, int]) -> dict[str, launch.Kernel]:
    """The typed launchers of the sm90a program, compiled by NVRTC for sm_90a (CuPy's
    RawModule always names plain sm_90, which has no wgmma) with the options RawModule
    gives the main program; kept in CuPy's kernel cache folder, as CuPy keeps the main
    program, so that only the first start compiles it."""
    import cupy as cp
    from cupy_backends.cuda.libs import nvrtc

    code = program_source("sm90a")
    options = [
        *compile_options(defines),
        "-ftz=true",
        "--device-as-default-execution-space",
        "-arch=sm_90a",
    ]

    def compile_program() -> bytes:
        program = nvrtc.createProgram(code, "deggs_sm90a.cu", [], [])
        try:
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"{e}: {nvrtc.getProgramLog(program)}") from e
            return nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)

    key = "\n".join([code, *options, f"nvrtc {nvrtc.getVersion()}"])
    cubin = cached_cubin(kernel_cache_folder(), key, compile_program)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "deggs_sm90a.cubin"
        path.write_bytes(cubin)
        # get_function loads the file, so the launchers outlive the folder
        return launch.kernels(cp.RawModule(path=str(path)), code)


def kernel_cache_folder() -> Path:
    """CuPy's kernel cache folder, as its documentation names it: $CUPY_CACHE_DIR, else
    ~/.cupy/kernel_cache."""
    folder = os.environ.get("CUPY_CACHE_DIR")
    return Path(folder) if folder else Path.home() / ".cupy" / "kernel_cache"


CUBIN_MAGIC = b"deggs cubin 1\n"  # then the payload's SHA-256, then the payload


def cached_cubin(folder: Path, key: str, compile_program: Callable[[], bytes]) -> bytes:
    """The compiled program for `key` from `folder` (a file named by the key's SHA-256),
    else compile_program()'s, stored there for the next start. A cached file that is
    not whole (a start killed while writing, a bad disk) is compiled again; a folder
    that cannot be written only costs the next start a compile."""
    path = folder / f"deggs-{hashlib.sha256(key.encode()).hexdigest()}.cubin"
    try:
        data = path.read_bytes()
        digest, payload = (
            data[len(CUBIN_MAGIC) : len(CUBIN_MAGIC) + 32],
            data[len(CUBIN_MAGIC) + 32 :],
        )
        if data.startswith(CUBIN_MAGIC) and hashlib.sha256(payload).digest() == digest:
            return payload
    except OSError:
        pass
    payload = compile_program()
    part = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=path.name, delete=False) as f:
            part = Path(f.name)
            os.fchmod(f.fileno(), file_mode())  # as any new file: NamedTemporaryFile's is 0600
            f.write(CUBIN_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(part, path)  # whole or not there, for the starts beside this one
    except OSError as e:
        if part is not None:
            part.unlink(missing_ok=True)
        log.warning("could not keep the compiled sm_90a program in %s: %s", folder, e)
    return payload


def static_shared(kernels: Mapping[str, launch.Kernel]) -> dict[str, int]:
    """Each compiled kernel's static shared memory (its `__shared__` arrays), as the
    compiled function reports it (cudaFuncGetAttributes' sharedSizeBytes)."""
    return {name: int(k.function.shared_size_bytes) for name, k in kernels.items()}
