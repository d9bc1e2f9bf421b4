from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.core.buffers import as_u8


def test_byte_views_share_memory_with_the_caller() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = as_u8(array)
    assert view.shape == (24,) and view.dtype == np.uint8
    view[:4] = 0
    assert array[0, 0] == 0 and array[0, 1] == 1

    tensor = torch.ones(4, dtype=torch.bfloat16)
    tensor_view = as_u8(tensor)
    assert tensor_view.size == 8
    tensor_view[:] = 0
    assert not tensor.any()

    assert as_u8(memoryview(b"abc")).tobytes() == b"abc"


@pytest.mark.parametrize(
    "buffer",
    [np.zeros(16, np.uint8)[::2], np.zeros((4, 4), np.float32)[:, 1], torch.zeros(4, 4).t()],
    ids=["strided bytes", "strided floats", "transposed tensor"],
)
def test_non_contiguous_buffers_are_refused(buffer: object) -> None:
    with pytest.raises(TypeError, match="not contiguous"):
        as_u8(buffer)
