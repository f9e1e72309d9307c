"""Run a ds4py command and log every CUDA kernel compile (or disk-cache load) on stderr: which
kernel, how long it took, and whether it came before or after the engine's warm-up. On a machine
with an empty kernel cache this shows what a benchmark compiles inside its timed sections.

    python3 scripts/compile_log.py bench -m /tmp/flash.gguf --ctx-start 2048 --ctx-max 4096 ...

Arguments are `ds4py`'s. Lines start with "[compile]"; a summary of the kernels compiled after
the warm-up ends the log.
"""
import sys
import time

T0 = time.perf_counter()
LATE = []          # (kernel, seconds) compiled after the warm-up
PHASE = ["before warm-up"]


def _install() -> None:
    from numba.cuda.dispatcher import CUDADispatcher

    from ds4py import forward_cuda

    compile_sig = CUDADispatcher.compile

    def logged_compile(self, sig):
        n_before = len(self.overloads)
        hits = sum(getattr(self, "_cache_hits", {}).values())
        t = time.perf_counter()
        result = compile_sig(self, sig)
        if len(self.overloads) > n_before:          # a new overload: compiled or loaded
            dt = time.perf_counter() - t
            name = self.py_func.__name__
            how = "loaded" if sum(getattr(self, "_cache_hits", {}).values()) > hits else "COMPILED"
            print(f"[compile] {time.perf_counter() - T0:8.2f} s  {dt:6.2f} s  {PHASE[0]:15s} {how:8s} {name}",
                  file=sys.stderr, flush=True)
            if PHASE[0] == "after warm-up":
                LATE.append((name, dt))
        return result

    CUDADispatcher.compile = logged_compile
    warm_up = forward_cuda.CudaEngine.warm_up

    def logged_warm_up(self):
        PHASE[0] = "in warm-up"
        try:
            warm_up(self)
        finally:
            PHASE[0] = "after warm-up"
            print(f"[compile] {time.perf_counter() - T0:8.2f} s  warm-up done", file=sys.stderr, flush=True)

    forward_cuda.CudaEngine.warm_up = logged_warm_up


def main() -> None:
    _install()
    from ds4py import cli
    sys.argv = ["ds4py"] + sys.argv[1:]
    try:
        cli.main()
    finally:
        total = sum(dt for _, dt in LATE)
        print(f"[compile] after the warm-up: {len(LATE)} kernels, {total:.2f} s: "
              + ", ".join(f"{n} {dt:.2f}" for n, dt in LATE), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
