"""`ds4py bench`: ds4-bench's methodology and CSV, for any engine (CPU or GPU).

One model load; the prompt file tokenized once; for each context frontier: an incremental prefill
to the frontier (only the new interval is timed), a KV snapshot when more frontiers follow, a
greedy probe of `gen_tokens` that never stops at EOS (each step timed, the first one separately),
then the snapshot restored. The CSV has exactly ds4-bench's 9 columns (weight-residency.md §4).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ds4py.errors import Ds4Error

CSV_HEADER = ("ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,gen_first_ms,"
              "gen_steady_tokens,gen_steady_tps,kvcache_bytes")


@dataclasses.dataclass
class BenchRow:
    ctx_tokens: int
    prefill_tokens: int
    prefill_tps: float
    gen_tokens: int
    gen_tps: float
    gen_first_ms: float
    gen_steady_tokens: int
    gen_steady_tps: float
    kvcache_bytes: int

    def csv(self) -> str:
        return (f"{self.ctx_tokens},{self.prefill_tokens},{self.prefill_tps:.2f},{self.gen_tokens},"
                f"{self.gen_tps:.2f},{self.gen_first_ms:.3f},{self.gen_steady_tokens},"
                f"{self.gen_steady_tps:.2f},{self.kvcache_bytes}")


def frontiers(ctx_start: int, ctx_max: int, step_incr: int = 0, step_mul: float = 0.0) -> list[int]:
    """ctx_start, then +step_incr (or ×step_mul), up to ctx_max inclusive."""
    if ctx_start < 1 or ctx_max < ctx_start:
        raise Ds4Error(f"need 1 <= --ctx-start ({ctx_start}) <= --ctx-max ({ctx_max})")
    if step_incr and step_mul:
        raise Ds4Error("--step-incr and --step-mul both given; choose one")
    out = [ctx_start]
    while True:
        nxt = out[-1] + step_incr if step_incr else int(out[-1] * step_mul) if step_mul > 1 else ctx_max + 1
        if nxt > ctx_max or nxt <= out[-1]:
            break
        out.append(nxt)
    return out


def nbytes_of(obj, _seen=None) -> int:
    """Bytes of every numpy array reachable from a snapshot object (lists, tuples, dataclasses)."""
    seen = _seen if _seen is not None else set()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(nbytes_of(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(nbytes_of(o, seen) for o in vars(obj).values())
    return 0


def greedy(logits: np.ndarray, forbid: int) -> int:
    """Argmax with one token (EOS) excluded, first maximal index on ties."""
    masked = np.array(logits, dtype=np.float32, copy=True)
    masked[forbid] = -np.inf
    return int(np.argmax(masked))


def probe_decode(engine, logits: np.ndarray, gen_tokens: int, eos: int) -> tuple[float, list[float]]:
    """Greedy decode of gen_tokens; returns (total seconds, per-step seconds)."""
    token = greedy(logits, eos)
    steps = []
    run = getattr(engine, "decode_greedy_run", None)
    if run is not None:            # the GPU engine: step k + 1 launched before token k is read
        t_prev = time.perf_counter()
        for _ in run(token, gen_tokens, forbid=eos):
            now = time.perf_counter()
            steps.append(now - t_prev)
            t_prev = now
        return sum(steps), steps
    fast = getattr(engine, "decode_greedy", None)
    for _ in range(gen_tokens):
        t0 = time.perf_counter()
        if fast is not None:
            token = fast(token, forbid=eos)
        else:
            token = greedy(engine.decode(token), eos)
        steps.append(time.perf_counter() - t0)
    return sum(steps), steps


def run_bench(engine, tokens: list[int], eos: int, points: list[int], gen_tokens: int,
              on_row=None) -> list[BenchRow]:
    if len(tokens) < points[-1]:
        raise Ds4Error(f"the prompt file gives {len(tokens)} tokens, fewer than --ctx-max {points[-1]}; "
                       f"use a longer file or a smaller --ctx-max")
    warm_up = getattr(engine, "warm_up", None)      # JIT engines: compile before the clock runs
    if warm_up is not None:
        warm_up()
    engine.reset()
    rows, done = [], 0
    for i, frontier in enumerate(points):
        t0 = time.perf_counter()
        logits = engine.prefill(tokens[done:frontier])
        prefill_s = time.perf_counter() - t0
        n_new = frontier - done
        done = frontier
        last = i == len(points) - 1
        snap = None if last else engine.snapshot()
        total_s, steps = probe_decode(engine, logits, gen_tokens, eos)
        if snap is not None:
            engine.restore(snap)
        steady = steps[1:]
        row = BenchRow(
            ctx_tokens=frontier, prefill_tokens=n_new, prefill_tps=n_new / prefill_s,
            gen_tokens=gen_tokens, gen_tps=gen_tokens / total_s if total_s else 0.0,
            gen_first_ms=steps[0] * 1e3 if steps else 0.0, gen_steady_tokens=len(steady),
            gen_steady_tps=len(steady) / sum(steady) if steady and sum(steady) else 0.0,
            kvcache_bytes=0 if snap is None else nbytes_of(snap))
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoded token reads: every dense tensor, one embedding row, and
    n_used/n_exp of each routed-expert tensor (the roofline numerator)."""
    from ds4py.io.spec import tensor_role
    s = model.spec
    total = 0
    for info in model.file.tensors.values():
        role = tensor_role(info.name)
        if role == "routed experts":
            total += info.nbytes * s.n_used // s.n_exp
        elif role == "embedding":
            total += info.nbytes // s.n_vocab
        elif info.name.endswith("tid2eid.weight"):
            total += info.nbytes // s.n_vocab
        else:
            total += info.nbytes
    return total


def copy_ceiling(kind: str) -> tuple[float, str]:
    """The bandwidth ceiling measured now: HBM copy on the GPU, a RAM copy on the CPU.
    Bytes read + written per second, and what was measured."""
    if kind == "cuda":
        from ds4py.kernels.bench import Timer, copy_bandwidth
        bw, _ = copy_bandwidth(Timer(), 1 << 30)
        return bw, "device copy (1 GiB, read+write)"
    n = 256 << 20
    src = np.ones(n, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best, "RAM copy (256 MiB, read+write, one thread)"


def bench_table(rows: list[BenchRow], regime: str, bytes_per_token: int, ceiling: float, what: str):
    """A rich table: rates and decode as a fraction of the roofline (bytes/token ÷ ceiling)."""
    from rich.table import Table
    roof = ceiling / bytes_per_token
    table = Table(title=f"ds4py bench — weights: {regime}; roofline {roof:.1f} tok/s = "
                        f"{bytes_per_token / 1e9:.2f} GB/token ÷ {ceiling / 1e9:.0f} GB/s {what}")
    for col in ("ctx", "prefill t/s", "gen t/s", "steady t/s", "first ms", "GB/s", "of roofline"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.ctx_tokens), f"{r.prefill_tps:.1f}", f"{r.gen_tps:.2f}", f"{r.gen_steady_tps:.2f}",
                      f"{r.gen_first_ms:.1f}", f"{r.gen_steady_tps * bytes_per_token / 1e9:.1f}",
                      f"{r.gen_steady_tps / roof:.1%}")
    return table
