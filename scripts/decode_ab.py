"""Decode step time of the flash preset (device-resident) with kernels.cuda knobs at other values,
in one process, alternating A B A B: each configuration recaptures the step graph, then replays
it --gen times from the same saved state (device events around the replays).

    python3 scripts/decode_ab.py --set "_CONST_STEPS_GATE_UP=1,_R_DOWN_SLOTS=8" --reps 3

A configuration is a comma-separated list of NAME=INT (attributes of ds4py.kernels.cuda, ops.NAME
of ds4py.kernels.cuda_ops, engine.NAME, or sources.SCALES_LAST=0: the dense Q8_0 matrices back in
the file's layout); the first one is always the defaults. Also checks that every
configuration gives the same logits.
"""
import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--set", action="append", required=True, help="NAME=INT,... (repeatable)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import numpy as np
    from numba import cuda

    from flash_engine import apply_source_knobs, knob_configs, knob_defaults, knob_label, open_flash, set_knobs

    configs = knob_configs(args.set)
    defaults = knob_defaults(configs)
    engine, ids = open_flash(args.model, args.prompt + args.gen + 16)
    engine.prefill(ids[:args.prompt])
    first = ids[args.prompt]
    saved = engine.snapshot()
    times = [[] for _ in configs]
    logits = [None] * len(configs)
    for _ in range(args.reps):
        for k, config in enumerate(configs):
            set_knobs({**defaults, **config}, rebuild=True)   # compiled while the graph is captured
            apply_source_knobs(engine)
            engine._graphs = None                  # recaptured with this configuration's kernels
            engine.restore(saved)
            logits[k] = np.array(engine.decode(first))
            engine.restore(saved)
            engine.decode_greedy(first)             # token and position into the device buffers
            graph = engine._graphs[0]
            start, end = cuda.event(), cuda.event()
            start.record(engine.stream)
            for _ in range(args.gen):
                graph.replay()
            end.record(engine.stream)
            end.synchronize()
            times[k].append(cuda.event_elapsed_time(start, end) / args.gen)
    set_knobs(defaults, rebuild=True)
    for k, config in enumerate(configs):
        same = np.array_equal(logits[k], logits[0])
        label = knob_label(config)
        print(f"{label:60s} step ms " + " ".join(f"{t:.3f}" for t in times[k])
              + f"  ({'same logits' if same else 'LOGITS DIFFER'})", flush=True)


if __name__ == "__main__":
    main()
