"""Prefill speed of the flash preset (device-resident) under several kernel-knob configurations,
in one process, alternating (A B A B ...): the engine is loaded once, each configuration gets a
warm-up (numba compiles at first launch), then each rep prefills the same tokens from position 0.
A knob is an attribute of ds4py.kernels.cuda, or ops.NAME of ds4py.kernels.cuda_ops.

    python3 scripts/prefill_ab.py --knob _MMA_STAGED --values 0,1 --tokens 2048 --reps 2
    python3 scripts/prefill_ab.py --knob ops.ATTN_PREFILL_MMA --values 0,1
    python3 scripts/prefill_ab.py --set "_MMA_ST_MAGIC_C=0,_MMA_ST_CPASYNC=0" --set "_F16_TILED=0"

--knob/--values times one knob at each value; --set (repeatable) times the defaults and then each
configuration of NAME=INT,... items. A kernel compiled inside a timed prefill (one the
--warm-tokens prefill did not launch) is printed with its configuration and rep.
"""
import argparse
import time


def compiled_kernels() -> set:
    """(kernel, argument types) of every compiled kernel of ds4py.kernels.cuda (module kernels and
    built ones) and cuda_ops: what a timed prefill adds to it was compiled inside the timing."""
    from ds4py.kernels import cuda as CK, cuda_ops as ops
    named = [(repr(key), k) for key, k in list(CK._KERNELS.items()) + list(CK._ROWDOTS.items())]
    named += [(f"{mod.__name__}.{name}", k) for mod in (CK, ops) for name, k in vars(mod).items()]
    return {(name, str(sig)) for name, k in named for sig in getattr(k, "overloads", None) or {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--knob", help="one knob, timed at each of --values")
    ap.add_argument("--values", help="comma-separated ints")
    ap.add_argument("--set", action="append", default=[], help="NAME=INT,... (repeatable)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warm-tokens", type=int, default=64, help="each configuration's untimed prefill")
    args = ap.parse_args()

    from numba import cuda

    from flash_engine import apply_source_knobs, knob_configs, knob_defaults, knob_label, open_flash, set_knobs

    if args.knob:                                 # checked before the model is built and loaded
        configs = knob_configs([f"{args.knob}={v}" for v in args.values.split(",")])[1:]
    elif args.set:
        configs = knob_configs(args.set)
    else:
        raise SystemExit("give --knob and --values, or --set")
    defaults = knob_defaults(configs)
    engine, ids = open_flash(args.model, args.tokens + 64)
    ids = ids[:args.tokens]
    start = engine.snapshot()
    rates = [[] for _ in configs]
    try:
        for config in configs:                    # compile each configuration's kernels before any timing
            set_knobs({**defaults, **config})
            apply_source_knobs(engine)
            engine.restore(start)
            engine.prefill(ids[:args.warm_tokens])
            cuda.synchronize()
        for rep in range(args.reps):
            for k, config in enumerate(configs):
                set_knobs({**defaults, **config})
                apply_source_knobs(engine)
                engine.restore(start)
                cuda.synchronize()
                before = compiled_kernels()
                t0 = time.perf_counter()
                engine.prefill(ids)
                cuda.synchronize()
                rates[k].append(len(ids) / (time.perf_counter() - t0))
                for name, sig in sorted(compiled_kernels() - before):
                    print(f"{knob_label(config)}, rep {rep + 1}: compiled inside the timed prefill: {name} {sig}")
    finally:
        set_knobs(defaults)
        apply_source_knobs(engine)
    for config, r in zip(configs, rates):
        print(f"{knob_label(config)}: prefill {len(ids)} tokens " + " ".join(f"{x:8.1f}" for x in r) + " tok/s")


if __name__ == "__main__":
    main()
