"""`mokv.attention` on a GPU: the host checks shapes and heads, plans the
grid from the batch summary (`plan`), and launches a decode or a prefill
kernel (on tensor cores for bfloat16 where the device has them, `mma`), then
the split-K merge when the context was split. One function (`_kernel`)
hands the planner the fit of each kernel the call may launch and launches
the one the plan names, so a plan is always cut for the kernel that runs.

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


@fieldwise_init
struct KernelChoice(TrivialRegisterPassable):
    """The kernels a call may launch, chosen from the device, the cache and
    the variables before the plan says decode or prefill: whether they run
    on tensor cores, the tensor-core prefill's products
    (`_prefill_products`), the KV heads a tensor-core decode block takes
    (`_decode_block_heads`), and whether an 8-bit cache's codes, one scale
    per head row, are multiplied as they are in float16 (by the decode, and
    by the prefill on warp products; warpgroup products widen them to
    bfloat16)."""

    var tensor_cores: Bool
    var products: Int
    var block_heads: Int
    var float16_codes: Bool

    @staticmethod
    def of[
        cache_t: KVCacheT, q_dtype: DType, //, D: Int, L: Launcher
    ](launcher: L, args: AttentionArgs[cache_t, q_dtype]) raises -> Self:
        """What this launcher, cache and `MOKV_*_KERNEL` call for (raising
        where a variable names a kernel they cannot run)."""
        var choice = Self(False, WARP_PRODUCTS, 1, False)
        comptime if _on_tensor_cores[cache_t, q_dtype, D]():
            choice.products = _prefill_products(launcher, is_quantized[cache_t.dtype]())
            choice.tensor_cores = launcher.tensor_cores()
            if choice.tensor_cores:
                choice.block_heads = _decode_block_heads(args.k_cache.num_heads())
            choice.float16_codes = is_quantized[cache_t.dtype]() and args.granularity == D
        return choice


def _run[
    cache_t: KVCacheT, q_dtype: DType, //, D: Int, L: Launcher
](mut launcher: L, var args: AttentionArgs[cache_t, q_dtype], bounds: BatchBounds) raises:
    """Plans the batch for the kernels this launcher runs, then launches
    them: decode or prefill, then the merge when the context is split."""
    var choice = KernelChoice.of[D](launcher, args)
    var plan = plan_attention(
        args.k_cache.batch_size(),
        args.k_cache.num_heads(),
        args.group,
        bounds,
        launcher.multiprocessors(),
        _kernel[D](launcher, args, choice, decode=True, launch=False),
        _kernel[D](launcher, args, choice, decode=False, launch=False),
        _fixed_splits(),
    )
    args.tokens_per_tile = plan.tokens_per_tile
    args.query_tiles = plan.query_tiles
    args.splits = plan.splits
    if plan.splits > 1:
        args.partials = launcher.scratch(plan.splits * args.total_tokens * args.n_q_heads * (D + 2))
    _ = _kernel[D](launcher, args, choice, plan.decode, launch=True)
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


def _kernel[
    cache_t: KVCacheT, q_dtype: DType, L: Launcher, //, D: Int
](
    mut launcher: L,
    args: AttentionArgs[cache_t, q_dtype],
    choice: KernelChoice,
    decode: Bool,
    launch: Bool,
) raises -> KernelFit:
    """The kernel `choice` runs for a decode (or prefill) plan: what the
    planner needs of it, and where `launch` it is launched on `args`. The
    plan and the launch both come from here, so a plan is always cut for
    the kernel that runs (the tenth GPU run's float8 decode was planned for
    another's blocks per multiprocessor)."""
    comptime if _on_tensor_cores[cache_t, q_dtype, D]():
        if choice.tensor_cores:
            var products_args = rebind[AttentionArgs[cache_t, DType.bfloat16]](args)
            if decode:
                comptime if is_quantized[cache_t.dtype]():
                    if choice.float16_codes:
                        return _mma_decode[D, True](launcher, products_args, choice, launch)
                return _mma_decode[D, False](launcher, products_args, choice, launch)
            return _mma_prefill[D](launcher, products_args, choice, launch)
    if decode:
        comptime Decode = DecodeKernel[cache_t, q_dtype, D]
        if launch:
            launcher.launch(Decode(args))
        return Decode.FIT
    comptime Prefill = AttentionKernel[
        cache_t, q_dtype, D, _prefill_rows(D), 32 if D <= 128 else 16, 4 if D <= 128 else 2
    ]
    if launch:
        launcher.launch(Prefill(args))
    return Prefill.FIT


def _mma_decode[
    cache_t: KVCacheT, L: Launcher, //, D: Int, scales_per_key: Bool
](
    mut launcher: L,
    args: AttentionArgs[cache_t, DType.bfloat16],
    choice: KernelChoice,
    launch: Bool,
) raises -> KernelFit:
    """`_kernel`'s tensor-core decode: one KV head a block, or one a warp
    over `choice.block_heads` of them."""
    if choice.block_heads == WARPS:
        return _mma[D, True, scales_per_key=scales_per_key, warp_heads=True](launcher, args, launch)
    if choice.block_heads > WARPS:
        return _mma[D, True, scales_per_key=scales_per_key, warp_heads=True, block_heads=2 * WARPS](
            launcher, args, launch
        )
    return _mma[D, True, scales_per_key=scales_per_key](launcher, args, launch)


def _mma_prefill[
    cache_t: KVCacheT, L: Launcher, //, D: Int
](
    mut launcher: L,
    args: AttentionArgs[cache_t, DType.bfloat16],
    choice: KernelChoice,
    launch: Bool,
) raises -> KernelFit:
    """`_kernel`'s tensor-core prefill, on the products `choice` names."""
    if choice.products == WARP_PRODUCTS:
        comptime if is_quantized[cache_t.dtype]():
            if choice.float16_codes:
                return _mma[D, False, scales_per_key=True](launcher, args, launch)
        return _mma[D, False](launcher, args, launch)
    if choice.products == WARPGROUP_PRODUCTS:
        return _mma[D, False, True](launcher, args, launch)
    comptime if is_quantized[cache_t.dtype]():
        raise Error("the producer-fed prefills copy bfloat16 rows, not 8-bit codes")
    else:
        if choice.products == PRODUCER_FED_PRODUCTS:
            return _mma[D, False, True, producer=True](launcher, args, launch)
        return _mma[D, False, True, producer=True, boxes=True](launcher, args, launch)


def _mma[
    cache_t: KVCacheT,
    L: Launcher,
    //,
    D: Int,
    decode: Bool,
    warpgroup: Bool = False,
    scales_per_key: Bool = False,
    producer: Bool = False,
    boxes: Bool = False,
    warp_heads: Bool = False,
    block_heads: Int = WARPS,
](mut launcher: L, args: AttentionArgs[cache_t, DType.bfloat16], launch: Bool) raises -> KernelFit:
    """The `MmaKernel` of these parameters: its fit, and where `launch` it
    is launched (the box-fed prefill with its pages' tensor maps)."""
    comptime Kernel = MmaKernel[
        cache_t,
        D,
        L.LANES,
        decode,
        warpgroup,
        scales_per_key,
        producer,
        boxes,
        warp_heads,
        block_heads,
    ]
    if launch:
        var kernel_args = args
        comptime if boxes:
            kernel_args.page_maps = launcher.page_maps(PageTensor.of(args.k_cache, args.v_cache))
        launcher.launch(Kernel(kernel_args))
    return Kernel.FIT


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
