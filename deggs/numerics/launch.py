"""Typed kernel launchers: every kernel is called with keyword arguments, checked against
its CUDA signature.

The signatures are read from the kernel sources themselves, so there is no second table
to keep in step by hand. A missing or unknown argument, an array of the wrong dtype or a
non-contiguous one, or a scalar out of its C type's range fails in Python, naming the
kernel and the argument, instead of reading the wrong memory on the device. None passes
a null pointer (the kernels that take one say so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# C types of the kernels' parameters -> NumPy dtypes (pointees and scalars).
C_TYPES = {
    "i8": np.int8,
    "short": np.int16,
    "int": np.int32,
    "u32": np.uint32,
    "u64": np.uint64,
    "float": np.float32,
}
SIGNATURE = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(([^)]*)\)'
)
PARAMETER = re.compile(r"^(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)$")
NULL = np.uint64(0)


@dataclass(frozen=True)
class Param:
    name: str
    dtype: type  # of the pointee for a pointer
    pointer: bool


def signatures(source: str) -> dict[str, tuple[Param, ...]]:
    """Every `extern "C" __global__` kernel of a CUDA source with its parameters."""
    kernels = {}
    for name, params in SIGNATURE.findall(source):
        parsed = []
        for text in params.split(","):
            match = PARAMETER.match(" ".join(text.split()))
            if match is None or match.group(1) not in C_TYPES:
                raise ValueError(f"kernel {name}: cannot read parameter {text.strip()!r}")
            ctype, star, arg = match.groups()
            parsed.append(Param(arg, C_TYPES[ctype], bool(star)))
        kernels[name] = tuple(parsed)
    return kernels


def _convert(kernel: str, p: Param, value):
    where = f"{kernel}({p.name})"
    if p.pointer:
        if value is None:
            return NULL
        dtype = getattr(value, "dtype", None)
        if dtype != p.dtype:
            raise TypeError(f"{where}: an array of {np.dtype(p.dtype)} expected, not {dtype}")
        if not value.flags.c_contiguous:
            raise ValueError(f"{where}: the array must be contiguous")
        return value
    info = np.finfo(p.dtype) if p.dtype is np.float32 else np.iinfo(p.dtype)
    if not isinstance(value, (int, float, np.integer, np.floating)) or not (
        info.min <= value <= info.max
    ):
        raise ValueError(f"{where}: {value!r} is not a {np.dtype(p.dtype)}")
    return p.dtype(value)


class Kernel:
    """One compiled kernel: kernel(grid, block, shared_mem=0, **arguments)."""

    def __init__(self, name: str, params: tuple[Param, ...], function):
        self.name, self.params, self.function = name, params, function

    def arguments(self, args: dict) -> tuple:
        names = [p.name for p in self.params]
        missing = [n for n in names if n not in args]
        unknown = [n for n in args if n not in names]
        if missing or unknown:
            raise TypeError(f"kernel {self.name}: missing {missing}, unknown {unknown}")
        return tuple(_convert(self.name, p, args[p.name]) for p in self.params)

    def __call__(self, grid, block, shared_mem: int = 0, **args):
        self.function(grid, block, self.arguments(args), shared_mem=shared_mem)


def kernels(module, source: str) -> dict[str, Kernel]:
    """A typed launcher for every kernel of a compiled module (cupy.RawModule)."""
    return {
        name: Kernel(name, params, module.get_function(name))
        for name, params in signatures(source).items()
    }
