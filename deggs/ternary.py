"""Ternary packing: fitness values in {-1, 0, 1}, five to a byte, as sent on the wire.

Each value becomes a trit (v + 3) % 3, so -1 -> 2. Five trits make one byte in base 3
with the first value least significant: t0 + 3 t1 + 9 t2 + 27 t3 + 81 t4 <= 242. A
count that is not a multiple of five ends with one partial byte holding the rest.
"""

from __future__ import annotations

import numpy as np

TRITS_PER_BYTE = 5
MAX_PACKED_BYTE = 242  # 2 * (1 + 3 + 9 + 27 + 81)
_PLACE = np.array([1, 3, 9, 27, 81], dtype=np.int32)
# Every byte's five values, least significant first; rows above 242 are never read.
_UNPACK = ((np.arange(256)[:, None] // _PLACE) % 3).astype(np.int8)
_UNPACK[_UNPACK == 2] = -1


def packed_size(count: int) -> int:
    """Bytes that `count` packed values take."""
    return (count + TRITS_PER_BYTE - 1) // TRITS_PER_BYTE


def pack_trits(values) -> bytes:
    """Pack a sequence of -1/0/1 values into bytes (see the module docstring)."""
    v = np.asarray(values).reshape(-1)
    if v.size and not np.isin(v, (-1, 0, 1)).all():
        bad = v[~np.isin(v, (-1, 0, 1))][0]
        raise ValueError(f"pack_trits: values must be -1, 0 or 1, found {bad!r}")
    trits = np.zeros(packed_size(v.size) * TRITS_PER_BYTE, dtype=np.int32)
    trits[: v.size] = (v.astype(np.int32) + 3) % 3
    # Zero padding adds nothing to the last byte, which matches a partial byte.
    return (trits.reshape(-1, TRITS_PER_BYTE) @ _PLACE).astype(np.uint8).tobytes()


def unpack_trits(data, count: int) -> np.ndarray:
    """Unpack `count` values from `data` (bytes-like) into an int32 array of -1/0/1.

    ValueError for data of the wrong size, a byte above 242 or a partial last byte that
    carries values beyond `count`: bytes a correct packer never writes.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != packed_size(count):
        raise ValueError(f"unpack_trits: {count} values need {packed_size(count)} bytes, "
                         f"got {raw.size}")
    if raw.size and raw.max() > MAX_PACKED_BYTE:
        where = int(np.argmax(raw > MAX_PACKED_BYTE))
        raise ValueError(f"unpack_trits: byte {where} is {raw[where]}, above {MAX_PACKED_BYTE} "
                         "(not five trits)")
    values = _UNPACK[raw].reshape(-1)
    if values[count:].any():
        raise ValueError(f"unpack_trits: the last byte holds trits beyond the {count} values")
    return values[:count].astype(np.int32)
