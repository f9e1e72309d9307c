"""GPU engine on the flash preset (ds4's full shapes, per-role aliased: a 3.4 GiB file).

One device run: build the file, load it device-resident, measure the copy ceiling, profile one
decode step by groups of launches, check GPU vs CPU logits on the first tokens, run the bench
frontiers, and (time permitting) page-cache vs stream decode with a small expert cache.
Writes JSON and CSV into --out.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from ds4py.options import DEFAULT_PREFILL_CHUNK


def log(*a):
    print(*a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--model", default="/tmp/flash.gguf")
    ap.add_argument("--frontiers", default="2048,4096")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="tokens per prefill chunk")
    ap.add_argument("--attention", default="auto", help="decode attention: auto, f64 or f32 (ds4py --attention)")
    args = ap.parse_args()
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    results = {}

    from ds4py import synth
    if not os.path.exists(args.model):
        t0 = time.time()
        info = synth.build_model(args.model, "flash", "per-role", 0)
        results["build"] = dict(info, seconds=time.time() - t0)
        log("built", results["build"])

    from ds4py.bench import CSV_HEADER, copy_ceiling, frontiers, run_bench, weight_bytes_per_token
    from ds4py.forward_cuda import CudaEngine
    from ds4py.io import sources
    from ds4py.io.spec import open_model
    from ds4py.tokenizer import Tokenizer

    model = open_model(args.model)
    points = [int(x) for x in args.frontiers.split(",")]
    n_ctx = points[-1] + args.gen + 8
    ceiling, what = copy_ceiling("cuda")
    bpt = weight_bytes_per_token(model)
    results["ceiling_GBps"] = ceiling / 1e9
    results["bytes_per_token"] = bpt
    results["roofline_tps"] = ceiling / bpt
    log(f"copy ceiling {ceiling / 1e9:.0f} GB/s ({what}); weights/token {bpt / 1e9:.2f} GB; roofline {ceiling / bpt:.1f} tok/s")

    from ds4py.engine import open_engine
    from ds4py.options import WeightOptions
    t0 = time.time()
    loaded = open_engine(model, WeightOptions(n_ctx=n_ctx, prefill_chunk=args.prefill_chunk,
                                              attention=args.attention), progress=False)   # the detector decides
    source, engine = loaded.source, loaded.engine
    results["load"] = dict(seconds=time.time() - t0, regime=source.regime, counters=source.counters.as_dict(),
                           attention="f64" if engine.attention_f64 else "f32")
    t0 = time.time()
    first = engine.decode(1)
    results["first_step_s"] = time.time() - t0
    log(f"first step (compile + capture) {results['first_step_s']:.1f} s; finite logits: {bool(np.isfinite(first).all())}, std {np.std(first):.3f}")
    h2d_before = source.counters.h2d_request_bytes

    # GPU vs CPU on the first tokens of a prompt
    tok = Tokenizer.from_gguf(model.file)
    text = open(".data/promessi_sposi.txt", encoding="utf-8").read()[:400_000]
    ids = tok.encode(text)
    log(f"corpus: {len(ids)} tokens")
    if not args.skip_cpu:
        from ds4py.forward_cpu import CpuEngine
        engine.reset()
        cpu = CpuEngine(model, n_ctx=64)
        comp = []
        for pos, t in enumerate(ids[:4]):
            g = np.asarray(engine.decode(t), np.float64)
            t0 = time.time()
            c = np.asarray(cpu.decode(t), np.float64)
            comp.append(dict(pos=pos, corr=float(np.corrcoef(g, c)[0, 1]),
                             max_rel=float(np.max(np.abs(g - c)) / np.std(c)),
                             top1_same=int(np.argmax(g)) == int(np.argmax(c)), cpu_s=time.time() - t0))
            log("gpu vs cpu", comp[-1])
        results["gpu_vs_cpu"] = comp

    engine.reset()
    engine.prefill(ids[:512])
    prof = engine.profile(ids[512], reps=10)
    results["profile_at_512"] = prof
    log("profile (ms per step, by group):", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in prof.items()}))

    rows = []
    csv_path = os.path.join(args.out, "bench.csv")
    with open(csv_path, "w") as f:
        f.write(CSV_HEADER + "\n")

    def on_row(r):                     # each row lands in the CSV at once: a cut-off run keeps them
        rows.append(r)
        with open(csv_path, "a") as f:
            f.write(r.csv() + "\n")
        log("bench:", r.csv(), f"({r.gen_steady_tps / (ceiling / bpt):.1%} of roofline)")
    run_bench(engine, ids, tok.eos_id, points, args.gen, on_row=on_row)
    results["h2d_request_bytes_after_load"] = source.counters.h2d_request_bytes - h2d_before
    results["bench"] = [r.__dict__ for r in rows]
    source.close()
    del engine

    # page-cache vs stream with an expert cache too small for all experts (a 24 GB card)
    remaining = args.budget_s - (time.time() - t_start)
    if remaining > 60:
        for regime in ("page-cache", "stream"):
            cls = sources.PageCacheSource if regime == "page-cache" else sources.StreamSource
            kw = dict(expert_slots=600, progress=False)
            if regime == "stream":
                kw.update(direct_io=True, drop_pages=True)
            src = cls(model, **kw)
            eng = CudaEngine(model, src, 1024, attention=args.attention)
            eng.prefill(ids[:32])
            token = ids[32]
            eng.decode_greedy(token)
            t0 = time.time()
            n = 8
            for _ in range(n):
                token = eng.decode_greedy(token)
            dt = time.time() - t0
            results[regime] = dict(tps=n / dt, counters=src.counters.as_dict())
            log(regime, results[regime])
            src.close()
            del eng
    with open(os.path.join(args.out, "gpu_engine.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log("done in", round(time.time() - t_start, 1), "s")


if __name__ == "__main__":
    main()
