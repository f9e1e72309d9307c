"""One MoE decode step (flash shapes: 6 of 256 experts, IQ2_XXS gate/up, Q2_K down) with the shipped
kernels, then one per "NAME=V,NAME=V" configuration of kernels.cuda's knobs (flash_engine's knob
texts), each inside its own profiler range, for Nsight Compute (no engine, no model file: kbench's
random arena):

    bash scripts/ncu_moe_variants.sh "_GU_HALVES=0" "_GU_HALVES=0,_IQ2_REPACKED_GATE_UP=1"

(the .sh beside it runs ncu with stall reasons, pipes and the SASS mix). _IQ2_REPACKED_GATE_UP
rewrites the arena's gate and up experts by iq2_xxs_relayout first (and back after the
configuration), as kbench's sweeps do.
"""
import sys

import numpy as np
from numba import cuda

from ds4py.kernels import bench as KB
from ds4py.kernels import cuda as CK
from flash_engine import knob_configs, knob_defaults, knob_label, set_knobs


def relayout(moe, to_repacked: bool) -> None:
    for o in (moe["og"], moe["ou"]):
        CK.iq2_xxs_relayout(moe["arena"].buf, o, moe["n_exp"] * moe["n_ff"], moe["n_embd"], to_repacked)


def main(texts):
    moe = KB._moe_setup(np.random.default_rng(0))
    configs = knob_configs(texts)
    defaults = knob_defaults(configs)
    for config in configs:
        repacked = bool(config.get("_IQ2_REPACKED_GATE_UP"))
        if repacked:
            relayout(moe, True)
        set_knobs(dict(defaults, **config), rebuild=True)
        step = KB._MoEStep(moe, np.random.default_rng(1))
        step.full(0)                      # compiled and warm
        cuda.synchronize()
        cuda.profile_start()
        step.full(0)
        cuda.synchronize()
        cuda.profile_stop()
        print(f"profiled: {knob_label(config)}", file=sys.stderr)
        if repacked:
            relayout(moe, False)


if __name__ == "__main__":
    main(sys.argv[1:])
