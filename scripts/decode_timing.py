"""Where the decode loop's time goes beyond the captured step (flash preset, device-resident).

After a prompt of --prompt tokens, from the same saved state each time:
  replay   the step graph replayed --gen times back to back, device events around each replay
           (per-position step times: a slow position shows here);
  run      decode_greedy_run for --gen tokens, host time per yielded token (what the bench counts);
  serial   decode_greedy --gen times (each step waits for the one before).
Prints one line per variant: mean, median, min, max ms per token.
"""

import argparse
import statistics
import time


def summary(name: str, ms: list[float]) -> str:
    return (f"{name:8s} mean {statistics.fmean(ms):7.3f}  median {statistics.median(ms):7.3f}  "
            f"min {min(ms):7.3f}  max {max(ms):7.3f} ms/token over {len(ms)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()

    from numba import cuda

    from flash_engine import open_flash

    engine, ids = open_flash(args.model, args.prompt + 4 * args.gen + 16)
    engine.prefill(ids[:args.prompt])
    first = ids[args.prompt]
    saved, n_past = engine.snapshot(), engine.n_past
    engine.decode_greedy(first)                    # compile, capture, warm
    for _ in range(2):
        list(engine.decode_greedy_run(first, args.gen))

    def reset():
        engine.restore(saved)

    reset()
    engine.decode_greedy(first)                    # token and position into the device buffers
    graph = engine._graphs[0]
    events = [cuda.event() for _ in range(args.gen + 1)]
    events[0].record(engine.stream)
    for k in range(args.gen):
        graph.replay()
        events[k + 1].record(engine.stream)
    events[-1].synchronize()
    replay = [cuda.event_elapsed_time(events[k], events[k + 1]) for k in range(args.gen)]

    reset()
    run, t_prev = [], time.perf_counter()
    for _ in engine.decode_greedy_run(first, args.gen + 1):
        now = time.perf_counter()
        run.append((now - t_prev) * 1e3)
        t_prev = now
    run = run[1:]

    reset()
    serial, token = [], first
    for _ in range(args.gen):
        t0 = time.perf_counter()
        token = engine.decode_greedy(token)
        serial.append((time.perf_counter() - t0) * 1e3)

    print(f"decode at position {n_past}..{n_past + args.gen}:")
    for name, ms in (("replay", replay), ("run", run), ("serial", serial)):
        print(summary(name, ms))
    print("replay ms by step:", " ".join(f"{x:.2f}" for x in replay))
    print("run ms by step:   ", " ".join(f"{x:.2f}" for x in run))


if __name__ == "__main__":
    main()
