"""Byte views over caller buffers (numpy arrays, torch CPU tensors, memoryviews) without copying."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_u8(buf: Any) -> np.ndarray:
    """A flat uint8 numpy view of `buf` sharing its memory. Raises TypeError for non-contiguous input."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise TypeError(f"buffer of shape {buf.shape} is not contiguous")
        if buf.dtype == np.uint8 and buf.ndim == 1:
            return buf  # the common case on the hot path: already a flat byte view
        return buf.reshape(-1).view(np.uint8)
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu":
            raise TypeError(f"buffer on {buf.device} is not host memory; stage it first")
        if not buf.is_contiguous():
            raise TypeError(f"tensor of shape {tuple(buf.shape)} is not contiguous")
        import torch

        return buf.reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(buf, dtype=np.uint8)

