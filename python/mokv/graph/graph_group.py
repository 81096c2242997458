"""Graphs compiled together: one MAX module, one kernel library, one compile.

MAX spends about 20 s compiling any graph before it reaches the graph's kernels, and
compiles each kernel again for every graph that names it. Graphs compiled as one
`max.graph.Module` pay that once and share the kernels they have in common: mokv's four
attention test graphs (paged and continuous, float32 and bfloat16) compile in 42 s together
and in 139 s apart (`docs/suite-time.md`). A model that needs several graphs (a prefill and a
decode graph, a draft and a target, the same model over two caches) gains the same way.

MAX 26.7's `InferenceSession.load_all` does not take a module whose graphs use custom ops such
as mokv's: it compiles the module without the kernel declarations that `load` seeds a single
graph's module with, and the compile fails. A `GraphGroup` therefore builds every graph with
one shared `KernelLibrary` and compiles the module through a graph of it
(`InferenceSession.compile`, which seeds the graph's whole module from that library), then
binds the weights of all graphs at once (`InferenceSession.init_all`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from max.driver import DLPackArray
from max.engine import InferenceSession, Model
from max.graph import Graph, KernelLibrary, Module, Type


class GraphGroup:
    """Graphs built into one module and compiled together by `load`.

    Build each graph with `graph(...)` (or pass the group to a builder that takes one), then
    call `load` once: it returns every graph's `Model` by graph name. Graph names must be
    unique within a group, and a loaded group takes no more graphs. A `Model`'s own `name`
    may be another one: MAX's compile cache keeps the names a module was first compiled
    under.
    """

    def __init__(self) -> None:
        self.module = Module()
        self.kernel_library = KernelLibrary()
        self._graphs: dict[str, Graph] = {}
        self._loaded = False

    def graph(self, name: str, input_types: Iterable[Type], custom_extensions: Iterable[Path] = ()) -> Graph:
        """A new graph of this group, to build as `with group.graph(...) as g:`; its custom
        extensions join the group's kernel library."""
        if self._loaded:
            raise RuntimeError(f"graph {name!r}: this group is already loaded; start a new GraphGroup")
        if name in self._graphs:
            raise ValueError(f"graph name {name!r} is already in this group ({', '.join(self._graphs)})")
        graph = Graph(
            name,
            input_types=input_types,
            custom_extensions=list(custom_extensions),
            module=self.module,
            kernel_library=self.kernel_library,
        )
        self._graphs[name] = graph
        return graph

    @property
    def names(self) -> list[str]:
        """The graphs' names, in the order they were built."""
        return list(self._graphs)

    def load(
        self, session: InferenceSession, weights_registry: Mapping[str, DLPackArray] | None = None
    ) -> dict[str, Model]:
        """Compiles every graph of the group in one compile and binds their weights (one
        registry for all: graphs that share a weight name share its array). The compile is
        `InferenceSession.compile`'s, which MAX's compile cache serves; a session's MEF store
        (`precompiled_mefs`) is not consulted, as it knows single graphs only."""
        if not self._graphs:
            raise ValueError("this GraphGroup has no graphs to load")
        if self._loaded:
            raise RuntimeError(f"this group ({', '.join(self._graphs)}) is already loaded")
        any_graph = next(iter(self._graphs.values()))
        compiled = session.compile(any_graph)  # seeds and compiles any_graph.module: every graph
        self._loaded = True
        models = session.init_all(compiled, weights_registry=weights_registry)
        return self._by_our_names(models)

    def _by_our_names(self, models: Mapping[str, Model]) -> dict[str, Model]:
        """The models under this group's names, matched by position. MAX's compile cache keys
        a module by its contents, not its graphs' names: a group whose graphs were compiled
        before under other names (renamed, or two names swapped) comes back under those
        names, in this group's order. Matching by name would hand out the wrong graph."""
        if len(models) != len(self._graphs):
            raise RuntimeError(
                f"the compiled module holds {len(models)} graphs ({', '.join(models)}), "
                f"this group {len(self._graphs)} ({', '.join(self._graphs)})"
            )
        return dict(zip(self._graphs, models.values(), strict=True))


def new_graph(
    name: str,
    input_types: Iterable[Type],
    custom_extensions: Iterable[Path] = (),
    group: GraphGroup | None = None,
) -> Graph:
    """A graph of `group` when one is given (compiled with it by `GraphGroup.load`), else
    a graph of its own (for `InferenceSession.load`): what graph builders call, so their
    callers choose."""
    if group is not None:
        return group.graph(name, input_types, custom_extensions)
    return Graph(name, input_types=input_types, custom_extensions=list(custom_extensions))
