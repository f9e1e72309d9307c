"""One MoE decode step (flash shapes: 6 of 256 experts, IQ2_XXS gate/up, Q2_K down) per variant of
kernels.cuda's knobs, each inside its own profiler range, for Nsight Compute (no engine, no model
file: kbench's random arena). Variants are "NAME=V,NAME=V" strings; "" is the shipped kernels.

    bash scripts/ncu_moe_variants.sh "" "_GU_HALVES=0" "_GU_HALVES=0,_IQ2_REPACKED_GATE_UP=1"

(the .sh beside it runs ncu with stall reasons, pipes and the SASS mix). _IQ2_REPACKED_GATE_UP
rewrites the arena's gate and up experts by iq2_xxs_relayout first (and back after the variant),
as kbench's sweeps do.
"""
import sys

import numpy as np
from numba import cuda

from ds4py.kernels import bench as KB
from ds4py.kernels import cuda as CK

RELAYOUTS = {"_IQ2_REPACKED_GATE_UP": CK.iq2_xxs_relayout}


def parse(variant: str) -> dict:
    knobs = {}
    for item in filter(None, variant.split(",")):
        name, value = item.split("=")
        knobs[name.strip()] = type(getattr(CK, name.strip()))(int(value))
    return knobs


def main(variants):
    moe = KB._moe_setup(np.random.default_rng(0))
    n_rows = moe["n_exp"] * moe["n_ff"]
    for variant in variants:
        knobs = parse(variant)
        saved = {n: getattr(CK, n) for n in knobs}
        relayout = [RELAYOUTS[n] for n, v in knobs.items() if n in RELAYOUTS and v]
        for fn in relayout:
            for o in (moe["og"], moe["ou"]):
                fn(moe["arena"].buf, o, n_rows, moe["n_embd"])
        for n, v in knobs.items():
            setattr(CK, n, v)
        CK._KERNELS.clear()
        CK._ROWDOTS.clear()
        step = KB._MoEStep(moe, np.random.default_rng(1))
        step.full(0)                      # compiled and warm
        cuda.synchronize()
        cuda.profile_start()
        step.full(0)
        cuda.synchronize()
        cuda.profile_stop()
        print(f"profiled: {variant or 'shipped'}", file=sys.stderr)
        for fn in relayout:
            for o in (moe["og"], moe["ou"]):
                fn(moe["arena"].buf, o, n_rows, moe["n_embd"], to_repacked=False)
        for n, v in saved.items():
            setattr(CK, n, v)


if __name__ == "__main__":
    main(sys.argv[1:] or [""])
