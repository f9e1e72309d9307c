"""How far apart two engines may be inside and still give the same tiny-model logits.

The float64 reference (ds4py/reference.py) rounds to f32 only where ds4's numerics do (the Q8_0 /
Q8_K activation quantization, f16 cache rows, the FP8 / FP4 simulations). This script runs it
against itself with every matvec output and every attention output scaled by (1 + rel), for each
rel given, and prints max|Δlogit| / std per checked position (the positions of
tests/test_forward_cuda.py; * where the top-5 differs).

rel ~ 1e-16 models two engines whose internals are f64 and differ only in summation order; rel ~
1e-7 models two f32 engines (the CPU and GPU engines today). usage (CPU only, ~10 s a run):

    python scripts/reference_sensitivity.py 8.9e-16 2.4e-7
"""

import os
import sys

import numpy as np

from ds4py import reference as ref
from ds4py import synth
from ds4py.io.spec import open_model

CHECK_POSITIONS = (0, 2, 3, 10, 34, 40, 100, 127, 135)


def logits_at(path: str, tokens: list[int], rel: float) -> dict[int, np.ndarray]:
    matvec, attention = ref.matvec, ref.sink_attention
    if rel:
        ref.matvec = lambda w, name, x: matvec(w, name, x) * (1.0 + rel)
        ref.sink_attention = lambda *args: attention(*args) * (1.0 + rel)
    model = open_model(path)
    try:
        reference = ref.Reference(model)
        return {pos: np.asarray(logits, np.float64) for pos, tok in enumerate(tokens)
                if (logits := reference.decode(tok)) is not None and pos in CHECK_POSITIONS}
    finally:
        ref.matvec, ref.sink_attention = matvec, attention
        model.close()


def main() -> None:
    path = "/tmp/tiny-sensitivity.gguf"
    if not os.path.exists(path):
        synth.build_model(path, "tiny", "none", 0)
    rng = np.random.default_rng(0)          # the tokens of tests/test_forward_cuda.py
    tokens = [int(t) for t in rng.integers(0, 129_000, size=max(CHECK_POSITIONS) + 1)]
    base = logits_at(path, tokens, 0.0)
    for rel in [float(a) for a in sys.argv[1:]]:
        got = logits_at(path, tokens, rel)
        cells = []
        for pos in CHECK_POSITIONS:
            diff = np.max(np.abs(got[pos] - base[pos])) / np.std(base[pos])
            same_top5 = list(np.argsort(-got[pos])[:5]) == list(np.argsort(-base[pos])[:5])
            cells.append(f"{pos}:{diff:.1e}{'' if same_top5 else '*'}")
        print(f"rel {rel:.3g}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
