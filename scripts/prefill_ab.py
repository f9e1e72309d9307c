"""Prefill speed of the flash preset (device-resident) with a kernels.cuda knob (or, as
ops.NAME, a kernels.cuda_ops one) at each of several
values, in one process, alternating (A B A B ...): the engine is loaded once, each value gets a
warm-up (numba compiles at first launch), then each rep prefills the same tokens from position 0.

    python3 scripts/prefill_ab.py --knob _MMA_STAGED --values 0,1 --tokens 2048 --reps 2
    python3 scripts/prefill_ab.py --knob ops.ATTN_PREFILL_MMA --values 0,1
"""
import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--knob", required=True, help="an attribute of ds4py.kernels.cuda, or ops.NAME of ds4py.kernels.cuda_ops")
    ap.add_argument("--values", required=True, help="comma-separated ints")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    from numba import cuda

    from ds4py.kernels import cuda as knobs, cuda_ops
    from flash_engine import open_flash

    if args.knob.startswith("ops."):
        knobs, args.knob = cuda_ops, args.knob[4:]
    if not hasattr(knobs, args.knob):            # before the model is built and loaded
        raise SystemExit(f"{knobs.__name__} has no {args.knob}")
    values = [int(v) for v in args.values.split(",")]
    saved = getattr(knobs, args.knob)
    engine, ids = open_flash(args.model, args.tokens + 64)
    ids = ids[:args.tokens]
    start = engine.snapshot()
    rates = {v: [] for v in values}
    try:
        for v in values:                       # compile each value's kernels before any timing
            setattr(knobs, args.knob, type(saved)(v))
            engine.restore(start)
            engine.prefill(ids[:64])
            cuda.synchronize()
        for _ in range(args.reps):
            for v in values:
                setattr(knobs, args.knob, type(saved)(v))
                engine.restore(start)
                cuda.synchronize()
                t0 = time.perf_counter()
                engine.prefill(ids)
                cuda.synchronize()
                rates[v].append(len(ids) / (time.perf_counter() - t0))
    finally:
        setattr(knobs, args.knob, saved)
    for v in values:
        print(f"{args.knob}={v}: prefill {len(ids)} tokens " + " ".join(f"{r:8.1f}" for r in rates[v]) + " tok/s")


if __name__ == "__main__":
    main()
