"""bfloat16 in numpy, which has no such dtype: values travel as their raw 16 bits
(`np.uint16`), the upper half of the float32 with the same sign and exponent."""

from __future__ import annotations

import numpy as np


def to_bits(values: np.ndarray) -> np.ndarray:
    """Rounds float32 `values` to bfloat16 (to nearest, ties to even) and
    returns the bits as `np.uint16`."""
    wide = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((wide >> np.uint32(16)) & np.uint32(1))
    return ((wide + rounding) >> np.uint32(16)).astype(np.uint16)


def from_bits(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 `bits` (exact: bfloat16 is a truncated float32)."""
    return (np.ascontiguousarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
