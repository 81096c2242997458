"""`GraphGroup`: graphs compiled together. Its graphs with mokv's custom ops are the
attention, store/gather and quantized test families (`tests/support/compile_once.py`) and
SmolLM2's (`tests/model/conftest.py`), whose tests check their outputs against numpy and
the dense model; here, the group's own contract on two graphs without kernels."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, TensorType, ops

from mokv.graph import GraphGroup

VECTOR = TensorType(DType.float32, ["n"], DeviceRef.CPU())


def _add_graph(group: GraphGroup, name: str, addend: float) -> None:
    with group.graph(name, [VECTOR]) as graph:
        graph.output(graph.inputs[0].tensor + ops.constant(addend, DType.float32, DeviceRef.CPU()))


def test_graphs_compile_together_and_run_by_name(session):
    group = GraphGroup()
    _add_graph(group, "plus_one", 1.0)
    _add_graph(group, "plus_two", 2.0)
    assert group.names == ["plus_one", "plus_two"]
    models = group.load(session)
    x = np.arange(5, dtype=np.float32)
    for name, addend in (("plus_one", 1.0), ("plus_two", 2.0)):
        (out,) = models[name].execute(Buffer.from_numpy(x))
        np.testing.assert_array_equal(out.to_numpy(), x + addend)
    with pytest.raises(RuntimeError, match="'plus_three': this group is already loaded"):
        _add_graph(group, "plus_three", 3.0)
    with pytest.raises(RuntimeError, match="already loaded"):
        group.load(session)


def test_graphs_compiled_before_under_other_names_come_back_under_this_groups(session):
    """MAX's compile cache keys a module by its contents, not its graphs' names: graphs
    compiled before as plus_one, plus_two and built again with the names swapped come back
    from the cache as plus_one, plus_two. Each must still run under the name it has here."""
    _add_graph(first := GraphGroup(), "plus_one", 1.0)
    _add_graph(first, "plus_two", 2.0)
    first.load(session)
    swapped = GraphGroup()
    _add_graph(swapped, "plus_two", 1.0)  # same contents, in the same order, names swapped
    _add_graph(swapped, "plus_one", 2.0)
    models = swapped.load(session)
    assert list(models) == ["plus_two", "plus_one"]
    x = np.arange(5, dtype=np.float32)
    for name, addend in (("plus_two", 1.0), ("plus_one", 2.0)):
        (out,) = models[name].execute(Buffer.from_numpy(x))
        np.testing.assert_array_equal(out.to_numpy(), x + addend)


def test_a_name_twice_is_refused_before_the_graph_is_built():
    group = GraphGroup()
    _add_graph(group, "twice", 1.0)
    with pytest.raises(ValueError, match="graph name 'twice' is already in this group"):
        _add_graph(group, "twice", 2.0)
    assert group.names == ["twice"]


def test_an_empty_group_does_not_load(session):
    with pytest.raises(ValueError, match="no graphs to load"):
        GraphGroup().load(session)
