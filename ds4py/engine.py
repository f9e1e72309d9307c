"""Model + options -> a running engine: the one place `run` and `bench` get theirs from.

The data flow of the design: the model (io.spec) and the machine facts go to the detector, which
picks the regime; the weight source for that regime is opened (io.sources); the CPU engine runs on
the mmap, the CUDA engine on the source's device arena. The engine never learns the regime.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4py.errors import ResourceError


@dataclass
class Loaded:
    engine: object
    source: object
    decision: object
    kind: str                 # "cpu" | "cuda"

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close:
            close()


def open_engine(model, weights, *, progress=True, log=None) -> Loaded:
    """Decide the regime, load the weights and build the matching engine."""
    from ds4py.io.sources import load_weights

    source, decision = load_weights(model, weights, progress=progress, log=log)
    if decision.regime == "cpu":
        from ds4py.forward_cpu import CpuEngine
        return Loaded(CpuEngine(model, source, n_ctx=weights.n_ctx), source, decision, "cpu")
    from ds4py.forward_cuda import CudaEngine
    try:
        engine = CudaEngine(model, source, weights.n_ctx, prefill_chunk=weights.prefill_chunk,
                            pdl=not weights.no_pdl)
    except Exception as e:                 # numba's CudaAPIError for an allocation, mostly
        source.close()
        if "OUT_OF_MEMORY" in str(e) or "out of memory" in str(e).lower():
            raise ResourceError(f"not enough VRAM for the KV state and scratch at --ctx {weights.n_ctx} "
                                f"({e}); lower --ctx or --gpu-vram") from None
        raise
    return Loaded(engine, source, decision, "cuda")
