"""Numpy model of 8-bit KV storage: what a code means and which code a value gets.

Written from the formats' definitions, independent of the Mojo kernels:

- `float8_e4m3fn`: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
  infinities, and only S.1111.111 is NaN, so the largest magnitude is 448.
  Exponent 0 holds subnormals (mantissa / 8 * 2^-6).
- `int8`: integers -127..127 (-128 unused, so the range is symmetric).

A granule's scale is its largest finite magnitude over the largest code, and
x is stored as the code nearest x / scale (saturating; NaN stores as 0).
"""

from __future__ import annotations

import numpy as np

CODE_MAX = {"float8_e4m3fn": 448.0, "int8": 127.0}


def e4m3_value(codes: np.ndarray) -> np.ndarray:
    """The float64 values of float8_e4m3fn bit patterns (uint8)."""
    codes = np.asarray(codes, np.uint8).astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8 * 2.0**-6
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((codes & 0x7F) == 0x7F, np.nan, value)


_E4M3_MAGNITUDES = e4m3_value(np.arange(0x7F, dtype=np.uint8))  # 0 .. 448, increasing


def nearest_e4m3(x: np.ndarray) -> np.ndarray:
    """The float8_e4m3fn codes nearest to `x` (already within +-448), ties to
    the even mantissa."""
    x = np.asarray(x, np.float64)
    magnitude = np.abs(x)
    upper = np.clip(np.searchsorted(_E4M3_MAGNITUDES, magnitude), 1, len(_E4M3_MAGNITUDES) - 1)
    lower = upper - 1
    below = magnitude - _E4M3_MAGNITUDES[lower]
    above = _E4M3_MAGNITUDES[upper] - magnitude
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = np.where(take_upper, upper, lower).astype(np.uint8)
    return np.where(x < 0, code | 0x80, code).astype(np.uint8)


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    """Code values (before scaling) as float64."""
    if fmt == "float8_e4m3fn":
        return e4m3_value(codes)
    return np.asarray(codes, np.int8).astype(np.float64)


def encode(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """Nearest codes of values already divided by their scale: saturated to
    the code range, NaN as 0. float8 codes come back as their uint8 bits."""
    limit = CODE_MAX[fmt]
    scaled = np.nan_to_num(np.asarray(scaled, np.float64), nan=0.0, posinf=limit, neginf=-limit)
    scaled = np.clip(scaled, -limit, limit)
    if fmt == "float8_e4m3fn":
        return nearest_e4m3(scaled)
    return np.rint(scaled).astype(np.int8)


def granule_scales(x: np.ndarray, granularity: int, fmt: str) -> np.ndarray:
    """Scales of rows `[..., head_dim]` in granules of `granularity` elements:
    `[..., head_dim // granularity]`, the largest finite magnitude over the
    code range."""
    granules = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, granularity)
    finite = np.where(np.isfinite(granules), np.abs(granules), 0.0)
    return finite.max(axis=-1) / CODE_MAX[fmt]


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """Values of codes `[..., head_dim]` under scales `[..., granules]`, float64."""
    granules = scales.shape[-1]
    values = decode(codes, fmt).reshape(*codes.shape[:-1], granules, -1)
    return (values * scales[..., None]).reshape(codes.shape)


def quantize(x: np.ndarray, granularity: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of rows `[..., head_dim]`, one scale per granule."""
    scales = granule_scales(x, granularity, fmt)
    safe = np.where(scales > 0, scales, 1.0)
    granules = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, granularity)
    scaled = np.where(scales[..., None] > 0, granules / safe[..., None], 0.0)
    return encode(scaled, fmt).reshape(x.shape), scales


def code_step(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """The gap between the two codes around each value (in code units): the
    largest rounding error is half of it."""
    if fmt == "int8":
        return np.ones_like(scaled, np.float64)
    magnitude = np.minimum(np.abs(scaled), 448.0)
    exponent = np.maximum(np.floor(np.log2(np.maximum(magnitude, 2.0**-6))), -6)
    return np.exp2(exponent - 3)
