"""KVCacheParams: derived sizes (checked against MAX's own MHAKVCacheParams) and validation."""

from __future__ import annotations

import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import MHAKVCacheParams

from mokv import KVCacheParams, KVCacheStrategy

CPU = DeviceRef.CPU()


def test_sizes_match_max() -> None:
    ours = KVCacheParams(DType.bfloat16, n_kv_heads=8, head_dim=64, num_layers=3, page_size=16, devices=[CPU, CPU])
    theirs = MHAKVCacheParams(
        dtype=DType.bfloat16,
        n_kv_heads=8,
        head_dim=64,
        num_layers=3,
        page_size=16,
        devices=[CPU, CPU],
    )
    assert ours.n_kv_heads_per_device == theirs.n_kv_heads_per_device == 4
    assert ours.block_shape(7) == [7, *theirs.shape_per_block]
    assert ours.bytes_per_page * ours.tensor_parallel_degree == theirs.bytes_per_block
    assert ours.bytes_per_token == 2 * 3 * 4 * 64 * 2


def test_defaults_and_replica_grouping() -> None:
    p = KVCacheParams(DType.float32, 4, 8, 2)
    assert (p.page_size, p.cache_strategy, p.enable_prefix_caching) == (
        128,
        KVCacheStrategy.PAGED,
        False,
    )
    assert p.devices == (CPU,) and p.num_host_pages == 0
    four = [DeviceRef.CPU(i) for i in range(4)]
    dp = KVCacheParams(DType.float32, 4, 8, 2, data_parallel_degree=2, devices=four)
    assert dp.devices_per_replica == [tuple(four[:2]), tuple(four[2:])]
    assert dp.tensor_parallel_degree == 2 and dp.n_kv_heads_per_device == 2
    assert (
        KVCacheParams(DType.float32, 4, 8, 2, cache_strategy="continuous").cache_strategy is KVCacheStrategy.CONTINUOUS
    )


def test_host_pages_from_swap_space() -> None:
    p = KVCacheParams(
        DType.float32,
        1,
        128,
        2,
        page_size=128,
        enable_prefix_caching=True,
        enable_kvcache_swapping_to_host=True,
        host_kvcache_swap_space_gb=1.0,
    )
    assert p.bytes_per_page == 128 * 2 * 2 * 128 * 4
    assert p.num_host_pages == (1 << 30) // p.bytes_per_page


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_kv_heads": 0}, "n_kv_heads must be >= 1, got 0"),
        ({"page_size": -4}, "page_size must be >= 1, got -4"),
        (
            {"cache_strategy": "radix"},
            "cache_strategy must be one of paged, continuous, got 'radix'",
        ),
        ({"devices": []}, "devices must name at least one device"),
        (
            {"data_parallel_degree": 2, "devices": [CPU] * 3},
            "3 devices cannot be split into data_parallel_degree=2",
        ),
        (
            {"n_kv_heads": 3, "devices": [CPU, CPU]},
            "n_kv_heads=3 is not divisible by the tensor parallel degree 2",
        ),
        (
            {"cache_strategy": KVCacheStrategy.CONTINUOUS, "enable_prefix_caching": True},
            "prefix caching needs the paged strategy",
        ),
        (
            {"enable_prefix_caching": True, "enable_kvcache_swapping_to_host": True},
            "needs a finite host_kvcache_swap_space_gb > 0, got None",
        ),
        (
            {
                "enable_prefix_caching": True,
                "enable_kvcache_swapping_to_host": True,
                "host_kvcache_swap_space_gb": float("nan"),
            },
            "needs a finite host_kvcache_swap_space_gb > 0, got nan",
        ),
        (
            {"enable_kvcache_swapping_to_host": True, "host_kvcache_swap_space_gb": 1.0},
            "needs enable_prefix_caching=True",
        ),
    ],
)
def test_validation_names_the_bad_value(kwargs: dict, message: str) -> None:
    base = {"dtype": DType.float32, "n_kv_heads": 4, "head_dim": 8, "num_layers": 2}
    with pytest.raises(ValueError, match=message):
        KVCacheParams(**{**base, **kwargs})


def test_dtype_must_be_a_max_dtype() -> None:
    with pytest.raises(TypeError, match=r"dtype must be a max.dtype.DType, got 'float32'"):
        KVCacheParams("float32", 4, 8, 2)  # type: ignore[arg-type]
