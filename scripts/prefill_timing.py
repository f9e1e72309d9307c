"""Wall time of each prefill chunk of the flash preset (device-resident), repeated in one process:
does the bench's first prefill pay a one-time cost that later ones do not?

    python3 scripts/prefill_timing.py --tokens 4096 --reps 3

After engine.warm_up() (what `ds4py bench` runs before its clock), each rep resets the state and
prefills --tokens from position 0 one --chunk at a time, synchronizing after each chunk; prints ms
per chunk and tok/s for the first 2,048 tokens and for the rest.
"""
import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-gc", action="store_true", help="also run the reps with the garbage collector off")
    ap.add_argument("--bench-like", action="store_true",
                    help="ds4py bench's sequence instead: prefill 2k, snapshot, greedy probe, restore, "
                         "prefill 2k..4k; per-chunk GPU times from events, no sync between chunks")
    ap.add_argument("--numba-launch", action="store_true",
                    help="also run the reps through numba's own launch path (kernels/launch.py off)")
    args = ap.parse_args()
    import gc

    from numba import cuda

    from flash_engine import open_flash

    engine, ids = open_flash(args.model, args.tokens + 64)
    ids = ids[:args.tokens]
    t0 = time.perf_counter()
    engine.warm_up()
    print(f"warm_up {time.perf_counter() - t0:.2f} s", flush=True)
    head = engine._head
    enqueued = []

    def timed_head(b):                       # the chunk's last launches: the host is done enqueuing
        enqueued.append(time.perf_counter())
        return head(b)

    engine._head = timed_head
    if args.bench_like:
        bench_like(engine, ids, enqueued)
        return
    from ds4py.kernels import launch
    modes = [("memo", False)] + ([("memo", True)] if args.no_gc else []) + \
        ([("numba", False)] if args.numba_launch else [])
    for rep in range(args.reps * len(modes)):
        mode, gc_off = modes[rep // args.reps]
        if mode == "numba":
            launch.uninstall()
        if gc_off:
            gc.collect()
            gc.disable()
        engine.reset()
        chunk_ms, host_ms = [], []
        for start in range(0, len(ids), args.chunk):
            cuda.synchronize()
            t0 = time.perf_counter()
            engine.prefill(ids[start:start + args.chunk])
            cuda.synchronize()
            chunk_ms.append((time.perf_counter() - t0) * 1e3)
            host_ms.append((enqueued[-1] - t0) * 1e3)
        gc.enable()
        per = args.chunk
        first = min(len(chunk_ms), 2048 // per)
        rate_2k = first * per / sum(chunk_ms[:first]) * 1e3
        rest = chunk_ms[first:]
        rate_rest = len(rest) * per / sum(rest) * 1e3 if rest else 0.0
        print(f"rep {rep} ({mode} launch{', gc off' if gc_off else ''}): chunks ms " + " ".join(f"{m:.1f}" for m in chunk_ms)
              + " | host enqueue ms " + " ".join(f"{m:.1f}" for m in host_ms)
              + f" | 0..2k {rate_2k:.1f} tok/s, 2k..{len(ids)} {rate_rest:.1f} tok/s", flush=True)
        if mode == "memo":
            print("   launch memo:", launch.stats, f"{len(launch._launches)} entries, {len(launch._views)} views",
                  flush=True)


def bench_like(engine, ids, enqueued) -> None:
    """The bench's order of work, with an event and a host time at the start of every chunk."""
    from numba import cuda

    from ds4py.bench import probe_decode
    embed = engine._embed
    marks = []

    def marked_embed(b):
        event = cuda.event()
        event.record(engine.stream)
        marks.append((time.perf_counter(), event))
        return embed(b)

    engine._embed = marked_embed

    def timed_prefill(tokens, label):
        marks.clear()
        t0 = time.perf_counter()
        logits = engine.prefill(tokens)
        wall = time.perf_counter() - t0
        end = cuda.event()
        end.record(engine.stream)
        end.synchronize()
        gpu = [cuda.event_elapsed_time(a[1], b[1]) for a, b in zip(marks, marks[1:] + [(None, end)])]
        host = [(m[0] - t0) * 1e3 for m in marks] + [(enqueued[-1] - t0) * 1e3]
        print(f"{label}: {len(tokens) / wall:.1f} tok/s, wall {wall * 1e3:.1f} ms; chunk GPU ms "
              + " ".join(f"{g:.1f}" for g in gpu) + "; host at chunk starts, head ms "
              + " ".join(f"{h:.1f}" for h in host), flush=True)
        return logits

    engine.reset()
    logits = timed_prefill(ids[:2048], "prefill 0..2048")
    snap = engine.snapshot()
    total, _ = probe_decode(engine, logits, 32, -1)
    print(f"probe 32 tokens {total * 1e3:.1f} ms", flush=True)
    engine.restore(snap)
    timed_prefill(ids[2048:4096], "prefill 2048..4096")
    engine.reset()
    timed_prefill(ids[:2048], "again 0..2048")
    timed_prefill(ids[2048:4096], "again 2048..4096 (no probe)")


if __name__ == "__main__":
    main()
