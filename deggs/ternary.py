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
_UNPACK = ((np.arange(256)[:, None] // _PLACE) % 3).astype(np.int32)
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


def check_packed(data: bytes, count: int) -> None:
    """ValueError unless `data` is `count` packed values as pack_trits writes them: the
    right size, no byte above 242, no trits past `count` in a partial last byte."""
    if len(data) != packed_size(count):
        raise ValueError(f"{count} values need {packed_size(count)} bytes, got {len(data)}")
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size and raw.max() > MAX_PACKED_BYTE:  # (numpy: 30 times Python's max)
        where = int(np.argmax(raw > MAX_PACKED_BYTE))
        raise ValueError(f"byte {where} is {raw[where]}, above {MAX_PACKED_BYTE} (not five trits)")
    rest = count % TRITS_PER_BYTE
    if rest and data[-1] >= 3**rest:
        raise ValueError(f"the last byte holds trits beyond the {count} values")


def unpack_trits(data, count: int) -> np.ndarray:
    """Unpack `count` values from `data` (bytes-like) into an int32 array of -1/0/1;
    ValueError for bytes that check_packed refuses."""
    data = bytes(data)
    check_packed(data, count)
    return unpack_blocks(data, 1, count)


def unpack_blocks(data: bytes, blocks: int, count: int) -> np.ndarray:
    """Unpack `blocks` packed runs of `count` values each, laid end to end (the chunks of
    a population, each packed on its own), through the byte -> five values table. The
    data must already have passed check_packed, run by run."""
    raw = np.frombuffer(data, dtype=np.uint8).reshape(blocks, packed_size(count))
    # np.take: four times a fancy index's speed (a worker's update waits for this)
    values = np.take(_UNPACK, raw, axis=0).reshape(blocks, -1)
    return values[:, :count].reshape(-1)
