#!/usr/bin/env python3
"""Benchmark the CUDA kernels on the GPU (see ds4py.kernels.bench): writes JSON, prints a table.

usage: python3 scripts/bench_kernels.py [--out bench.json] [--parts dense,moe,layer,prefill]
                                       [--knobs "NAME=INT,..."]

--knobs sets kernels.cuda knobs for the whole run (flash_engine's knob texts), so that a part such
as scale_moe times a variant: --knobs "_RPB_GATE_UP=4,_NW_GATE_UP=8,_REGS_GU_HALVES=64".
(Not _IQ2_REPACKED_GATE_UP: its rows must be rewritten first, which only the tune_* sweeps do.)
"""

import argparse
import sys

from ds4py.kernels.bench import run_kernel_bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json", help="JSON results file")
    ap.add_argument("--parts", default="dense,moe,layer,prefill")
    ap.add_argument("--knobs", default="", help='kernels.cuda knobs for the run, "NAME=INT,..."')
    args = ap.parse_args(argv)
    if args.knobs:
        from flash_engine import knob_configs, set_knobs
        config = knob_configs([args.knobs])[1]
        if "_IQ2_REPACKED_GATE_UP" in config:
            raise SystemExit("--knobs: _IQ2_REPACKED_GATE_UP needs rewritten rows (the tune_* sweeps do that)")
        set_knobs(config, rebuild=True)
        print(f"knobs: {args.knobs}")
    res = run_kernel_bench(args.out, parts=tuple(args.parts.split(",")), meta={"knobs": args.knobs})
    print(f"wrote {args.out} ({res['bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
