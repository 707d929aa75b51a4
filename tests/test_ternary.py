import numpy as np
import pytest

from deggs.ternary import pack_trits, packed_size, unpack_trits


def test_packed_size():
    assert [packed_size(n) for n in (0, 1, 4, 5, 6, 10, 11)] == [0, 1, 1, 1, 2, 2, 3]


def test_round_trip_every_length():
    rng = np.random.default_rng(0)
    for n in range(1001):
        values = rng.integers(-1, 2, size=n).astype(np.int32)
        data = pack_trits(values)
        assert len(data) == packed_size(n)
        out = unpack_trits(data, n)
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, values)


@pytest.mark.parametrize(
    "values, expected",
    [
        ([], b""),
        ([0, 0, 0, 0, 0], b"\x00"),
        ([1, 0, 0, 0, 0], b"\x01"),
        ([-1, 0, 0, 0, 0], b"\x02"),
        ([0, 1, 0, 0, 0], b"\x03"),
        ([0, 0, 0, 0, 1], bytes([81])),
        ([-1, -1, -1, -1, -1], bytes([242])),
        ([1, -1, 0, 1, -1], bytes([1 + 2 * 3 + 0 * 9 + 1 * 27 + 2 * 81])),
        # A partial last byte holds the remainder, first value least significant.
        ([1, 1, 1, 1, 1, -1, 1], bytes([121, 2 + 1 * 3])),
        ([-1], b"\x02"),
    ],
)
def test_hand_checked_bytes(values, expected):
    assert pack_trits(values) == expected
    assert unpack_trits(expected, len(values)).tolist() == values


def test_pack_rejects_values_outside_trits():
    with pytest.raises(ValueError, match="-1, 0 or 1.*2"):
        pack_trits([0, 1, 2])
    with pytest.raises(ValueError):
        pack_trits([-2])


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="need 2 bytes, got 1"):
        unpack_trits(b"\x00", 6)
    with pytest.raises(ValueError, match="need 1 bytes, got 2"):
        unpack_trits(b"\x00\x00", 5)


def test_unpack_rejects_bytes_above_242():
    with pytest.raises(ValueError, match="byte 1 is 243"):
        unpack_trits(bytes([0, 243]), 10)


def test_unpack_rejects_trits_beyond_count():
    with pytest.raises(ValueError, match="beyond"):
        unpack_trits(bytes([9]), 2)  # the third trit is set but only two values exist


@pytest.mark.parametrize("name", ["tiny_bytes", "tiny_tok", "tiny_variant", "default"])
def test_packed_chunk0_matches_golden(name, golden_path):
    with np.load(golden_path(name)) as golden:
        chunk_size = int(golden["config"][5])
        steps = sorted({k.split("/")[0] for k in golden.files if k.endswith("/packed_chunk0")})
        assert steps
        for step in steps:
            fitness = golden[f"{step}/fitness"][: chunk_size // 2]
            packed = golden[f"{step}/packed_chunk0"].tobytes()
            assert pack_trits(fitness) == packed, step
            np.testing.assert_array_equal(unpack_trits(packed, chunk_size // 2), fitness)
