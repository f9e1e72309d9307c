#!/usr/bin/env python3
"""Benchmark the CUDA kernels on the GPU (see ds4py.kernels.bench): writes JSON, prints a table.

usage: python3 scripts/bench_kernels.py [--out bench.json] [--parts dense,moe,layer,prefill]
"""

import argparse
import sys

from ds4py.kernels.bench import run_kernel_bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json", help="JSON results file")
    ap.add_argument("--parts", default="dense,moe,layer,prefill")
    args = ap.parse_args(argv)
    res = run_kernel_bench(args.out, parts=tuple(args.parts.split(",")))
    print(f"wrote {args.out} ({res['bench_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
