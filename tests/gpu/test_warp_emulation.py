"""The emulated warp-collective steps of `mokv_kernels.gpu.warp` (and the
warpgroup products of `mokv_kernels.gpu.warpgroup`) against numpy, on random
registers (no GPU needed); where there is a GPU, the same cases run on it too
(`steps` "gpu": `tests/gpu/warp_steps_on_gpu.mojo`, each lane a hardware
thread), so the hardware itself checks what the emulator was written from.

The tensor-core kernels run under the emulator only as correctly as these
steps follow the hardware's documented fragment layouts, and a kernel that is
consistent with a wrong layout would pass its own emulated tests and fail on
a GPU. So the layouts here are written afresh from the PTX ISA's tables, in
the direction they are documented (which elements lane l holds), where the
emulator works the other way (which lane holds an element); random distinct
values make any lane or register mix-up show.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import accelerator_architecture_name

from mokv_reference import bfloat16
from tests.support.emulation import GPU_STEPS_SOURCE, Emulator, build_harness
from tests.support.gpu import HAS_GPU

LANES = 32


@pytest.fixture(scope="module", params=["emulated", "gpu"])
def steps(request, tmp_path_factory) -> Emulator:
    """Where the steps run: the CPU emulator, or the GPU (skipped without one)."""
    if request.param == "emulated":
        return request.getfixturevalue("emulator")
    if not HAS_GPU:
        pytest.skip("no GPU on this machine: would run the same warp steps on one")
    return Emulator(build_harness(GPU_STEPS_SOURCE, accelerator_architecture_name()), tmp_path_factory.mktemp("steps"))


def a_fragments(a: np.ndarray) -> np.ndarray:
    """m16n8k16 A `[16, 16]` as each lane's 8 values (PTX: a0..a7)."""
    out = np.empty((LANES, 8), a.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        c = 2 * t
        rows, cols = [g, g, g + 8, g + 8], [c, c + 1, c, c + 1]  # a0..a3; a4..a7: 8 columns on
        out[lane] = [a[r, k] for r, k in zip(rows, cols, strict=True)] + [
            a[r, k + 8] for r, k in zip(rows, cols, strict=True)
        ]
    return out


def b_fragments(b: np.ndarray) -> np.ndarray:
    """m16n8k16 B `[16, 8]` (k x n) as each lane's 4 values (b0..b3)."""
    out = np.empty((LANES, 4), b.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        out[lane] = [b[2 * t, g], b[2 * t + 1, g], b[2 * t + 8, g], b[2 * t + 9, g]]
    return out


def c_fragments(c: np.ndarray) -> np.ndarray:
    """m16n8 C or D `[16, 8]` as each lane's 4 values (c0..c3); for a
    `[16, N]` (one warp's rows of a warpgroup product, m64nNk16), the same
    4 values for each 8 columns in turn: N / 2 values."""
    n = c.shape[1]
    out = np.empty((LANES, n // 2), c.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        for i in range(n // 8):
            col = 8 * i + 2 * t
            out[lane, 4 * i : 4 * i + 4] = [c[g, col], c[g, col + 1], c[g + 8, col], c[g + 8, col + 1]]
    return out


def swizzled_tile(tile: np.ndarray) -> np.ndarray:
    """A `[rows, D]` tile as Hopper's 128-byte swizzle lays it out for
    `wgmma` (PTX ISA, "Shared Memory Matrix Layout"): D / 64 column blocks
    `[rows, 64]` one after the other, the 16-byte chunk c of row r stored
    at chunk `c ^ (r % 8)` of its 128-byte row."""
    rows, d = tile.shape
    out = np.empty(rows * d, tile.dtype)
    for block in range(d // 64):
        for r in range(rows):
            for c in range(8):
                to = (block * rows + r) * 64 + (c ^ (r % 8)) * 8
                out[to : to + 8] = tile[r, block * 64 + 8 * c : block * 64 + 8 * c + 8]
    return out


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return bfloat16.from_bits(bfloat16.to_bits(rng.standard_normal(shape, dtype=np.float32)))


def assert_product(d: np.ndarray, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """The lanes' D fragments `d` hold A B + C, computed in float64."""
    expected = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, c_fragments(expected), rtol=1e-5, atol=1e-5)


def run_step(steps: Emulator, step: str, arrays: dict[str, np.ndarray], **meta: int) -> bytes:
    return steps.run({"op": "warp", "step": step} | meta, arrays, "out")


def _float16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random float16 values (in float32): their bits read as bfloat16 would
    be other numbers altogether."""
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


def _float16_bits(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("float16", [False, True], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("seed", range(3))
def test_mma_m16n8k16_matches_numpy(seed, float16, steps):
    """bfloat16 operands, or float16 ones (carried in the same registers)."""
    rng = np.random.default_rng(seed)
    values, bits = (_float16, _float16_bits) if float16 else (_bf16, bfloat16.to_bits)
    a, b = values(rng, (16, 16)), values(rng, (16, 8))
    c = rng.standard_normal((16, 8), dtype=np.float32)
    arrays = {"a": bits(a_fragments(a)), "b": bits(b_fragments(b)), "c": c_fragments(c)}
    d = np.frombuffer(run_step(steps, "mma", arrays, float16=int(float16)), np.float32).reshape(LANES, 4)
    assert_product(d, a, b, c)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transposed"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_ld_matrix_matches_numpy(count, transpose, steps):
    """Lanes give the addresses of rows picked at random from a 64-row
    shared-memory array; lanes 8i .. 8i + 7 address matrix i."""
    rng = np.random.default_rng(count + 10 * transpose)
    smem = _bf16(rng, (64, 8))
    rows = rng.permutation(64)[:LANES].astype(np.uint32)
    arrays = {"smem": bfloat16.to_bits(smem), "rows": rows}
    raw = run_step(steps, "ld_matrix", arrays, count=count, transpose=int(transpose))
    got = bfloat16.from_bits(np.frombuffer(raw, np.uint16)).reshape(LANES, 2 * count)
    expected = np.empty((LANES, 2 * count), np.float32)
    for lane in range(LANES):
        for i in range(count):
            matrix = smem[rows[8 * i : 8 * i + 8]]  # row r: the row lane 8i + r addresses
            if transpose:
                matrix = matrix.T
            expected[lane, 2 * i : 2 * i + 2] = matrix[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("mask", [1, 2, 4, 8, 16])
def test_shuffle_xor_matches_numpy(mask, steps):
    values = np.random.default_rng(mask).standard_normal(LANES, dtype=np.float32)
    got = np.frombuffer(run_step(steps, "shuffle_xor", {"values": values}, mask=mask), np.float32)
    np.testing.assert_array_equal(got, values[np.arange(LANES) ^ mask])


def _wgmma(steps: Emulator, arrays: dict[str, np.ndarray], n: int, **meta: int) -> np.ndarray:
    """A warpgroup product (on a GPU, only Hopper has them)."""
    if steps.binary.stem == GPU_STEPS_SOURCE.stem and not accelerator_architecture_name().startswith("sm_90"):
        pytest.skip(f"warpgroup MMA is Hopper's (sm_90); this GPU is {accelerator_architecture_name()}")
    raw = run_step(steps, "wgmma", arrays, n=n, **meta)
    return np.frombuffer(raw, np.float32).reshape(LANES, n // 2)


@pytest.mark.parametrize(("step", "warp"), [(0, 0), (5, 3), (7, 1)])
def test_wgmma_scores_from_shared_memory(step, warp, steps):
    """Q Kᵀ's k-step `step` as the tensor-core prefill issues it on Hopper:
    A from the swizzled queries `[64, 128]`, B the swizzled keys `[64, 128]`
    read K-major, N = 64 keys; a warp gets its 16 rows of D."""
    rng = np.random.default_rng(step + 10 * warp)
    queries, keys = _bf16(rng, (64, 128)), _bf16(rng, (64, 128))
    c = rng.standard_normal((16, 64), dtype=np.float32)
    arrays = {
        "a_tile": bfloat16.to_bits(swizzled_tile(queries)),
        "b_tile": bfloat16.to_bits(swizzled_tile(keys)),
        "c": c_fragments(c),
    }
    d = _wgmma(steps, arrays, 64, a_shared=1, b_major=1, k_step=step, warp=warp)
    k = slice(16 * step, 16 * step + 16)
    assert_product(d, queries[16 * warp : 16 * warp + 16, k], keys[:, k].T, c)


@pytest.mark.parametrize("step", [0, 3])
def test_wgmma_values_from_registers_and_shared_memory(step, steps):
    """P V's k-step `step`: A (probabilities `[16, 16]`) in one warp's
    `mma.sync` A fragments, B the swizzled values `[64, 128]` read MN-major
    (keys 16 step .. as K), N = 128 dims."""
    rng = np.random.default_rng(100 + step)
    p, values = _bf16(rng, (16, 16)), _bf16(rng, (64, 128))
    c = rng.standard_normal((16, 128), dtype=np.float32)
    arrays = {
        "a_tile": bfloat16.to_bits(np.zeros(64 * 128, np.float32)),
        "b_tile": bfloat16.to_bits(swizzled_tile(values)),
        "a": bfloat16.to_bits(a_fragments(p)),
        "c": c_fragments(c),
    }
    d = _wgmma(steps, arrays, 128, a_shared=0, b_major=0, k_step=step, warp=0)
    assert_product(d, p, values[16 * step : 16 * step + 16], c)


def completed_parities(count: int, arrivals: int) -> tuple[int, int]:
    """The PTX ISA's rule for `mbarrier.test_wait.parity`: the phase of a
    parity is complete unless it is the current phase (each phase takes
    `count` arrivals; before the first completes, the phase before it, of
    parity 1, counts as complete)."""
    current = (arrivals // count) % 2
    return tuple(int(parity != current) for parity in (0, 1))


@pytest.mark.parametrize(
    ("count", "first", "second"),
    [(8, 5, 0), (8, 8, 0), (8, 8, 3), (8, 8, 8), (32, 32, 32)],
    ids=["phase-0-pending", "phase-0-done", "phase-1-pending", "phase-1-done", "whole-warp-twice"],
)
def test_mbarrier_phase_parity(count, first, second, steps):
    """`first` lanes arrive on a barrier of `count` arrivals, then `second`:
    which phases every lane finds complete (`mokv_kernels.gpu.mbarrier`,
    whose emulated waits the producer-fed prefill's tests rely on)."""
    raw = run_step(steps, "mbarrier", {}, count=count, first=first, second=second)
    found = np.frombuffer(raw, np.uint32).reshape(LANES, 2)
    assert (found == np.array(completed_parities(count, first + second), np.uint32)).all()


SWIZZLE_BYTES = 128
CHUNK_ROWS = 16


def landed_boxes(tensor: np.ndarray, boxes: np.ndarray, shared_bytes: int) -> np.ndarray:
    """Shared memory (0xFF bytes first) after tensor-map boxes of the page
    tensor `tensor` (`[pages, 2, page_len, heads, head_dim]` bfloat16 bits),
    as the CUDA programming guide describes them: each box row is 64
    elements of one head's row, zeros where the row is outside the tensor
    (in any dimension), landed at `offset + 128 r` with its 16-byte chunks
    swizzled by the destination's address bits (bits 4-6 XOR bits 7-9)."""
    pages, _, page_len, heads, _ = tensor.shape
    shared = np.full(shared_bytes, 0xFF, np.uint8)
    for rows, offset, column, head, kind, row, page in boxes:
        for r in range(rows):
            inside = 0 <= page < pages and 0 <= row + r < page_len and 0 <= head < heads
            values = tensor[page, kind, row + r, head, column : column + 64] if inside else np.zeros(64, np.uint16)
            raw = values.astype("<u2").tobytes()
            for chunk in range(SWIZZLE_BYTES // 16):
                byte = offset + r * SWIZZLE_BYTES + 16 * chunk
                at = byte ^ ((byte >> 7 & 7) << 4)
                shared[at : at + 16] = np.frombuffer(raw[16 * chunk : 16 * chunk + 16], np.uint8)
    return shared


def test_tensor_map_boxes(steps):
    """Boxes as the tensor-map-fed prefill starts them (`mokv_kernels.gpu.tensor_map`):
    16 rows of a page at a tile's chunk, value rows of the second column block, one
    row at a row whose swizzle phase is not 0, a row box of page -1 (zeros past a
    block's last key), a chunk of a page past the tensor's last and one across a
    page's end (zeros where outside); the barrier expecting their bytes completes
    (on a GPU, a box whose bytes were not counted would leave it pending)."""
    if steps.binary.stem == GPU_STEPS_SOURCE.stem and not accelerator_architecture_name().startswith("sm_90"):
        pytest.skip(f"tensor-map copies are Hopper's (sm_90) here; this GPU is {accelerator_architecture_name()}")
    pages, page_len, heads, head_dim = 3, 32, 2, 128
    rng = np.random.default_rng(7)
    tensor = bfloat16.to_bits(_bf16(rng, (pages, 2, page_len, heads, head_dim)))
    boxes = np.array(
        [
            # rows, shared offset, column, head, K (0) or V (1), row, page
            (CHUNK_ROWS, 2048, 64, 1, 1, 16, 2),
            (1, 3 * SWIZZLE_BYTES, 0, 0, 0, 31, 0),
            (1, 5 * SWIZZLE_BYTES, 64, 1, 0, 7, 1),
            (1, 0, 0, 1, 1, 3, -1),
            (CHUNK_ROWS, 4096, 0, 0, 0, 0, pages),
            (CHUNK_ROWS, 6144, 64, 0, 1, 24, 1),
        ],
        np.int32,
    )
    shared_bytes = 8192
    raw = run_step(
        steps,
        "box",
        {"tensor": tensor, "boxes": boxes},
        count=len(boxes),
        pages=pages,
        page_len=page_len,
        heads=heads,
        head_dim=head_dim,
        shared_bytes=shared_bytes,
    )
    landed = np.frombuffer(raw, np.uint8)
    assert np.frombuffer(landed[shared_bytes:].tobytes(), np.uint32)[0] == 1, (
        "the boxes' bytes did not complete the phase"
    )
    np.testing.assert_array_equal(landed[:shared_bytes], landed_boxes(tensor, boxes, shared_bytes))
