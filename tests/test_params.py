"""KVCacheParams: derived sizes (checked against MAX's own MHAKVCacheParams) and validation."""

from __future__ import annotations

import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheQuantizationConfig, MHAKVCacheParams

from mokv import KVCacheParams, KVCacheQuantConfig, KVCacheStrategy, from_max

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


# ------------------------------------------------------------------ quantized caches

FP8, INT8 = DType.float8_e4m3fn, DType.int8


def quantized(dtype: DType = FP8, **config: object) -> KVCacheParams:
    """A quantized cache: 2 KV heads of 64 over 3 layers, pages of 16 tokens."""
    return KVCacheParams(
        dtype,
        n_kv_heads=2,
        head_dim=64,
        num_layers=3,
        page_size=16,
        kvcache_quant_config=KVCacheQuantConfig(**config),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_quantized_sizes_are_hand_counted(dtype: DType) -> None:
    """Defaults: one float32 scale per token and KV head, for K and V of every layer."""
    p = quantized(dtype)
    assert p.quantized and p.scale_block_shape == (1, 64)
    assert p.block_shape(5) == [5, 2, 3, 16, 2, 64]
    assert p.scales_shape(5) == [5, 2, 3, 16, 2, 1]
    values, scales = 2 * 3 * 2 * 64 * 1, 2 * 3 * 2 * 1 * 4  # one token, all layers, one device
    assert p.bytes_per_token == values + scales == 816
    assert p.bytes_per_page == 16 * 816
    assert not KVCacheParams(DType.bfloat16, 2, 64, 3).quantized


def test_blocks_of_tokens_and_head_dim_share_a_scale() -> None:
    p = quantized(quantization_granularity=16, tokens_per_scale=4)
    assert p.scale_block_shape == (4, 16)
    assert p.scales_shape(7) == [7, 2, 3, 16 // 4, 2, 64 // 16]
    assert p.scales_shape(2, tokens_per_page=32) == [2, 2, 3, 8, 2, 4]  # a continuous slot of 32 tokens
    scale_row = 2 * 3 * 2 * 4 * 4  # the scales of 4 tokens
    assert p.bytes_per_page == 16 * 768 + 4 * scale_row
    assert p.bytes_per_token == 768 + scale_row / 4
    assert p.bytes_for_tokens(32) == 32 * 768 + 8 * scale_row
    with pytest.raises(ValueError, match="tokens_per_scale=4 must divide the 30 tokens of a page"):
        p.scales_shape(1, tokens_per_page=30)


def test_an_unquantized_cache_has_no_scales() -> None:
    p = KVCacheParams(DType.float32, 2, 64, 3)
    with pytest.raises(ValueError, match="a dtype=float32 cache is not quantized: it has no kvcache_quant_config"):
        p.scales_shape(1)
    assert p.bytes_per_page == p.page_size * p.bytes_per_token == 128 * 2 * 3 * 2 * 64 * 4


@pytest.mark.parametrize(
    ("dtype", "config", "message"),
    [
        (FP8, None, "dtype=float8_e4m3fn stores quantized values and needs a kvcache_quant_config"),
        (INT8, None, "dtype=int8 stores quantized values and needs a kvcache_quant_config"),
        (
            DType.float32,
            {},
            "kvcache_quant_config is set, so dtype .* must be float8_e4m3fn or int8, got dtype=float32",
        ),
        (DType.bfloat16, {}, "kvcache_quant_config is set, so dtype .* got dtype=bfloat16"),
        (
            FP8,
            {"quantization_granularity": 48},
            "kvcache_quant_config.quantization_granularity=48 must divide head_dim=64",
        ),
        (FP8, {"tokens_per_scale": 3}, "kvcache_quant_config.tokens_per_scale=3 must divide page_size=16"),
        (FP8, {"scale_dtype": DType.bfloat16}, "scale_dtype must be one of float32, got bfloat16"),
        (FP8, {"quantization_granularity": 0}, "quantization_granularity must be >= 1, got 0"),
        (FP8, {"tokens_per_scale": 0}, "tokens_per_scale must be >= 1, got 0"),
    ],
)
def test_invalid_quantization_is_refused_by_name(dtype: DType, config: dict | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheParams(
            dtype,
            n_kv_heads=2,
            head_dim=64,
            num_layers=3,
            page_size=16,
            kvcache_quant_config=None if config is None else KVCacheQuantConfig(**config),
        )


def test_quant_config_types_are_checked() -> None:
    with pytest.raises(TypeError, match="kvcache_quant_config must be a mokv KVCacheQuantConfig or None"):
        KVCacheParams(FP8, 2, 64, 3, kvcache_quant_config={"scale_dtype": DType.float32})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"scale_dtype must be a max\.dtype\.DType"):
        KVCacheQuantConfig(scale_dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tokens_per_scale must be an integer, got 2\.0"):
        KVCacheQuantConfig(tokens_per_scale=2.0)  # type: ignore[arg-type]


def test_rotated_keys_need_a_power_of_two_head_dim() -> None:
    rotated = KVCacheQuantConfig(rotate_keys=True)
    assert KVCacheParams(INT8, 2, 64, 3, kvcache_quant_config=rotated).kvcache_quant_config.rotate_keys
    with pytest.raises(ValueError, match="rotate_keys needs head_dim to be a power of two, got head_dim=80"):
        KVCacheParams(INT8, 2, 80, 3, kvcache_quant_config=rotated)
    with pytest.raises(TypeError, match="rotate_keys must be a bool, got 'yes'"):
        KVCacheQuantConfig(rotate_keys="yes")  # type: ignore[arg-type]


def test_a_continuous_cache_leaves_tokens_per_scale_to_its_slot_length() -> None:
    """page_size means nothing to a continuous cache: its manager checks max_seq_len instead."""
    p = KVCacheParams(
        INT8,
        2,
        64,
        3,
        page_size=16,
        cache_strategy=KVCacheStrategy.CONTINUOUS,
        kvcache_quant_config=KVCacheQuantConfig(tokens_per_scale=3),
    )
    assert p.scale_block_shape == (3, 64)


def max_quantized(dtype: DType = FP8, **config: object) -> MHAKVCacheParams:
    return MHAKVCacheParams(
        dtype=dtype,
        n_kv_heads=2,
        head_dim=64,
        num_layers=3,
        page_size=16,
        devices=[CPU],
        kvcache_quant_config=KVCacheQuantizationConfig(**config),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("granularity", [64, 32])
def test_from_max_converts_a_quantized_cache(granularity: int) -> None:
    theirs = max_quantized(quantization_granularity=granularity)
    assert theirs.quantized_kv_cache
    ours = from_max(theirs)
    assert ours.dtype == FP8
    assert ours.kvcache_quant_config == KVCacheQuantConfig(DType.float32, granularity, tokens_per_scale=1)
    assert ours.scales_shape(4) == [4, *theirs.shape_per_scale_block]
    assert ours.bytes_per_page == theirs.bytes_per_block  # both count the scales


def test_from_max_refuses_quantization_mokv_lacks() -> None:
    with pytest.raises(ValueError, match=r"MAX's kvcache_quant_config=.* scale_dtype must be one of float32"):
        from_max(max_quantized(scale_dtype=DType.float8_e8m0fnu, quantization_granularity=64))
    with pytest.raises(ValueError, match=r"kvcache_quant_config=.* is not supported on dtype=bfloat16"):
        from_max(max_quantized(DType.bfloat16, quantization_granularity=64))  # MAX would ignore the config
    with pytest.raises(
        ValueError, match=r"is not supported on dtype=float8_e4m3fnuz: mokv quantizes float8_e4m3fn and int8"
    ):
        from_max(max_quantized(DType.float8_e4m3fnuz, quantization_granularity=64))
