"""GPU engine vs CPU engine logits on the tiny model, first positions, with the single-block
vector kernels at WIDE threads (as shipped) and at BLOCK threads: a bisect aid when the GPU test's
agreement moves. Prints correlation and rms/std per position and variant."""

import os
import sys

import numpy as np


def main(n_pos: int = 6) -> None:
    from ds4py import synth
    from ds4py.forward_cpu import CpuEngine
    from ds4py.forward_cuda import CudaEngine
    from ds4py.io import sources
    from ds4py.io.spec import open_model
    from ds4py.kernels import cuda_ops as ops

    path = "/tmp/tiny.gguf"
    if not os.path.exists(path):
        synth.build_model(path, "tiny", "none", 0)
    model = open_model(path)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 129_000, size=n_pos)]
    cpu = CpuEngine(model, n_ctx=256)
    want = [np.asarray(cpu.decode(t), np.float64) for t in tokens]
    shipped = ops.wide_block
    for variant, wide in (("wide", shipped), ("block", lambda: ops.BLOCK)):
        ops.wide_block = wide
        source = sources.DeviceSource(model, progress=False)
        engine = CudaEngine(model, source, 256)
        line = []
        for pos, t in enumerate(tokens):
            got = np.asarray(engine.decode(t), np.float64)
            corr = np.corrcoef(got, want[pos])[0, 1]
            rms = np.sqrt(np.mean((got - want[pos]) ** 2)) / np.std(want[pos])
            line.append(f"{pos}: {corr:.6f}/{rms:.3f}")
        print(f"{variant:6s}", "  ".join(line), flush=True)
        source.close()
    ops.wide_block = shipped


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
