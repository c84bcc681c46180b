"""Values of varying bit widths packed end to end (a profile's stored synthesis matrices)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen_core.codec.bitpack import pack, packed_size, unpack


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 255)), max_size=300))
def test_pack_round_trips_and_takes_the_sum_of_the_widths(pairs):
    widths = np.array([w for w, _ in pairs], dtype=np.uint8)
    values = np.array([v % (1 << w) for w, v in pairs], dtype=np.uint8)
    data = pack(values, widths)
    assert data.dtype == np.uint8 and data.size == packed_size(widths) == (int(widths.sum()) + 7) // 8
    assert np.array_equal(unpack(data, widths), values)


def test_the_layout_is_least_significant_bit_first_end_to_end():
    # 5 in 3 bits (101), 1 in 1 bit, 0b1111 in 4 bits, 2 in 2 bits: bits 1,0,1, 1, 1,1,1,1, 0,1
    data = pack(np.array([5, 1, 15, 2]), np.array([3, 1, 4, 2]))
    assert data.tolist() == [0b11111101, 0b10]
    assert np.array_equal(unpack(data, np.array([[3, 1], [4, 2]])), [[5, 1], [15, 2]])  # the widths' shape


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="below 2 \\*\\* its width"):
        pack(np.array([4]), np.array([2]))
    with pytest.raises(ValueError, match="width in \\[1, 8\\]"):
        pack(np.array([0]), np.array([9]))
    with pytest.raises(ValueError, match="must be 2 bytes"):
        unpack(np.zeros(1, dtype=np.uint8), np.array([8, 8]))
    with pytest.raises(ValueError, match="uint8"):
        unpack(np.zeros(2, dtype=np.int16), np.array([8, 8]))
