"""Where the host's time goes while it enqueues prefill chunks (flash preset, device-resident).

    python3 scripts/prefill_host_profile.py --tokens 1024 > host_profile.txt

A prefill chunk is launched eagerly from Python (~1,850 launches per 512 tokens); when the host
takes longer to enqueue them than the GPU takes to run them, prefill is host-bound. This prints
cProfile's top functions for --tokens of prefill after warm_up, and calibrates numba's own launch
cost: a trivial kernel launched with 1 and with 12 array arguments.
"""
import argparse
import cProfile
import pstats
import time


def launch_cost_us(n_args: int, reps: int = 2000) -> float:
    import numpy as np
    from ds4py.kernels import compat  # noqa: F401  (the numpy shim before the first CUDA compile)
    from numba import cuda

    arrays = [cuda.device_array(16, np.float32) for _ in range(n_args)]
    src = "def k({0}):\n    if cuda.threadIdx.x == 0:\n        a0[0] = 1.0\n".format(
        ", ".join(f"a{i}" for i in range(n_args)))
    scope = {"cuda": cuda}
    exec(src, scope)
    kernel = cuda.jit(scope["k"])
    stream = cuda.stream()
    kernel[1, 32, stream](*arrays)
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        kernel[1, 32, stream](*arrays)
    elapsed = time.perf_counter() - t0
    stream.synchronize()
    return elapsed / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()

    from numba import cuda

    from flash_engine import open_flash

    for n in (1, 4, 12):
        print(f"numba launch, {n:2d} array args: {launch_cost_us(n):6.1f} us per launch", flush=True)
    engine, ids = open_flash(args.model, args.tokens + 64)
    engine.warm_up()
    engine.reset()
    engine.prefill(ids[:args.tokens])          # every buffer grown to its chunk size
    engine.reset()
    cuda.synchronize()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    engine.prefill(ids[:args.tokens])
    profile.disable()
    print(f"prefill {args.tokens} tokens: {time.perf_counter() - t0:.3f} s under cProfile", flush=True)
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
