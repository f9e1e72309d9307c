"""Capture a sequence of Numba launches on one stream into a CUDA graph, and replay it.

Numba launches cost 20-70 µs each; a decoded token issues over a thousand of them. Captured once
and replayed, each node costs about a microsecond (kernels-and-numba.md §5.6). Capture uses the
driver's stream capture through cuda.bindings, so any Numba kernel launched on the stream between
`begin` and `end` becomes a node; per-token values must live in device buffers.
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


class CapturedGraph:
    """`with CapturedGraph(stream) as g: launches...` then `g.replay()` on the same stream."""

    def __init__(self, stream):
        self.stream = stream
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
        self._exec = _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return False

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
