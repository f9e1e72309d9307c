"""GPU engine vs CPU engine logits with only the first k layers of a model (then the output head),
for several k: does their disagreement appear at once (a kernel that differs at these shapes) or
grow with depth (last-bit differences amplified layer after layer)? A bisect aid for the flash
preset, where the two engines agree to corr 0.9957-0.9995 while the tiny model agrees to 0.9999.

usage (GPU machine): PRESET=flash DEPTHS=1,2,4,8,16,43 python3 scripts/depth_vs_cpu.py [n_pos]
Prints, per depth, corr and max|Δ|/std per position. With CPU_ONLY=1 it checks the truncation
itself: the CPU engine at depth k against the CPU engine at depth k (no GPU needed); with
CPU_ONLY=1 NUDGE=1 the second CPU engine's input is one ulp off (element 0 of each token's
embedding, np.nextafter): the model's own amplification of a last-bit difference, the floor that
two f32 engines without bit parity cannot be expected to beat."""

import dataclasses
import os
import sys

import numpy as np


def truncated(spec, k: int):
    """The spec of the first k layers (the hash-routed layers are the first n_hash)."""
    return dataclasses.replace(spec, n_layer=k, n_hash=min(spec.n_hash, k),
                               compress_ratios=spec.compress_ratios[:k], swiglu_clamp=spec.swiglu_clamp[:k])


def nudged_engine_class():
    """CpuEngine whose embedding rows have element 0 moved up by one ulp."""
    from ds4py.forward_cpu import CpuEngine

    class Nudged(CpuEngine):
        def _embed(self, tokens):
            X = super()._embed(tokens)
            X[:, :, 0] = np.nextafter(X[:, :, 0], np.float32(np.inf))
            return X

    return Nudged


def main(n_pos: int = 4) -> None:
    from ds4py import synth
    from ds4py.forward_cpu import CpuEngine
    from ds4py.io.spec import open_model

    preset = os.environ.get("PRESET", "flash")
    path = f"/tmp/{preset}.gguf"
    if not os.path.exists(path):
        synth.build_model(path, preset, "per-role" if preset == "flash" else "none", 0)
    model = open_model(path)
    full = model.spec
    depths = [int(k) for k in os.environ.get("DEPTHS", f"1,2,4,{full.n_layer}").split(",")]
    cpu_only = os.environ.get("CPU_ONLY") == "1"
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 129_000, size=n_pos)]
    for k in depths:
        model.spec = truncated(full, k)
        cpu = CpuEngine(model, n_ctx=64)
        want = [np.asarray(cpu.decode(t), np.float64) for t in tokens]
        if cpu_only:
            again = (nudged_engine_class() if os.environ.get("NUDGE") == "1" else CpuEngine)(model, n_ctx=64)
            got = [np.asarray(again.decode(t), np.float64) for t in tokens]
        else:
            from ds4py.forward_cuda import CudaEngine
            from ds4py.io import sources
            source = sources.DeviceSource(model, progress=False)
            engine = CudaEngine(model, source, 64)
            got = [np.asarray(engine.decode(t), np.float64) for t in tokens]
            source.close()
        line = []
        for pos in range(n_pos):
            corr = np.corrcoef(got[pos], want[pos])[0, 1]
            max_rel = np.max(np.abs(got[pos] - want[pos])) / np.std(want[pos])
            line.append(f"{pos}: {corr:.6f}/{max_rel:.3f}")
        print(f"layers {k:3d}", "  ".join(line), flush=True)
    model.spec = full


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
