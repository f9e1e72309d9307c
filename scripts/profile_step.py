"""Per-kernel device time of one decode step (or, with --prefill N, of one N-token prefill chunk)
(flash preset, device-resident), for ncu.

Run under Nsight Compute with the profiler range off at start:
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 scripts/profile_step.py > ncu.csv
then `python3 scripts/profile_step.py --summarize ncu.csv` sums the time per kernel name.
Only the step between cuda.profile_start() and cuda.profile_stop() is profiled (graph nodes are
profiled one by one, so per-kernel times exclude the graph's launch gaps).
"""

import argparse
import collections
import csv
import re
import sys


def run(model_path: str, n_prompt: int, n_prefill: int = 0) -> None:
    from numba import cuda

    from flash_engine import open_flash

    n_ctx = max(4096, n_prompt + n_prefill + 64)
    engine, ids = open_flash(model_path, n_ctx, corpus_chars=max(20_000, 5 * n_ctx))   # the corpus: ~3.2 chars a token
    engine.prefill(ids[:n_prompt])
    engine.decode_greedy(ids[n_prompt])           # graph captured and warm
    cuda.synchronize()
    cuda.profile_start()
    if n_prefill:
        engine.prefill(ids[n_prompt + 1:n_prompt + 1 + n_prefill])
    else:
        engine.decode_greedy(ids[n_prompt + 1])
    cuda.synchronize()
    cuda.profile_stop()
    what = f"a {n_prefill}-token prefill ending" if n_prefill else "one step"
    print(f"profiled {what} at position", engine.n_past - 1, file=sys.stderr)


def kernel_name(full: str) -> str:
    """`cuda_ops::hc_post[v37,cw51...](...)` -> `cuda_ops.hc_post`; closures built per shape keep
    their specialisation number: `_q8_0_kernel.q8_0_rows#v8`."""
    m = re.search(r"(\w+)::(\w+)\[v(\d+)", full)
    if not m:
        return full.split("(")[0][:60]
    name = f"{m.group(1)}.{m.group(2)}"
    return name + f"#v{m.group(3)}" if m.group(1).startswith("_") else name


def summarize(path: str) -> None:
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    total, count = collections.Counter(), collections.Counter()
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit)
        if scale is None:
            raise SystemExit(f"unknown time unit {unit!r} in {path}")
        name = kernel_name(row["Kernel Name"])
        total[name] += value * scale
        count[name] += 1
    all_us = sum(total.values())
    print(f"{sum(count.values())} kernels, {all_us / 1e3:.2f} ms of kernel time")
    print(f"{'kernel':40s} {'launches':>8s} {'total us':>10s} {'mean us':>8s} {'share':>6s}")
    for name, us in total.most_common():
        print(f"{name:40s} {count[name]:8d} {us:10.1f} {us / count[name]:8.2f} {us / all_us:6.1%}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens")
    ap.add_argument("--summarize")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        run(args.model, args.prompt, args.prefill)
