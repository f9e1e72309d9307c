"""Device-resident load rates against the machine's own ceilings, measured in the same run.

    python scripts/bench_load.py --out DIR [--flash PATH] [--raw-gb 20]

Ceilings: pinned host->device copy rate, O_DIRECT disk read rate (file dropped from the page
cache first), buffered warm read rate. Loads: the `make-model --preset flash --alias per-role`
file (3.4 GiB, built if missing) and an unaliased raw file of --raw-gb GB, each warm (in the page
cache) by both load paths and cold (pages dropped) with O_DIRECT and buffered reads. Every result
is appended to DIR/bench_load.json as it is measured, and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ds4py.io import diskio, gpu, layout, sources

GB, GiB, MiB = 10 ** 9, 1 << 30, 1 << 20
RESULTS: dict = {}


def record(key: str, value, out_dir: str) -> None:
    RESULTS[key] = value
    print(f"{key}: {value}", flush=True)
    with open(os.path.join(out_dir, "bench_load.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def pinned_h2d_gbps(nbytes: int = GiB, reps: int = 5) -> float:
    host = gpu.pinned_bytes(nbytes)
    host[:] = 7
    dev = gpu.device_bytes(nbytes)
    stream = gpu.Stream()
    best = 0.0
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        gpu.copy_htod_async(gpu.device_ptr(dev), gpu.host_addr(host), nbytes, stream)
        stream.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / GB)
    stream.close()
    del dev, host
    gpu.release_deferred()
    return best


def drop_file(path: str, mm=None) -> float:
    import gc
    gc.collect()             # a mapping kept alive by a stray view would pin its pages
    fd = os.open(path, os.O_RDONLY)
    try:
        diskio.drop_pages(fd, 0, os.fstat(fd).st_size, mm, granule=diskio.DROP_GRANULE)
    finally:
        os.close(fd)
    return _residency(path)


def _residency(path: str) -> float:
    import mmap
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        try:
            return diskio.residency(mm)
        finally:
            mm.close()
    finally:
        os.close(fd)


def read_rate_gbps(path: str, direct: bool, threads: int, limit: int | None = None, block: int = 64 * MiB) -> float:
    """Read the file (or its first `limit` bytes) with `threads` readers; GB/s."""
    size = os.path.getsize(path) if limit is None else min(limit, os.path.getsize(path))
    blocks = [(off, min(block, size - off)) for off in range(0, size, block)]
    with diskio.FileReader(path, direct=direct, log=lambda s: None) as r:
        bufs = [diskio.aligned_empty(block + 2 * diskio.DIRECT_ALIGN) for _ in range(threads)]

        def work(i):
            for off, n in blocks[i::threads]:
                r.read_into(bufs[i], off, n)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        return size / (time.perf_counter() - t0) / GB


def load_raw(path: str, how: str, threads: int, chunk_mb: int = 64) -> sources.LoadStats:
    """Device-load the whole file as one interval, the way DeviceSource loads a model."""
    import mmap
    size = os.path.getsize(path)
    plan = layout.plan_arena([(0, size)])
    arena = gpu.device_bytes(diskio.align_up(plan.nbytes, 256))
    stream = gpu.Stream()
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    try:
        if how == "registered":
            stats = sources.upload_windows(gpu, mm, plan, gpu.device_ptr(arena), stream, chunk_mb * MiB)
        else:
            ring = [gpu.pinned_bytes(chunk_mb * MiB + 2 * diskio.DIRECT_ALIGN) for _ in range(4)]
            with diskio.FileReader(path, direct=(how == "direct"), log=print) as reader, \
                    ThreadPoolExecutor(threads) as pool:
                stats = sources.upload_staged(gpu, reader, plan, gpu.device_ptr(arena), stream, ring, pool, threads,
                                              chunk_mb * MiB)
        # spot check: the last 16 MiB on the device equal the file
        n = min(16 * MiB, size)
        back = arena[size - n:size].copy_to_host()
        assert np.array_equal(back, np.frombuffer(mm, np.uint8, n, size - n)), "device bytes differ from the file"
        return stats
    finally:
        mm.close()
        os.close(fd)
        stream.close()
        del arena
        gpu.release_deferred()


def load_model(path: str, load_path: str, direct: bool, threads: int) -> sources.LoadStats:
    from ds4py.io.spec import open_model
    m = open_model(path)
    try:
        src = sources.DeviceSource(m, load_path=load_path, direct_io=direct, io_threads=threads, progress=False,
                                   log=print)
        try:
            assert src.regime == "device"
            name = "blk.42.ffn_down_exps.weight" if "blk.42.ffn_down_exps.weight" in m.file.tensors else "output.weight"
            arena, off = src.dense(name)
            n = min(m.file.tensors[name].nbytes, 16 * MiB)
            assert np.array_equal(arena[off:off + n].copy_to_host(), m.file.bytes_view(name)[:n])
            for il in range(m.spec.n_layer):
                src.fetch_experts(il, list(range(m.spec.n_used)))
            assert src.counters.h2d_request_bytes == 0
            return src.load_stats
        finally:
            src.close()
    finally:
        m.close()


def write_raw(path: str, nbytes: int) -> float:
    block = np.random.default_rng(0).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - t0) / GB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--flash", default="/tmp/flash-per-role.gguf")
    ap.add_argument("--raw", default="/tmp/raw-unaliased.bin")
    ap.add_argument("--raw-gb", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 4))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out, t = args.out, args.threads
    gpu.ensure_context()
    record("threads", t, out)
    record("pinned_h2d_GBps", round(pinned_h2d_gbps(), 2), out)

    if not os.path.exists(args.flash):
        from ds4py import synth
        t0 = time.perf_counter()
        synth.build_model(args.flash, "flash", "per-role", 0)
        record("flash_build_s", round(time.perf_counter() - t0, 1), out)
    size = os.path.getsize(args.flash)
    record("flash_file_GiB", round(size / GiB, 3), out)
    _ = read_rate_gbps(args.flash, direct=False, threads=t)           # make sure it is warm
    record("flash_residency_warm", round(_residency(args.flash), 3), out)
    record("warm_buffered_read_GBps", round(read_rate_gbps(args.flash, direct=False, threads=t), 2), out)
    record("warm_buffered_read_1thread_GBps", round(read_rate_gbps(args.flash, direct=False, threads=1), 2), out)
    for lp, direct in (("registered", False), ("staged", False)):
        s = load_model(args.flash, lp, direct, t)
        record(f"flash_warm_{lp}_GBps", round(s.gbps, 2), out)
    record("flash_residency_dropped", round(drop_file(args.flash), 3), out)
    record("disk_odirect_read_GBps", round(read_rate_gbps(args.flash, direct=True, threads=8), 2), out)
    for name, direct in (("odirect", True), ("buffered", False)):
        record(f"flash_residency_before_cold_{name}", round(drop_file(args.flash), 3), out)
        s = load_model(args.flash, "staged", direct, t)
        record(f"flash_cold_{name}_GBps", round(s.gbps, 2), out)

    raw = int(args.raw_gb * GB)
    if raw > 0:
        record("raw_write_GBps", round(write_raw(args.raw, raw), 2), out)
        record("raw_GB", round(raw / GB, 2), out)
        record("raw_residency_warm", round(_residency(args.raw), 3), out)
        for how in ("registered", "buffered"):
            s = load_raw(args.raw, how, t)
            record(f"raw_warm_{how}_GBps", round(s.gbps, 2), out)
        record("raw_residency_dropped", round(drop_file(args.raw), 3), out)
        record("raw_disk_odirect_read_GBps_first8GB", round(read_rate_gbps(args.raw, True, 8, limit=8 * GB), 2), out)
        for how in ("direct", "buffered"):
            record(f"raw_residency_before_cold_{how}", round(drop_file(args.raw), 3), out)
            s = load_raw(args.raw, how, t)
            record(f"raw_cold_{how}_GBps", round(s.gbps, 2), out)
        os.unlink(args.raw)

    r = RESULTS
    summary = {
        "flash_warm_best_vs_pinned": round(max(r["flash_warm_registered_GBps"], r["flash_warm_staged_GBps"])
                                           / r["pinned_h2d_GBps"], 3),
        "flash_cold_odirect_vs_disk": round(r["flash_cold_odirect_GBps"] / r["disk_odirect_read_GBps"], 3),
    }
    if raw > 0:
        summary["raw_warm_best_vs_pinned"] = round(max(r["raw_warm_registered_GBps"], r["raw_warm_buffered_GBps"])
                                                   / r["pinned_h2d_GBps"], 3)
        summary["raw_cold_odirect_vs_disk"] = round(r["raw_cold_direct_GBps"] / r["raw_disk_odirect_read_GBps_first8GB"], 3)
    record("summary", summary, out)


if __name__ == "__main__":
    sys.exit(main())
