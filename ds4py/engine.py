"""Model + options -> a running engine: the one place `run` and `bench` get theirs from.

The data flow of the design: the model (io.spec) and the machine facts go to the detector, which
picks the regime; the weight source for that regime is opened (io.sources); the CPU engine runs on
the mmap, the CUDA engine on the source's device arena. The engine never learns the regime.
Between the decision and the source, worker processes compile the kernels (CUDA, or the CPU
engine's) a model of its shape needs (kernels/precompile.py), unless the disk cache holds them.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

from ds4py.errors import ResourceError


@dataclass
class Loaded:
    engine: object
    source: object
    decision: object
    kind: str                 # "cpu" | "cuda"
    kernel_key: str | None = None    # the kernels' manifest key (kernels/precompile.py)

    def close(self) -> None:
        if self.kernel_key is not None:          # what this run built, for the next one's workers
            from ds4py.kernels import precompile
            precompile.record(self.kernel_key, target=self.kind)
        close = getattr(self.source, "close", None)
        if close:
            close()


def kernel_target(regime: str) -> str:
    """Whose kernels a regime runs: "cpu" (the CPU engine's) or "cuda"."""
    return "cpu" if regime == "cpu" else "cuda"


def kernel_key(model, target: str = "cuda") -> str:
    """The manifest key of the model's kernels for target "cuda" or "cpu" (the CPU engine's)."""
    from ds4py.kernels import precompile
    key = precompile.shape_key(model.spec, (t.ggml_type for t in model.file.tensors.values()))
    return "cpu;" + key if target == "cpu" else key


def kernel_plan(model, jobs: int, target: str = "cuda") -> dict:
    """What a run of this model on target will do about its kernels (`probe` prints it): key, the
    kernels a manifest records for its shape, whether the cache holds them for these sources, the
    worker count (jobs 0: auto), and whether workers compile them ahead ("ahead")."""
    return _plan_and_kernels(model, jobs, target)[0]


def _plan_and_kernels(model, jobs: int, target: str) -> tuple[dict, list]:
    """kernel_plan and the manifest's kernels it counted (compile_ahead hands them to the workers)."""
    from ds4py.kernels import precompile
    key = kernel_key(model, target)
    kernels = precompile.manifest_for(key)
    cached = precompile.compiled_for_these_sources(key)
    jobs = jobs or precompile.default_jobs()
    return ({"key": key, "target": target, "recorded": len(kernels), "cached": cached, "jobs": jobs,
             "ahead": len(kernels) > 0 and not cached and jobs > 1}, kernels)


def kernel_plan_text(plan: dict) -> str:
    if plan["cached"]:
        return "in the disk cache for these kernel sources (loaded in seconds)"
    if plan["ahead"]:
        return f"{plan['recorded']} kernels compiled ahead in {plan['jobs']} processes before the weights load"
    if plan["recorded"]:
        return f"{plan['recorded']} recorded kernels compiled at first use (--compile-jobs 1)"
    return "a shape not run before: compiled at first use (once)"


def compile_ahead(model, jobs: int, target: str = "cuda", *, attention_f64: bool = True, progress=True,
                  log=None) -> None:
    """The kernels a model of this shape built on target in an earlier run (or the package's
    manifest lists), compiled into the disk cache by worker processes unless they are already there
    (see kernel_plan); a first run of a new shape compiles at first use. attention_f64: the decode
    attention's arithmetic on this GPU (--attention resolved), whose kernel the workers compile
    whichever one the manifest names."""
    from ds4py.kernels import precompile
    plan, kernels = _plan_and_kernels(model, jobs, target)
    if not plan["ahead"]:
        return
    if target == "cuda":
        kernels = precompile.with_decode_attention(kernels, attention_f64)
    key, jobs = plan["key"], plan["jobs"]
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    with _count_bar(progress, f"compiling kernels ({jobs} processes)", len(kernels)) as advance:
        seconds, failures = precompile.compile_in_workers(kernels, jobs, on_done=advance)
    log(f"ds4py: compiled {len(kernels)} {'CPU' if target == 'cpu' else 'CUDA'} kernels in {jobs} processes "
        f"in {seconds:.1f} s (kept in the disk cache for the next runs)")
    if failures:
        log(f"ds4py: {len(failures)} kernels will compile at first use instead ({failures[0]})")
    else:
        precompile.record(key, kernels=[])      # compiled for these sources: no workers next time


@contextmanager
def _count_bar(enabled, description: str, total: int):
    """Yield advance(n) of a rich M/N bar on stderr (enabled True), or a no-op."""
    if enabled is not True:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, advance=n)


def open_engine(model, weights, *, progress=True, log=None) -> Loaded:
    """Decide the regime, load the weights and build the matching engine."""
    from ds4py.io.detect import decode_attention
    from ds4py.io.sources import load_weights

    def before_open(decision):
        cc = decision.gpu.compute_capability if decision.gpu else None
        compile_ahead(model, weights.compile_jobs, kernel_target(decision.regime),
                      attention_f64=decode_attention(weights.attention, cc)[0], progress=progress, log=log)

    source, decision = load_weights(model, weights, progress=progress, log=log, before_open=before_open)
    if decision.regime == "cpu":
        from ds4py.forward_cpu import CpuEngine
        return Loaded(CpuEngine(model, source, n_ctx=weights.n_ctx), source, decision, "cpu",
                      kernel_key(model, "cpu"))
    from ds4py.forward_cuda import CudaEngine
    try:
        engine = CudaEngine(model, source, weights.n_ctx, prefill_chunk=weights.prefill_chunk,
                            pdl=not weights.no_pdl, attention=weights.attention)
    except Exception as e:                 # numba's CudaAPIError for an allocation, mostly
        source.close()
        if "OUT_OF_MEMORY" in str(e) or "out of memory" in str(e).lower():
            raise ResourceError(f"not enough VRAM for the KV state and scratch at --ctx {weights.n_ctx} "
                                f"({e}); lower --ctx or --gpu-vram") from None
        raise
    return Loaded(engine, source, decision, "cuda", kernel_key(model))
