"""The graph-side op wrappers (`mokv.graph`) refuse bad arguments while a
graph is built, naming the bad value (`tests.support.refusals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from mokv.graph import PagedCacheValues, attention, gather_kv, paged_input_types, store_kv
from tests.support.refusals import NAN, Case, P, cases, raises_naming


def with_cache(use: Callable[[PagedCacheValues, list], Any]) -> Callable[[], Any]:
    """Builds a graph over one device's paged cache and calls `use` inside it."""

    def build() -> Any:
        cpu = DeviceRef.CPU()
        rows = TensorType(DType.float32, ["n", 2, 8], cpu)
        other = [
            TensorType(DType.uint32, ["b"], cpu),
            TensorType(DType.int32, ["b"], cpu),
            TensorType(DType.float32, ["n", 3, 8], cpu),
            TensorType(DType.float32, ["n", 2, 4], cpu),
            TensorType(DType.bfloat16, ["n", 2, 8], cpu),
        ]
        with Graph("bad", input_types=[*paged_input_types(P), rows, *other]) as graph:
            cache = PagedCacheValues.from_inputs(graph.inputs[:4])
            use(cache, [v.tensor for v in graph.inputs[4:]])

    return build


def _store(layer: Any = 0, k: int = 0, offsets: int = 1) -> Callable[[], Any]:
    return with_cache(lambda cache, t: store_kv(cache, layer, t[k], t[k], t[offsets]))


def _attend(q: int = 0, scale: Any = 0.1, window: Any = 0, layer: Any = 0) -> Callable[[], Any]:
    return with_cache(lambda cache, t: attention(cache, layer, t[q], t[1], scale, window))


GRAPH_CASES = cases(
    ("store-layer-bool", _store(layer=True), TypeError, "True"),
    ("store-layer-float", _store(layer=1.0), TypeError, "1.0"),
    ("store-layer-negative", _store(layer=-1), ValueError, "-1"),
    ("store-layer-past", _store(layer=2), ValueError, "layer_idx must be <= 1, got 2"),
    ("store-keys-heads", _store(k=3), ValueError, "3 heads"),
    ("store-keys-head-dim", _store(k=4), ValueError, "head_dim 4"),
    ("store-keys-dtype", _store(k=5), TypeError, "bfloat16"),
    ("store-offsets-dtype", _store(offsets=2), TypeError, "int32"),
    ("store-offsets-rank", _store(offsets=0), TypeError, "rank 1"),
    ("gather-kv-2", with_cache(lambda cache, t: gather_kv(cache, 0, 2, t[1], t[1])), ValueError, "kv_idx"),
    ("attention-scale-nan", _attend(scale=NAN), ValueError, "nan"),
    ("attention-scale-str", _attend(scale="0.1"), TypeError, "'0.1'"),
    ("attention-scale-zero", _attend(scale=0.0), ValueError, "0.0"),
    ("attention-window-negative", _attend(window=-1), ValueError, "-1"),
    ("attention-window-float", _attend(window=2.5), TypeError, "2.5"),
    ("attention-q-heads", _attend(q=3), ValueError, "3 heads"),
    ("attention-layer-str", _attend(layer="0"), TypeError, "'0'"),
    ("attention-head-dim", _attend(), ValueError, "head_dim to be a multiple of 16, the cache has 8"),
    ("from-inputs-count", with_cache(lambda cache, t: PagedCacheValues.from_inputs(t[:2])), ValueError, "got 2"),
    ("input-types-page", lambda: paged_input_types(P, page_size=0), ValueError, "page_size must be >= 1, got 0"),
    ("input-types-page-float", lambda: paged_input_types(P, page_size=1.5), TypeError, "1.5"),
)


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_graph_wrappers_refuse(case: Case) -> None:
    raises_naming(case)
