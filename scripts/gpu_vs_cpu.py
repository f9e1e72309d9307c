"""GPU engine vs CPU engine logits on the tiny model, first positions, under variants of how the
decode step runs: a bisect aid when the GPU test's agreement moves. Prints correlation and
rms/std per position and variant.

PRESET=flash runs the flash preset (per-role aliased) instead of tiny; VARIANTS=a,b picks some.
Variants: as shipped (captured graph, side streams, PDL); without PDL; every launch on the main
stream; eager launches (no graph) with and without side streams; and the shipped step after the
device memory the engine will get was filled with 0xFF bytes (NaN) or zeros: a kernel that reads
device memory nobody wrote gives different logits there."""

import os
import sys

import numpy as np


def _poison(byte: int, n_bytes: int = 8 << 30) -> None:
    """Fill n_bytes of fresh device memory with `byte`, then free it: the engine's allocations
    that follow reuse (some of) these pages."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import device_memset
    blocks = [cuda.device_array(1 << 28, np.uint8) for _ in range(n_bytes >> 28)]
    for block in blocks:
        device_memset(block, byte, block.nbytes)
    cuda.synchronize()
    del blocks
    cuda.current_context().deallocations.clear()


def main(n_pos: int = 6) -> None:
    from ds4py import synth
    from ds4py.forward_cpu import CpuEngine
    from ds4py.forward_cuda import CudaEngine
    from ds4py.io import sources
    from ds4py.io.spec import open_model

    preset = os.environ.get("PRESET", "tiny")             # flash: the full shapes, per-role aliased
    path = f"/tmp/{preset}.gguf"
    if not os.path.exists(path):
        synth.build_model(path, preset, "per-role" if preset == "flash" else "none", 0)
    model = open_model(path)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 129_000, size=n_pos)]
    n_ctx = 256 if preset == "tiny" else 64
    cpu = CpuEngine(model, n_ctx=n_ctx)
    want = [np.asarray(cpu.decode(t), np.float64) for t in tokens]

    def serial(engine):
        engine.side_streams = {}

    def eager(engine):
        engine.use_graphs = False

    variants = {
        "shipped": (None, ()),
        "no-pdl": (None, (lambda e: setattr(e, "pdl", False),)),
        "serial": (None, (serial,)),
        "eager": (None, (eager,)),
        "eager-serial": (None, (eager, serial)),
        "poison-ff": (0xFF, ()),
        "poison-00": (0x00, ()),
        "serial-poison-ff": (0xFF, (serial,)),
    }
    wanted = os.environ.get("VARIANTS")          # a comma-separated subset
    if wanted:
        variants = {name: variants[name] for name in wanted.split(",")}
    for name, (poison, configure) in variants.items():
        if poison is not None:
            _poison(poison)
        source = sources.DeviceSource(model, progress=False)
        engine = CudaEngine(model, source, n_ctx)
        for step in configure:
            step(engine)
        line = []
        for pos, t in enumerate(tokens):
            got = np.asarray(engine.decode(t), np.float64)
            corr = np.corrcoef(got, want[pos])[0, 1] if np.all(np.isfinite(got)) else float("nan")
            rms = np.sqrt(np.mean((got - want[pos]) ** 2)) / np.std(want[pos])
            line.append(f"{pos}: {corr:.6f}/{rms:.3f}")
        print(f"{name:17s}", "  ".join(line), flush=True)
        source.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
