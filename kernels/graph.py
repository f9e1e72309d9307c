"""Capture a sequence of Numba launches on one stream into a CUDA graph, and replay it.

Numba launches cost 20-70 µs each; a decoded token issues over a thousand of them. Captured once
and replayed, each node costs about a microsecond (kernels-and-numba.md §5.6). Capture uses the
driver's stream capture through cuda.bindings, so any Numba kernel launched on the stream between
`begin` and `end` becomes a node; per-token values must live in device buffers.

With `programmatic=True` every kernel -> kernel edge of the captured graph becomes a programmatic
dependency (PDL, sm_90+): the next kernel is launched while the one before it is still running,
its blocks wait in `pdl_enter()` (the first statement of every kernel here) until that grid has
finished and its writes are visible. The order of memory effects is the ordinary one; what is
saved is the launch gap between dependent nodes (a decode step is a chain of ~1,300 of them).
"""

from __future__ import annotations

from ds4py.kernels import compat  # noqa: F401


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return result[1] if len(result) == 2 else result[1:]


def stream_handle(stream) -> int:
    """The raw CUstream of a Numba stream (an int or a binding object, by numba-cuda version)."""
    handle = stream.handle
    value = getattr(handle, "value", handle)
    return int(value)


def _edge_api(name: str):
    """The edge-data form of a graph call: `name`_v2 in cuda-bindings 12, `name` from 13 on."""
    drv = _driver()
    return getattr(drv, name + "_v2", None) or getattr(drv, name)


def _kernel_edges(graph):
    """The graph's (from, to) edges whose two ends are kernel nodes."""
    drv = _driver()
    get_edges = _edge_api("cuGraphGetEdges")
    n = _check(get_edges(graph, 0), "cuGraphGetEdges")[-1]
    src, dst, _, n = _check(get_edges(graph, n), "cuGraphGetEdges")
    kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

    def is_kernel(node):
        return _check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType") == kernel

    return [(a, b) for a, b in zip(src[:n], dst[:n]) if is_kernel(a) and is_kernel(b)]


def make_programmatic(graph) -> int:
    """Turn every kernel -> kernel edge of `graph` into a programmatic one (see the module
    docstring); returns how many. Only valid when every kernel in the graph starts with
    pdl_enter()."""
    drv = _driver()
    edges = _kernel_edges(graph)
    if not edges:
        return 0
    src = [a for a, _ in edges]
    dst = [b for _, b in edges]
    data = []
    for _ in edges:
        d = drv.CUgraphEdgeData()
        d.from_port = int(drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)
        d.type = int(drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
        data.append(d)
    _check((_edge_api("cuGraphRemoveDependencies")(graph, src, dst, None, len(edges))[0], None),
           "cuGraphRemoveDependencies")
    _check((_edge_api("cuGraphAddDependencies")(graph, src, dst, data, len(edges))[0], None),
           "cuGraphAddDependencies")
    return len(edges)


def pdl_available() -> bool:
    """Programmatic dependent launch needs sm_90 or newer."""
    from numba import cuda
    return tuple(cuda.get_current_device().compute_capability) >= (9, 0)


class CapturedGraph:
    """`with CapturedGraph(stream) as g: launches...` then `g.replay()` on the same stream.
    programmatic=True: kernel -> kernel edges become programmatic dependencies (sm_90+; see the
    module docstring); if the driver refuses the edited graph, the ordinary edges are kept."""

    def __init__(self, stream, programmatic: bool = False):
        self.stream = stream
        self.programmatic = programmatic
        self.programmatic_edges = 0
        self._exec = None
        self._graph = None

    def __enter__(self):
        drv = _driver()
        _check(drv.cuStreamBeginCapture(stream_handle(self.stream),
                                        drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        return self

    def __exit__(self, exc_type, exc, tb):
        drv = _driver()
        graph = _check(drv.cuStreamEndCapture(stream_handle(self.stream)), "cuStreamEndCapture")
        if exc_type is not None:
            return False
        self._graph = graph
        if self.programmatic and pdl_available():
            self._exec = self._instantiate_programmatic(graph)
        if self._exec is None:
            self._exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return False

    def _instantiate_programmatic(self, graph):
        """Instantiate a programmatic copy of `graph`; None (and the copy dropped) if refused."""
        drv = _driver()
        copy = _check(drv.cuGraphClone(graph), "cuGraphClone")
        try:
            n = make_programmatic(copy)
            exec_ = _check(drv.cuGraphInstantiate(copy, 0), "cuGraphInstantiate")
        except RuntimeError:
            drv.cuGraphDestroy(copy)
            return None
        drv.cuGraphDestroy(self._graph)
        self._graph = copy
        self.programmatic_edges = n
        return exec_

    @property
    def n_nodes(self) -> int:
        drv = _driver()
        result = drv.cuGraphGetNodes(self._graph)
        return int(result[-1])

    def replay(self) -> None:
        drv = _driver()
        _check(drv.cuGraphLaunch(self._exec, stream_handle(self.stream)), "cuGraphLaunch")

    def close(self) -> None:
        drv = _driver()
        if self._exec is not None:
            drv.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            drv.cuGraphDestroy(self._graph)
            self._graph = None
