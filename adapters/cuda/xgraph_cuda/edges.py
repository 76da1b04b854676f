"""The dependency edges of a captured CUDA graph, and how many are programmatic (cuda-python).

Stream capture turns a kernel launched with programmatic stream serialization after another
kernel into an edge of type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (CUDA 12.3 and later);
every other edge is a full dependency. The edges, with their data, come from
cuGraphGetEdges_v2 (cuGraphGetEdges on bindings where it carries the edge data): asked once
for the count, once for the edges.
"""

from __future__ import annotations

from typing import Any

from xgraph.adapter import XGraphError


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise XGraphError(
            "Counting a graph's programmatic edges needs cuda-python: pip install cuda-bindings."
        ) from exc
    return driver


def _edges(cu: Any, graph: Any, count: int) -> tuple:
    """(err, from, to, edge data, count) of the graph's first `count` edges."""
    fn = getattr(cu, "cuGraphGetEdges_v2", None) or cu.cuGraphGetEdges
    out = fn(graph, count)
    if len(out) != 5:
        raise XGraphError(
            "The installed cuda-bindings returns no edge data from cuGraphGetEdges; install "
            "cuda-bindings >= 12.3 (pip install -U cuda-bindings) to count programmatic edges."
        )
    return out


def edge_types(raw_graph: int) -> list[int]:
    """The type of every dependency edge of a raw cudaGraph_t (CUDAGraph.raw_cuda_graph())."""
    cu = _driver()
    graph = cu.CUgraph(int(raw_graph))
    err, *_, count = _edges(cu, graph, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise XGraphError(f"cuGraphGetEdges failed ({err}) while counting a graph's edges.")
    if not count:
        return []
    err, _, _, data, _ = _edges(cu, graph, int(count))
    if err != cu.CUresult.CUDA_SUCCESS:
        raise XGraphError(f"cuGraphGetEdges failed ({err}) while reading a graph's edges.")
    return [int(d.type) for d in data]


def count_programmatic(raw_graph: int) -> int:
    """How many edges of the graph are programmatic dependencies."""
    cu = _driver()
    programmatic = int(cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    return sum(t == programmatic for t in edge_types(raw_graph))
