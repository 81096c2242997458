"""Continuous-batching KV cache: one fixed slot per sequence."""

from .manager import ContinuousBatchingKVCacheManager

__all__ = ["ContinuousBatchingKVCacheManager"]
