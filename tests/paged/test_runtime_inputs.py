"""PagedKVCacheManager.runtime_inputs: the tables' contents, refusals, multi-step
rows, fixed shapes, and the lifetimes of the staging arrays.

Defaults (see conftest): page size 4, 16 pages, prefix caching on, runtime
invariant checks on.
"""

from __future__ import annotations

import numpy as np
import pytest

from mokv import BatchCharacteristics
from tests.support.small_cache import MakeManager, admit, ctx, lookup


def test_runtime_inputs_contents(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(100, 103))
    admit(m, a, b)
    (inputs,) = m.runtime_inputs([[a, b]]).inputs
    assert list(inputs.blocks.shape) == [17, 2, 1, 4, 1, 2] and inputs.blocks is m.get_device_buffer(0).values[0]
    cache_lengths, table, max_lengths = lookup(m, [a, b])
    assert cache_lengths.tolist() == [0, 0]
    assert table.tolist() == [[0, 1, 2], [3, 16, 16]]  # 16 = the null page
    assert max_lengths.tolist() == [[10, 10]]
    for c in (a, b):
        c.update(7)
    m.step([[a, b]])
    for c in (a, b):
        m.alloc(c)
    cache_lengths, table, max_lengths = lookup(m, [b, a], max_cache_length=20)
    assert cache_lengths.tolist() == [3, 10]
    assert table.tolist() == [[3, 16, 16, 16, 16], [0, 1, 2, 16, 16]]
    assert max_lengths.tolist() == [[1, 11]]
    assert [x.dtype for x in (cache_lengths, table, max_lengths)] == [np.uint32] * 3
    leaf = m.runtime_inputs([[a]])
    (inputs,) = leaf.inputs
    assert list(inputs) == inputs.flatten() == leaf.flatten()


def test_runtime_inputs_rejects_bad_batches(make_manager: MakeManager) -> None:
    m = make_manager(max_batch_size=2)
    cs = [ctx(f"r{i}", range(5)) for i in range(3)]
    for c in cs:
        m.claim(c.request_id)
    with pytest.raises(ValueError, match="'r0' holds 0 pages but needs 2 for 5 tokens: call alloc first"):
        m.runtime_inputs([cs[:1]])
    for c in cs:
        m.alloc(c)
    with pytest.raises(ValueError, match="batch has 3 requests, max_batch_size is 2"):
        m.runtime_inputs([cs])
    with pytest.raises(ValueError, match="expected one batch per replica \\(1\\), got 2"):
        m.runtime_inputs([cs[:1], []])
    with pytest.raises(ValueError, match="max_cache_length=4 gives 1 pages, but the batch needs 2"):
        m.runtime_inputs([cs[:1]], max_cache_length=4)
    with pytest.raises(ValueError, match="'ghost' is not claimed"):
        m.runtime_inputs([[ctx("ghost", [1])]])
    (empty,) = m.runtime_inputs([[]]).inputs
    assert empty.lookup_table.shape == (0, 0) and empty.max_lengths.to_numpy().tolist() == [[0, 0]]


def test_multi_step_max_lengths_rows(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(6)), ctx("b", range(100, 103))
    admit(m, a, b)
    with pytest.raises(ValueError, match="'b' holds 1 pages but needs 2 for 5 tokens"):
        m.runtime_inputs([[a, b]], num_steps=3)
    for c in (a, b):
        m.alloc(c, num_steps=3)
    assert len(m.get_req_blocks("a")) == 2 and len(m.get_req_blocks("b")) == 2  # 8 and 5 tokens
    cache_lengths, table, max_lengths = lookup(m, [a, b], num_steps=3)
    assert max_lengths.tolist() == [[6, 6], [1, 7], [1, 8]]
    assert table.shape == (2, 2) and cache_lengths.tolist() == [0, 0]
    # A single-step batch does not see the pages reserved for the later steps.
    _, table, max_lengths = lookup(m, [a, b])
    assert table.tolist() == [[0, 1], [2, 16]] and max_lengths.tolist() == [[6, 6]]


def test_batch_characteristics_fix_max_lengths(make_manager: MakeManager) -> None:
    m = make_manager()
    a = ctx("a", range(6))
    m.claim("a")
    m.alloc(a)
    _, _, max_lengths = lookup(m, [a], batch_characteristics=BatchCharacteristics(4, 8, 32))
    assert max_lengths.tolist() == [[8, 32]]
    with pytest.raises(ValueError, match="exceeds"):
        m.runtime_inputs([[a]], batch_characteristics=BatchCharacteristics(4, 5, 32))


def test_runtime_inputs_stay_intact_through_the_next_call(make_manager: MakeManager) -> None:
    """The contract's lifetime promise: a call's tables are intact until the
    manager's next runtime_inputs call has returned (the staging arrays are
    reused, double-buffered)."""
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(100, 103))
    admit(m, a, b)
    (first,) = m.runtime_inputs([[a, b]]).inputs
    saved = [x.to_numpy().copy() for x in first.flatten()[1:]]
    a.update(7)
    m.alloc(a)
    (second,) = m.runtime_inputs([[a]], num_steps=1).inputs
    for kept, now in zip(saved, first.flatten()[1:], strict=True):
        np.testing.assert_array_equal(now.to_numpy(), kept)
    assert second.lookup_table.to_numpy().tolist() == [[0, 1, 2]]
    assert second.cache_lengths.to_numpy().tolist() == [10]
    (third,) = m.runtime_inputs([[b, a]]).inputs
    assert third.lookup_table.to_numpy().tolist() == [[3, 16, 16], [0, 1, 2]]
    assert second.lookup_table.to_numpy().tolist() == [[0, 1, 2]]


def test_runtime_inputs_reuse_their_objects_with_fresh_values(make_manager: MakeManager) -> None:
    """On host devices, a call with the same table shapes as the call before
    the last gives back the same input objects, refilled with its own values."""
    m = make_manager()
    a = ctx("a", range(5))
    m.claim(a.request_id)
    m.alloc(a)
    first = m.runtime_inputs([[a]])
    assert m.runtime_inputs([[a]]) is not first  # the other set of arrays
    a.update(9)
    m.alloc(a)
    third = m.runtime_inputs([[a]])
    assert third is first
    (device,) = third.inputs
    assert device.cache_lengths.to_numpy().tolist() == [5]
    assert device.lookup_table.to_numpy().tolist() == [m.get_req_blocks("a")]
    assert device.max_lengths.to_numpy().tolist() == [[1, 6]]
