"""`mokv.attention` on a GPU: the host checks shapes and heads, plans the
grid from the batch summary (`plan`), and launches a decode or a prefill
kernel (on tensor cores for bfloat16 where the device has them, `mma`), then
the split-K merge when the context was split.

The tensor-core prefill over a bfloat16 cache takes Hopper's warpgroup
products (`..warpgroup`) where the device has them, `mma.sync` per warp
elsewhere and over 8-bit codes; `MOKV_PREFILL_KERNEL=mma` or `=wgmma`
overrides that (`_prefill_products` says why the default is what it is),
`=wgmma_producer` takes the warpgroup prefill whose copies a producer
warpgroup makes (`MmaThread.producer`), and `=wgmma_tma` the one whose
producer warp copies tensor-map boxes (`MmaThread.boxes`), neither the
default: no GPU has timed them. `MOKV_DECODE_KERNEL=warp_heads` takes the
tensor-core decode whose blocks take four KV heads, one a warp
(`MmaThread.warp_heads`), and `=warp_heads_8` the one whose blocks take
eight (Llama's eight KV heads: a block reads its tokens' whole rows), not
the default either, for the same reason.
`MOKV_ATTENTION_SPLITS=N` fixes how many splits a context is cut into
(within the planner's bounds) instead of the planner's choice, for tuning:
`mokv bench attention --device gpu` times decode at several."""

from extensibility import InputTensor, OutputTensor

from ...bind import check_layer, check_scale
from ...cache.batch_summary import BatchSummary
from ...cache.traits import KVCacheT, KVCollectionT
from ...kv_quantization import is_quantized
from std.os import getenv
from ..block import Launcher
from ..tensor_map import PageMaps, PageTensor
from .config import LOG2E, QUANTIZED_CHUNK, WARPS
from .decode import DecodeKernel
from .merge import MergeArgs, MergeKernel
from .plan import BatchBounds, KernelFit, plan_attention
from .prefill import AttentionKernel
from .mma_kernel import MmaKernel
from .work import AttentionArgs


def _prefill_rows(head_dim: Int) -> Int:
    """Query rows of a CUDA-core prefill block: 64, 32 from head_dim 128, 16
    from 256, so that its float32 tiles stay within an AMD workgroup's 64 KB
    of shared memory. The most query heads per KV head the op takes."""
    return 64 if head_dim <= 64 else (32 if head_dim <= 128 else 16)


def _on_tensor_cores[cache_t: KVCacheT, q_dtype: DType, D: Int]() -> Bool:
    """Whether a cache's tiles can go to tensor cores (`mma`): bfloat16
    queries over bfloat16 values or 8-bit codes, head_dim up to 128."""
    return (
        (cache_t.dtype == DType.bfloat16 or is_quantized[cache_t.dtype]())
        and q_dtype == DType.bfloat16
        and D <= 128
    )


comptime PREFILL_KERNEL_VARIABLE = "MOKV_PREFILL_KERNEL"


# The products of the tensor-core prefill (`_prefill_products`).
comptime WARP_PRODUCTS = 0
comptime WARPGROUP_PRODUCTS = 1
comptime PRODUCER_FED_PRODUCTS = 2
"""Warpgroup products whose tiles a producer warpgroup copies."""
comptime BOX_FED_PRODUCTS = 3
"""Warpgroup products whose tiles a producer warp copies as tensor-map
boxes (TMA)."""


def _prefill_products[L: Launcher](launcher: L, codes: Bool) raises -> Int:
    """Which products the tensor-core prefill takes: what
    `MOKV_PREFILL_KERNEL` says (`mma`; `wgmma`, `wgmma_producer` or
    `wgmma_tma`, which need a device with warpgroup products, and the last
    two a bfloat16 cache); unset, warpgroup products on Hopper unless the cache holds
    8-bit `codes`.

    Over bfloat16 an H200 ran the warpgroup prefill 1.2x `mma.sync`'s speed
    with the same outputs (docs/gpu-runs.md, the ninth run); no run has timed
    the prefill over codes, where `mma.sync` multiplies a row-scaled code
    as it is in float16 and the warpgroup widens it to bfloat16 first."""
    var kernel = getenv(PREFILL_KERNEL_VARIABLE, "")
    if kernel == "":
        return WARPGROUP_PRODUCTS if launcher.warpgroup_mma() and not codes else WARP_PRODUCTS
    if kernel == "mma":
        return WARP_PRODUCTS
    if kernel != "wgmma" and kernel != "wgmma_producer" and kernel != "wgmma_tma":
        raise Error(
            t"{PREFILL_KERNEL_VARIABLE}={kernel}: expected mma, wgmma, wgmma_producer or wgmma_tma"
        )
    if not launcher.warpgroup_mma():
        raise Error(
            t"{PREFILL_KERNEL_VARIABLE}={kernel}: this device has no warpgroup MMA"
            t" (NVIDIA Hopper, sm_90, only)"
        )
    if kernel == "wgmma":
        return WARPGROUP_PRODUCTS
    if codes:
        raise Error(
            t"{PREFILL_KERNEL_VARIABLE}={kernel}: its producer warpgroup copies bfloat16 rows,"
            t" and this cache holds 8-bit codes"
        )
    return PRODUCER_FED_PRODUCTS if kernel == "wgmma_producer" else BOX_FED_PRODUCTS


comptime DECODE_KERNEL_VARIABLE = "MOKV_DECODE_KERNEL"


def _decode_block_heads(n_kv_heads: Int) raises -> Int:
    """KV heads a tensor-core decode block takes: 1 (unset: one head a block,
    its warps splitting the keys), or one head a warp, `WARPS` of them
    (`MOKV_DECODE_KERNEL=warp_heads`) or twice that (`=warp_heads_8`), which
    needs the cache's KV heads in whole blocks of them."""
    var kernel = getenv(DECODE_KERNEL_VARIABLE, "")
    if kernel == "":
        return 1
    var heads: Int
    if kernel == "warp_heads":
        heads = WARPS
    elif kernel == "warp_heads_8":
        heads = 2 * WARPS
    else:
        raise Error(
            t"{DECODE_KERNEL_VARIABLE}={kernel}: expected warp_heads, warp_heads_8, or unset"
        )
    if n_kv_heads % heads != 0:
        raise Error(
            t"{DECODE_KERNEL_VARIABLE}={kernel}: the cache's {n_kv_heads} KV heads are not"
            t" blocks of {heads}"
        )
    return heads


def _decode_fit[
    cache_t: KVCacheT, D: Int, lanes: Int, scales_per_key: Bool
](block_heads: Int) -> KernelFit:
    """The planner's fit of the tensor-core decode `_launch_mma` launches for
    a block of `block_heads` KV heads, with float16 products of an 8-bit
    cache's codes where `scales_per_key`: its own blocks per multiprocessor,
    which differ between the two (float8 at head_dim 128: three blocks with
    float16 products, two widening in shared memory)."""
    comptime One = MmaKernel[cache_t, D, lanes, True, scales_per_key=scales_per_key]
    comptime Four = MmaKernel[
        cache_t, D, lanes, True, scales_per_key=scales_per_key, warp_heads=True
    ]
    comptime Eight = MmaKernel[
        cache_t,
        D,
        lanes,
        True,
        scales_per_key=scales_per_key,
        warp_heads=True,
        block_heads=2 * WARPS,
    ]
    if block_heads == WARPS:
        return KernelFit(Four.MIN_BLOCKS, Four.Program.STEP, block_heads)
    if block_heads > WARPS:
        return KernelFit(Eight.MIN_BLOCKS, Eight.Program.STEP, block_heads)
    return KernelFit(One.MIN_BLOCKS, One.Program.BN)


comptime SPLITS_VARIABLE = "MOKV_ATTENTION_SPLITS"


def _fixed_splits() raises -> Int:
    """What `MOKV_ATTENTION_SPLITS` says: a positive split count, or 0 (not
    set) for the planner's."""
    var value = getenv(SPLITS_VARIABLE, "")
    if value == "":
        return 0
    var splits = 0
    try:
        splits = atol(value)
    except:
        pass  # not a number: refused below, as a count below 1 is
    if splits <= 0:
        raise Error(t"{SPLITS_VARIABLE}={value}: expected a positive number of splits")
    return splits


def _run[
    cache_t: KVCacheT, q_dtype: DType, //, D: Int, L: Launcher
](mut launcher: L, var args: AttentionArgs[cache_t, q_dtype], bounds: BatchBounds) raises:
    """Plans the batch for the kernels this launcher runs, then launches
    them: decode or prefill, then the merge when the context is split."""
    comptime MmaPrefill = MmaKernel[cache_t, D, L.LANES, False]
    comptime WgmmaPrefill = MmaKernel[cache_t, D, L.LANES, False, True]
    comptime BoxedPrefill = MmaKernel[cache_t, D, L.LANES, False, True, producer=True, boxes=True]
    comptime Decode = DecodeKernel[cache_t, q_dtype, D]
    comptime Prefill = AttentionKernel[
        cache_t, q_dtype, D, _prefill_rows(D), 32 if D <= 128 else 16, 4 if D <= 128 else 2
    ]
    var mma = False
    var products = WARP_PRODUCTS
    var block_heads = 1
    comptime if _on_tensor_cores[cache_t, q_dtype, D]():
        products = _prefill_products(launcher, is_quantized[cache_t.dtype]())
        mma = launcher.tensor_cores()
        if mma:
            block_heads = _decode_block_heads(args.k_cache.num_heads())
    var prefill_rows = _prefill_rows(D)
    var prefill = KernelFit(Prefill.MIN_BLOCKS, Prefill.BN)
    var decode = KernelFit(Decode.MIN_BLOCKS, Decode.Program.BN)
    if mma:
        decode = _decode_fit[cache_t, D, L.LANES, False](block_heads)
        comptime if is_quantized[cache_t.dtype]():
            if args.granularity == D:
                decode = _decode_fit[cache_t, D, L.LANES, True](block_heads)
    if products != WARP_PRODUCTS:
        # The producer-fed kernels have the same rows and blocks; the
        # box-fed one's tiles are longer.
        prefill_rows = WgmmaPrefill.Program.ROWS
        prefill = KernelFit(BoxedPrefill.MIN_BLOCKS, BoxedPrefill.Program.BN) if (
            products == BOX_FED_PRODUCTS
        ) else KernelFit(WgmmaPrefill.MIN_BLOCKS, WgmmaPrefill.Program.BN)
    elif mma:
        prefill_rows = MmaPrefill.Program.ROWS
        prefill = KernelFit(MmaPrefill.MIN_BLOCKS, MmaPrefill.Program.BN)
        comptime if is_quantized[cache_t.dtype]():
            if args.granularity == D:
                # Float16 products of the codes (`_launch_mma`): their own blocks.
                comptime F16Prefill = MmaKernel[cache_t, D, L.LANES, False, scales_per_key=True]
                prefill = KernelFit(F16Prefill.MIN_BLOCKS, F16Prefill.Program.BN)
    var plan = plan_attention(
        args.k_cache.batch_size(),
        args.k_cache.num_heads(),
        args.group,
        prefill_rows,
        bounds,
        launcher.multiprocessors(),
        decode,
        prefill,
        _fixed_splits(),
    )
    args.tokens_per_tile = plan.tokens_per_tile
    args.query_tiles = plan.query_tiles
    args.splits = plan.splits
    if plan.splits > 1:
        args.partials = launcher.scratch(plan.splits * args.total_tokens * args.n_q_heads * (D + 2))
    comptime if _on_tensor_cores[cache_t, q_dtype, D]():
        if mma:
            _launch_mma[D](
                launcher,
                rebind[AttentionArgs[cache_t, DType.bfloat16]](args),
                plan.decode,
                products,
                block_heads,
            )
    if not mma and plan.decode:
        launcher.launch(Decode(args))
    elif not mma:
        launcher.launch(Prefill(args))
    if plan.splits > 1:
        launcher.launch(
            MergeKernel[q_dtype, D](
                MergeArgs[q_dtype](
                    args.partials,
                    args.out,
                    args.total_tokens,
                    args.n_q_heads,
                    plan.splits,
                )
            )
        )


def _launch_mma[
    cache_t: KVCacheT, //, D: Int, L: Launcher
](
    mut launcher: L,
    args: AttentionArgs[cache_t, DType.bfloat16],
    decode: Bool,
    products: Int,
    block_heads: Int,
) raises:
    """The tensor-core kernel of the plan (`mma`): decode (one KV head a warp
    where a block takes `block_heads` above 1), or prefill on the `products` `_prefill_products`
    chose. An 8-bit cache with one scale per head row takes float16
    products of its codes as they are, except on warpgroup products, which
    widen them to bfloat16."""
    comptime if is_quantized[cache_t.dtype]():
        if args.granularity == D and (decode or products == WARP_PRODUCTS):
            if decode and block_heads == WARPS:
                launcher.launch(
                    MmaKernel[cache_t, D, L.LANES, True, scales_per_key=True, warp_heads=True](args)
                )
            elif decode and block_heads > WARPS:
                launcher.launch(
                    MmaKernel[
                        cache_t,
                        D,
                        L.LANES,
                        True,
                        scales_per_key=True,
                        warp_heads=True,
                        block_heads=2 * WARPS,
                    ](args)
                )
            elif decode:
                launcher.launch(MmaKernel[cache_t, D, L.LANES, True, scales_per_key=True](args))
            else:
                launcher.launch(MmaKernel[cache_t, D, L.LANES, False, scales_per_key=True](args))
            return
    if decode and block_heads == WARPS:
        launcher.launch(MmaKernel[cache_t, D, L.LANES, True, warp_heads=True](args))
    elif decode and block_heads > WARPS:
        launcher.launch(
            MmaKernel[cache_t, D, L.LANES, True, warp_heads=True, block_heads=2 * WARPS](args)
        )
    elif decode:
        launcher.launch(MmaKernel[cache_t, D, L.LANES, True](args))
    elif products == WARPGROUP_PRODUCTS:
        launcher.launch(MmaKernel[cache_t, D, L.LANES, False, True](args))
    elif products == PRODUCER_FED_PRODUCTS:
        comptime if not is_quantized[cache_t.dtype]():  # codes: refused when chosen
            launcher.launch(MmaKernel[cache_t, D, L.LANES, False, True, producer=True](args))
    elif products == BOX_FED_PRODUCTS:
        comptime if not is_quantized[cache_t.dtype]():
            var boxed = args
            boxed.page_maps = launcher.page_maps(PageTensor.of(args.k_cache, args.v_cache))
            launcher.launch(
                MmaKernel[cache_t, D, L.LANES, False, True, producer=True, boxes=True](boxed)
            )
    else:
        launcher.launch(MmaKernel[cache_t, D, L.LANES, False](args))


def attention_gpu[
    collection_t: KVCollectionT, L: Launcher, q_dtype: DType
](
    mut launcher: L,
    collection: collection_t,
    output: OutputTensor[dtype=q_dtype, rank=3, ...],
    q: InputTensor[dtype=q_dtype, rank=3, ...],
    row_offsets: InputTensor[dtype=DType.uint32, rank=1, ...],
    layer_idx: UInt32,
    scale: Float32,
    sliding_window: UInt32,
    summary: BatchSummary,
) raises:
    """`mokv.attention` on a GPU, over a cache of `q_dtype` values or of
    8-bit codes with their scales (read with float32 or bfloat16 queries).
    The host checks shapes, heads and the quantization granularity; the grid
    comes from the batch summary (see the package docstring)."""
    comptime cache_t = collection_t.CacheType
    comptime assert (
        q_dtype == cache_t.dtype or is_quantized[cache_t.dtype]()
    ), "queries of an unquantized cache have its dtype"
    var layer = Int(layer_idx)
    check_layer(layer, collection.num_layers())
    check_scale(scale)
    var k_cache = collection.get_cache(layer, 0)
    var batch = k_cache.batch_size()
    var n_kv = k_cache.num_heads()
    var d = k_cache.head_dim()
    var tokens = q.dim_size(0)
    var n_q = q.dim_size(1)
    if q.dim_size(2) != d:
        raise Error(t"q has head_dim {q.dim_size(2)} but the cache rows have {d}")
    if n_q == 0 or n_q % n_kv != 0:
        raise Error(t"q has {n_q} heads, not a positive multiple of the cache's {n_kv} KV heads")
    if output.dim_size(0) != tokens or output.dim_size(1) != n_q or output.dim_size(2) != d:
        raise Error(
            t"the output has shape [{output.dim_size(0)}, {output.dim_size(1)},"
            t" {output.dim_size(2)}], expected q's [{tokens}, {n_q}, {d}]"
        )
    if row_offsets.dim_size(0) != batch + 1:
        raise Error(
            t"input_row_offsets has {row_offsets.dim_size(0)} entries but the"
            t" cache describes {batch} rows (expected {batch + 1})"
        )
    var group = n_q // n_kv
    if group > _prefill_rows(d):
        raise Error(
            t"{group} query heads per KV head: the GPU kernel takes at most {_prefill_rows(d)}"
        )
    var granularity = 0
    comptime if is_quantized[cache_t.dtype]():
        var granules = k_cache.scales().granules
        granularity = d // granules
        if granules <= 0 or d % granules != 0 or granularity % QUANTIZED_CHUNK != 0:
            raise Error(
                t"head_dim {d} in {granules} scales: the GPU kernels take granules of a"
                t" multiple of {QUANTIZED_CHUNK} elements"
            )
    if tokens == 0 or batch == 0:
        return
    var bounds = BatchBounds.of(summary, tokens, k_cache.max_tokens())
    var args = AttentionArgs[cache_t, q_dtype](
        k_cache,
        collection.get_cache(layer, 1),
        q.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        row_offsets.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
        output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Float32](),
        tokens,
        n_q,
        group,
        scale * LOG2E,
        Int(sliding_window),
        1,
        1,
        1,
        granularity,
        PageMaps.none(),
    )
    if d == 64:
        _run[64](launcher, args, bounds)
    elif d == 128:
        _run[128](launcher, args, bounds)
    elif d == 256:
        _run[256](launcher, args, bounds)
    else:
        raise Error(t"head_dim {d}: the GPU attention kernel takes 64, 128 or 256")
