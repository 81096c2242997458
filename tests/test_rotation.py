"""`mokv.graph.hadamard` and `rotate_heads`: the rotation a cache with
`rotate_keys` stores its keys in."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from mokv.graph import hadamard, rotate_heads
from mokv_reference.lossy_kv import eight_bit_store, round_trip
from mokv_reference.numpy_llama import llama_cpp_permute


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_hadamard_is_orthonormal_and_symmetric_with_equal_magnitudes(n: int) -> None:
    h = hadamard(n).astype(np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(np.abs(h), 1 / np.sqrt(n), rtol=1e-6)


@pytest.mark.parametrize("n", [0, 3, 80])
def test_hadamard_refuses_other_sizes(n: int) -> None:
    with pytest.raises(ValueError, match=f"power of two size, got {n}"):
        hadamard(n)


def test_rotated_heads_keep_every_dot_product(session) -> None:
    """The graph's rotation is `x @ hadamard(head_dim)` per head, so the
    scores of rotated queries and keys are those of the plain ones."""
    cpu = DeviceRef.CPU()
    with Graph("rotate", input_types=[TensorType(DType.float32, ["tokens", 3, 64], cpu)]) as graph:
        graph.output(rotate_heads(graph.inputs[0].tensor))
    model = session.load(graph)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 5, 3, 64)).astype(np.float32)
    q[..., 7] *= 40  # an outlier channel
    (q_rot,) = model.execute(Buffer.from_numpy(q))
    (k_rot,) = model.execute(Buffer.from_numpy(k))
    q_rot, k_rot = q_rot.to_numpy(), k_rot.to_numpy()
    np.testing.assert_allclose(q_rot, q.astype(np.float64) @ hadamard(64), rtol=1e-5, atol=1e-4)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), k)
    np.testing.assert_allclose(np.einsum("thd,shd->hts", q_rot, k_rot), scores, rtol=1e-4, atol=1e-3)
    assert np.abs(q_rot).max() < 0.5 * np.abs(q).max()  # the outlier spread over the head


def test_numpy_model_of_a_rotated_8bit_cache_rotates_in_the_graphs_channel_order() -> None:
    """`mokv_reference.lossy_kv` holds heads in llama.cpp's channel order (the numpy forward's)
    and must quantize keys where the graph does: `x @ hadamard(head_dim)` of the Hugging Face
    order. Values are stored unrotated; `part` picks what is stored in 8 bits."""
    rng = np.random.default_rng(0)
    d = 64
    keys_hf, values = rng.normal(size=(5, 3, d)), rng.normal(size=(5, 3, d))
    keys_hf[..., 7] *= 30  # an outlier channel, so the basis matters
    to_llama_cpp = llama_cpp_permute(np.arange(d)[:, None], 1)[:, 0]  # Hugging Face channel of each
    h = hadamard(d).astype(np.float64)
    expected_hf = round_trip(keys_hf @ h, "int8") @ h
    keys, same_values = eight_bit_store("int8", d, "keys")(0, keys_hf[..., to_llama_cpp], values)
    np.testing.assert_allclose(keys, expected_hf[..., to_llama_cpp], rtol=0, atol=1e-12)
    assert not np.allclose(keys, keys_hf[..., to_llama_cpp], rtol=0, atol=1e-6), "8-bit keys are not exact"
    assert same_values is values
    _, stored_values = eight_bit_store("int8", d, "values")(0, keys_hf, values)
    np.testing.assert_array_equal(stored_values, round_trip(values, "int8"))
    with pytest.raises(ValueError, match="part must be one of keys, values, both, got 'queries'"):
        eight_bit_store("int8", d, "queries")
