"""The `ds4py` command line: every command is a thin shell over a library function.

Errors the user can act on (ds4py.errors.Ds4Error) become one line `error: ...` on stderr and a
non-zero exit; no traceback reaches the terminal for them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)
from rich.table import Table

from ds4py.errors import Ds4Error

app = typer.Typer(
    help="ds4py: run DeepSeek-V4-Flash GGUF files (the ones antirez/ds4 runs) on one NVIDIA GPU or "
         "the CPU, with the weights where your machine keeps them fastest.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
console = Console(stderr=True)
out = Console()


def say(msg: str) -> None:
    """One status line on stderr, printed as it is (no rich markup or highlighting)."""
    console.print(msg, highlight=False, markup=False)


def main() -> None:
    try:
        app()
    except Ds4Error as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, SystemError) as e:
        from ds4py.generate import is_interrupt
        if not is_interrupt(e):
            raise
        console.print("interrupted")
        sys.exit(130)


class CompileNotice:
    """Says when numba starts compiling kernels and adds up the seconds it spends (with
    `install()`). A first run compiles the CPU engine's kernels for about a minute inside the
    first prefill, and a first GPU run its CUDA kernels at their first launch (numba then caches
    both on disk, so the next run loads them in seconds); without a word the terminal looks hung
    and the prefill rate is wrong by 100x.

    numba-cuda reports its compiles on its own event bus (numba.cuda.core.event) and not as
    "numba:compile": the CUDA side is heard through its compiler lock, held for each compile (and
    each kernel loaded from numba's disk cache: part of the same start-up cost)."""

    def __init__(self, say):
        self.say = say
        self.seconds = 0.0           # top-level compiles only: a kernel's callees compile inside it
        self._said = False
        self._lock = threading.Lock()
        self._local = threading.local()

    def install(self):
        """A context manager: listen to numba's compile events while it is open."""
        from numba.core import event

        stack = contextlib.ExitStack()
        stack.enter_context(event.install_listener("numba:compile", self._listener(event)))
        try:
            from numba.cuda.core import event as cuda_event
        except ImportError:                # numba without numba-cuda: CPU compiles only
            return stack
        stack.enter_context(cuda_event.install_listener("numba-cuda:compiler_lock", self._listener(cuda_event)))
        return stack

    def _listener(self, bus):
        """A listener of the event bus `bus` (numba's or numba-cuda's: each has its own class)."""
        notice = self

        class Listener(bus.Listener):
            def on_start(self, ev):
                notice._start()

            def on_end(self, ev):
                notice._end()

        return Listener()

    def _start(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self._local.t0 = time.perf_counter()
            with self._lock:
                first, self._said = not self._said, True
            if first:
                self.say("ds4py: compiling kernels with numba (cached on disk after the first run, "
                         "so later runs start in seconds)")

    def _end(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            with self._lock:
                self.seconds += time.perf_counter() - self._local.t0


def byte_progress(description: str) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=False)


def gib(n: int) -> str:
    """Bytes in the unit that keeps 1-4 significant digits before the point."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def roles_table(title: str, bytes_by_role: dict) -> Table:
    table = Table(title=title, show_header=True)
    table.add_column("role")
    table.add_column("bytes", justify="right")
    for role, n in bytes_by_role.items():
        table.add_row(role, gib(n))
    return table


# ---- inspect -----------------------------------------------------------------------------------------

SPECIAL_STRINGS = {
    "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>", "think": "<think>", "end_think": "</think>", "dsml": "｜DSML｜",
}


def describe_model(path: str) -> dict:
    """Everything `inspect` reports, as plain data."""
    from ds4py.io import gguf
    from ds4py.io.spec import (ROLE_ORDER, alias_summary, bytes_by, read_spec, tensor_role,
                               validate)

    with gguf.GGUFFile(path) as g:
        spec = read_spec(g)
        v = validate(g, spec)
        tokens = g.metadata.get("tokenizer.ggml.tokens") or []
        index = {s: i for i, s in enumerate(tokens)} if tokens else {}
        by_role = bytes_by(g, lambda t: tensor_role(t.name))
        aliased, unique = alias_summary(g)
        report = {
            "path": path,
            "file_size": g.file_size,
            "gguf_version": g.version,
            "name": g.metadata.get("general.name"),
            "architecture": {k: getattr(spec, k) for k in spec.__dataclass_fields__
                             if k not in ("compress_ratios", "swiglu_clamp")},
            "compress_ratios": list(spec.compress_ratios),
            "tensor_count": len(g.tensors),
            "bytes_described": sum(t.nbytes for t in g.tensors.values()),
            "bytes_unique": unique,
            "aliased_tensors": aliased,
            "bytes_by_role": {r: by_role[r] for r in ROLE_ORDER if r in by_role},
            "bytes_by_type": dict(sorted(bytes_by(g, lambda t: t.type_name).items(), key=lambda kv: -kv[1])),
            "tokenizer": {"tokens": len(tokens), "merges": len(g.metadata.get("tokenizer.ggml.merges") or []),
                          "special_ids": {k: index.get(s) for k, s in SPECIAL_STRINGS.items()}},
            "loadable_by_ds4py": v.ok,
            "problems": v.problems,
            "ds4_compatible": not v.ds4_incompatible and all(i is not None for i in
                                                             (index.get(s) for s in SPECIAL_STRINGS.values())),
            "ds4_incompatible_because": v.ds4_incompatible,
        }
    return report


@app.command()
def inspect(model: Path = typer.Argument(..., help="GGUF file to describe."),
            as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts).")):
    """Describe a GGUF: architecture, tensors, bytes by role and type, tokenizer, ds4 compatibility.

    Exits 2 if ds4py cannot load the file."""
    report = describe_model(str(model))
    if as_json:
        out.print_json(json.dumps(report))
    else:
        print_report(report)
    if not report["loadable_by_ds4py"]:
        raise Ds4Error(f"{model}: {report['problems'][0]}" +
                       (f" (and {len(report['problems']) - 1} more)" if len(report["problems"]) > 1 else ""))


def print_report(r: dict) -> None:
    a = r["architecture"]
    out.print(f"[bold]{r['path']}[/]  ({r['name'] or 'unnamed'}, GGUF v{r['gguf_version']})")
    out.print(f"  layers {a['n_layer']}, n_embd {a['n_embd']}, vocab {a['n_vocab']}, heads {a['n_head']}×{a['head_dim']} "
              f"(rope {a['n_rot']}), q_lora {a['q_lora']}, out {a['n_group']}×{a['o_lora']}")
    out.print(f"  experts {a['n_used']}/{a['n_exp']} (+{a['n_shared']} shared) × n_ff {a['n_ff']}, hash layers {a['n_hash']}, "
              f"window {a['n_swa']}, indexer {a['n_ihead']}×{a['idx_dim']} top-{a['idx_topk']}, HC {a['n_hc']}")
    out.print(f"  compress ratios {r['compress_ratios']}")
    out.print(f"  {r['tensor_count']} tensors describing {gib(r['bytes_described'])}; file {gib(r['file_size'])}"
              + (f" ({r['aliased_tensors']} tensors share data: {gib(r['bytes_unique'])} distinct)" if r["aliased_tensors"] else ""))
    out.print(roles_table("bytes by role", r["bytes_by_role"]))
    out.print("  by type: " + ", ".join(f"{t} {gib(n)}" for t, n in r["bytes_by_type"].items()))
    tok = r["tokenizer"]
    out.print(f"  tokenizer: {tok['tokens']} tokens, {tok['merges']} merges, specials "
              + ", ".join(f"{k}={v}" for k, v in tok["special_ids"].items()))
    if r["ds4_compatible"]:
        out.print("  ds4-compatible: [green]yes[/]")
    else:
        out.print(f"  ds4-compatible: [yellow]no[/] ({'; '.join(r['ds4_incompatible_because']) or 'special tokens missing'})")
    out.print(f"  loadable by ds4py: {'[green]yes[/]' if r['loadable_by_ds4py'] else '[red]no[/]'}")


# ---- make-model ----------------------------------------------------------------------------------------

@app.command("make-model")
def make_model(
    out_path: Path = typer.Argument(..., metavar="OUT", help="Where to write the GGUF."),
    preset: str = typer.Option("tiny", help="tiny: small dims, ≤128 MB; flash: ds4's exact shapes (loads in antirez/ds4)."),
    alias: str = typer.Option("none", help="none | experts | per-role: let tensors share blobs to shrink the file "
                                           "(flash: 86.7 GB / 9.9 GiB / 3.4 GiB)."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
):
    """Write a synthetic DeepSeek-V4-Flash GGUF with random, well-scaled weights and the real tokenizer."""
    from ds4py import synth

    if preset not in synth.PRESETS:
        raise Ds4Error(f"unknown preset {preset!r}; choose one of {', '.join(synth.PRESETS)}")
    if alias not in synth.ALIAS_MODES:
        raise Ds4Error(f"unknown alias mode {alias!r}; choose one of {', '.join(synth.ALIAS_MODES)}")
    planned, blob_sizes = synth.plan_tensors(synth.preset_spec(preset), alias)
    need = sum(blob_sizes.values())
    free = _free_disk(out_path)
    if free is not None and need > free:
        raise Ds4Error(f"{out_path}: needs {gib(need)} but only {gib(free)} free on that filesystem; "
                       f"use --alias experts or per-role, or another directory")
    summary = _build_with_progress(synth, str(out_path), preset, alias, seed)
    console.print(f"wrote {summary['path']}: {summary['tensors']} tensors, {gib(summary['bytes_described'])} described, "
                  f"file {gib(summary['file_size'])} ({summary['blobs']} distinct blobs)")


def _free_disk(path: Path):
    try:
        st = os.statvfs(path.resolve().parent)
        return st.f_bavail * st.f_frsize
    except OSError as e:
        raise Ds4Error(f"{path}: cannot write there ({e.strerror})") from None


def _build_with_progress(synth, path: str, preset: str, alias: str, seed: int) -> dict:
    with byte_progress("") as bar:
        task = bar.add_task(f"building {preset}", total=None)

        def progress(total_bytes, advance):
            bar.update(task, total=total_bytes, advance=advance)
        try:
            return synth.build_model(path, preset, alias, seed, progress=progress)
        except OSError as e:
            raise Ds4Error(f"{path}: write failed ({e.strerror})") from None


def default_model_path() -> Path:
    """The embedded default: the tiny synthetic model, built into the user's cache on first use."""
    from ds4py import synth

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ds4py"
    path = cache / f"tiny-seed0-r{synth.RECIPE}.gguf"     # a new recipe builds a new file
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        console.print(f"no model given: building the embedded default (tiny synthetic DS4) into {path}")
        _build_with_progress(synth, str(path), "tiny", "none", 0)
    return path


# ---- probe ---------------------------------------------------------------------------------------

from ds4py.options import WeightOptions, weight_options  # noqa: E402  (the probe section's own import)


def probe_report(model_path, weights: WeightOptions) -> dict:
    """Everything `probe` reports, as plain data (the JSON of `probe --json`).

    Keys: machine {ram {total, available, memlock_limit}, gpu {via, driver, note, devices [{index,
    name, total, free, pcie_gen, pcie_width,
    compute_capability}]}}; model {path, file_size, filesystem, direct_io,
    direct_io_note, cached_bytes, bytes_by_role, distinct_bytes, dense_bytes, expert_bytes,
    expert_slot_bytes, n_ctx, kv_bytes, scratch_bytes}; options [{option, value, source, env}]
    (source: flag | env | default); notes [str]; decision {regime, forced, reasons, warnings,
    vram_budget, ram_budget, arena_limit, expert_cache_slots, expert_cache_bytes, direct_io,
    drop_pages, runner_up, alternatives [{regime, flag, verdict}]} or null with refusal: str;
    kernels {key, target ("cuda" | "cpu"), recorded, cached, jobs, ahead} for the chosen regime
    (ds4py.engine.kernel_plan), null with a refusal; attention {f64, why}: the GPU decode
    attention's arithmetic (--attention), null for the CPU. All sizes are bytes."""
    from dataclasses import asdict

    from ds4py.io import machine
    from ds4py.io.detect import Refusal, decide, decode_attention
    from ds4py.io.spec import open_model

    model = open_model(model_path)
    try:
        measured = machine.measure(model)
        facts = measured.facts(model, weights.n_ctx)
        report = {"machine": {k: v for k, v in measured.as_dict().items() if k != "model"},
                  "model": {**measured.as_dict()["model"], "n_ctx": weights.n_ctx,
                            "kv_bytes": facts.model.kv_bytes, "scratch_bytes": facts.model.scratch_bytes},
                  "options": weights.table(), "notes": list(weights.notes), "decision": None, "refusal": None,
                  "kernels": None, "attention": None}
        try:
            d = decide(facts, weights.to_request())
        except Refusal as e:
            report["refusal"] = str(e)
            return report
        from ds4py.engine import kernel_plan, kernel_target
        report["kernels"] = kernel_plan(model, weights.compile_jobs, kernel_target(d.regime))
        if kernel_target(d.regime) == "cuda":
            gpus = report["machine"]["gpu"]["devices"]
            f64, why = decode_attention(weights.attention, gpus[0].get("compute_capability") if gpus else None)
            report["attention"] = {"f64": f64, "why": why}
        report["decision"] = {
            "regime": d.regime, "forced": d.forced, "reasons": list(d.reasons), "warnings": list(d.warnings),
            "vram_budget": d.vram_budget, "ram_budget": d.ram_budget, "arena_limit": d.arena_limit,
            "expert_cache_slots": d.expert_cache_slots, "expert_cache_bytes": d.expert_cache_bytes,
            "direct_io": d.direct_io, "drop_pages": d.drop_pages, "runner_up": d.runner_up,
            "alternatives": [asdict(a) for a in d.alternatives]}
        return report
    finally:
        model.close()


REGIME_TITLES = {"device": "device-resident", "page-cache": "page-cache-resident", "stream": "O_DIRECT streaming",
                 "host-mapped": "host-mapped", "cpu": "CPU"}


@app.command()
@weight_options
def probe(model: Optional[Path] = typer.Option(None, "-m", "--model",
                                               help="GGUF to plan for (default: the embedded tiny model)."),
          as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (keys: see docs)."),
          weights=None):
    """Hardware and weight-residency report (not a run): where the weights would live, and why.

    Nothing is loaded onto the GPU. Shows RAM, GPUs, VRAM and PCIe (NVML), the model's page-cache share and O_DIRECT support, bytes by role, KV at --ctx, each option with its origin (flag, env, default), and the decision: regime, deciding inequality, runner-up, and the flag forcing each other regime. Exits 3 if a forced regime cannot run."""
    path = model if model is not None else default_model_path()
    report = probe_report(str(path), weights)
    if as_json:
        out.print_json(json.dumps(report))
    else:
        print_probe(report)
    if report["refusal"]:
        from ds4py.errors import ResourceError
        raise ResourceError(report["refusal"])


def print_probe(r: dict) -> None:
    ram, gpu, m = r["machine"]["ram"], r["machine"]["gpu"], r["model"]
    out.print("[bold]ds4py probe[/]: hardware and weight-residency report (nothing loaded, nothing run)")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column()
    lock = "unlimited" if ram["memlock_limit"] is None else gib(ram["memlock_limit"])
    facts.add_row("RAM", f"{gib(ram['total'])} total, {gib(ram['available'])} available (page-lock limit {lock})")
    for g in gpu["devices"]:
        link = f", PCIe gen{g['pcie_gen']} x{g['pcie_width']}" if g.get("pcie_gen") else ""
        cc = g.get("compute_capability")
        arch = f", compute capability {cc[0]}.{cc[1]}" if cc else ""
        facts.add_row(f"GPU {g['index']}", f"{g['name']}: {gib(g['total'])} total, {gib(g['free'])} free{link}{arch}")
    via = f"via {gpu['via']}" + (f", driver {gpu['driver']}" if gpu["driver"] else "")
    facts.add_row("GPU probe", via + (f"; {gpu['note']}" if gpu["note"] else "") if gpu["devices"] else
                  f"no GPU ({gpu['note'] or gpu['via']})")
    facts.add_row("model", f"{m['path']} ({gib(m['file_size'])}, {m['filesystem']})")
    facts.add_row("O_DIRECT", "yes" if m["direct_io"] else f"no ({m['direct_io_note']})")
    share = m["cached_bytes"] / m["file_size"] if m["file_size"] else 0.0
    facts.add_row("page cache", f"{share:.1%} of the file resident ({gib(m['cached_bytes'])})")
    facts.add_row("weights", f"{gib(m['distinct_bytes'])} distinct: dense {gib(m['dense_bytes'])} + routed experts "
                             f"{gib(m['expert_bytes'])}; one expert slot {gib(m['expert_slot_bytes'])}")
    facts.add_row("KV", f"{gib(m['kv_bytes'])} at --ctx {m['n_ctx']}; scratch {gib(m['scratch_bytes'])}")
    out.print(facts)

    out.print(roles_table("bytes by role (described; aliases counted each time)", m["bytes_by_role"]))

    opts = Table(title="options", show_header=True)
    for col in ("option", "value", "from", "environment"):
        opts.add_column(col)
    for row in r["options"]:
        style = "" if row["source"] == "default" else "bold"
        opts.add_row(row["option"], row["value"], row["source"], row["env"], style=style)
    out.print(opts)
    for note in r["notes"]:
        out.print(f"  note: {note}")

    d = r["decision"]
    if d is None:
        out.print(f"[bold red]decision: refused[/]: {r['refusal']}")
        return
    how = " (forced)" if d["forced"] else ""
    out.print(f"[bold green]decision: {REGIME_TITLES[d['regime']]}{how}[/]: {d['reasons'][0]}", soft_wrap=True)
    for reason in d["reasons"][1:]:
        out.print(f"  - {reason}", soft_wrap=True)
    for warning in d["warnings"]:
        out.print(f"  [yellow]warning[/]: {warning}", soft_wrap=True)
    if d["runner_up"]:
        out.print(f"  runner-up: {REGIME_TITLES[d['runner_up']]}")
    if r["kernels"]:
        from ds4py.engine import kernel_plan_text
        target = "CPU" if r["kernels"]["target"] == "cpu" else "CUDA"
        out.print(f"  {target} kernels: {kernel_plan_text(r['kernels'])}")
    if r.get("attention"):
        a = r["attention"]
        out.print(f"  decode attention: {'f64' if a['f64'] else 'f32'} ({a['why']})", soft_wrap=True)
    alts = Table(title="other regimes", show_header=True)
    for col in ("regime", "force with", "verdict"):
        alts.add_column(col)
    for a in d["alternatives"]:
        alts.add_row(REGIME_TITLES[a["regime"]], a["flag"], a["verdict"])
    out.print(alts)


# ---- run / tokenize --------------------------------------------------------------------------------

def _stream_printer(tok):
    """on_token callback: print each token's text as soon as it is complete UTF-8 (the EOS that
    ends a reply is not printed, as ds4 does not)."""
    decoder = tok.stream_decoder()

    def on_token(token_id: int) -> None:
        if token_id == tok.eos_id:
            return
        text = decoder.feed(token_id)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def finish() -> None:
        tail = decoder.flush()
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
    return on_token, finish


def _write_logits(path: Path, logits) -> None:
    import numpy as np

    try:
        np.asarray(logits, dtype="<f4").tofile(str(path))
    except OSError as e:
        raise Ds4Error(f"{path}: cannot write the logits ({e.strerror})") from None


@app.command()
@weight_options
def run(model: Optional[Path] = typer.Option(None, "-m", "--model", help="GGUF to run (default: the embedded tiny model)."),
        prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="One-shot prompt; without it, an interactive chat."),
        n_predict: int = typer.Option(256, "-n", "--n-predict", min=1, help="Most tokens to generate per turn."),
        temp: float = typer.Option(1.0, "--temp", help="Sampling temperature; 0 = greedy argmax."),
        top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling share (1 = off)."),
        min_p: float = typer.Option(0.05, "--min-p", help="Drop tokens less likely than min_p × the top token."),
        top_k: int = typer.Option(0, "--top-k", min=0, max=1024, help="Sample among the k best only (0 = off)."),
        think: bool = typer.Option(True, "--think/--nothink", help="End the prompt with <think> (default) or </think>."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Sampler seed (default: from the clock)."),
        system: str = typer.Option("You are a helpful assistant", "--system", help="System prompt; \"\" for none."),
        dump_logits: Optional[Path] = typer.Option(None, "--dump-logits", metavar="FILE",
                                                   help="Write the last prompt token's logits as raw little-endian float32."),
        stats: bool = typer.Option(False, "--stats", help="After each reply: host->device bytes at load and per "
                                                          "request, expert-cache hits/misses, decode GB/s."),
        weights=None):
    """Generate text: one shot with -p, else an interactive multi-turn chat.

    With -p the tokens stream as they come; without it, a chat (/think, /nothink, /quit; Ctrl-C
    stops a reply; EOF exits). Ends with ds4's prefill/generation t/s line."""
    from ds4py.chat import Conversation, render_prompt
    from ds4py.engine import open_engine
    from ds4py.generate import Session, generate
    from ds4py.io.spec import open_model
    from ds4py.sampling import Sampler
    from ds4py.tokenizer import Tokenizer

    path = model if model is not None else default_model_path()
    m = open_model(str(path))
    tok = Tokenizer.from_gguf(m.file)
    # the shared loader: detector -> weight source -> CPU or CUDA engine (ds4py/engine.py)
    loaded = open_engine(m, weights, log=say)
    try:
        attention = ""
        if loaded.kind == "cuda":      # --attention auto resolved for this GPU (CudaEngine.attention_f64)
            attention = f", attention {'f64' if loaded.engine.attention_f64 else 'f32'}"
        console.print(f"ds4py: {path.name}: {loaded.kind.upper()} engine, ctx {weights.n_ctx}{attention}",
                      highlight=False)
        session = Session(loaded.engine)
        sampler = Sampler(temperature=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)

        def turn(ids):
            on_token, finish = _stream_printer(tok)
            notice = CompileNotice(say)
            with notice.install():
                result = generate(session, ids, sampler, n_predict, tok.eos_id, on_token=on_token)
            finish()
            if result.stop == "interrupted":
                console.print("[interrupted]", markup=False)
            elif result.stop == "context":
                console.print(f"[context full: --ctx {weights.n_ctx}]", markup=False)
            if dump_logits is not None and result.prompt_logits is not None:
                _write_logits(dump_logits, result.prompt_logits)
            console.print(result.stats_line(), highlight=False)
            if notice.seconds >= 0.5:
                say(f"ds4py: {notice.seconds:.1f} s of this reply went to compiling kernels (the rates above include it)")
            if stats:
                console.print(_stats_line(loaded, m, result), highlight=False)
            return result

        if prompt is not None:
            turn(render_prompt(tok, prompt, system=system, think=think))
            return
        conv = Conversation(tok, system=system, think=think)
        console.print("ds4py chat: /think, /nothink, /quit; Ctrl-C stops a reply; Ctrl-D exits")
        while True:
            try:
                line = input("> ")
            except EOFError:
                console.print("")
                return
            except KeyboardInterrupt:
                console.print("")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return
            if text in ("/think", "/nothink"):
                conv.think = text == "/think"
                console.print(f"thinking {'on' if conv.think else 'off'}")
                continue
            result = turn(conv.add_user(line))
            conv.add_reply(result.tokens)
    finally:
        loaded.close()       # and record the CUDA kernels it built (kernels/precompile.py)


def _counters_text(source) -> str:
    """The weight source's counters: what moved at load and since, and the expert cache."""
    c = source.counters
    return (f"weights {getattr(source, 'regime', 'cpu')}; H2D at load {gib(c.h2d_load_bytes)}, "
            f"per request so far {gib(c.h2d_request_bytes)}; disk read {gib(c.disk_read_bytes)}; expert cache "
            f"{c.expert_hits} hits / {c.expert_misses} misses / {c.expert_evictions} evictions")


def _stats_line(loaded, model, result) -> str:
    """Residency counters and the decode rate in weight bytes per second."""
    from ds4py.bench import weight_bytes_per_token
    gbps = result.gen_tps * weight_bytes_per_token(model) / 1e9
    return f"ds4py: stats: {_counters_text(loaded.source)}; decode {gbps:.1f} GB/s of weights"


@app.command()
@weight_options
def bench(model: Optional[Path] = typer.Option(None, "-m", "--model", help="GGUF to benchmark (default: the embedded tiny model)."),
          prompt_file: Path = typer.Option(..., "--prompt-file", help="Text to prefill from (ds4's corpus: promessi_sposi.txt); "
                                                                      "tokenized raw, must give >= --ctx-max tokens."),
          ctx_start: int = typer.Option(2048, "--ctx-start", help="First context frontier."),
          ctx_max: int = typer.Option(16384, "--ctx-max", help="Last context frontier."),
          step_incr: int = typer.Option(0, "--step-incr", help="Frontier step (added)."),
          step_mul: float = typer.Option(0.0, "--step-mul", help="Frontier step (multiplied); default ×2 if neither is given."),
          gen_tokens: int = typer.Option(128, "--gen-tokens", min=1, help="Greedy tokens decoded at each frontier (EOS never stops them)."),
          csv: Optional[Path] = typer.Option(None, "--csv", help="Write ds4-bench's 9-column CSV here (else stdout)."),
          weights=None):
    """Prefill and decode speed at growing contexts, as ds4-bench measures it (same CSV).

    One load; incremental prefill to each frontier (only the new tokens timed), KV snapshot, a
    fixed greedy probe, restore, continue. Then a table with the weight regime and decode as a
    fraction of the roofline (weight bytes per token ÷ the copy bandwidth measured at start).
    --ctx defaults to ctx-max + gen-tokens."""
    import dataclasses

    from ds4py import bench as b
    from ds4py.engine import open_engine
    from ds4py.io.spec import open_model
    from ds4py.tokenizer import Tokenizer

    if not step_incr and not step_mul:
        step_mul = 2.0
    points = b.frontiers(ctx_start, ctx_max, step_incr, step_mul)
    try:
        text = prompt_file.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise Ds4Error(f"{prompt_file}: cannot read the prompt file ({e.strerror})") from None
    path = model if model is not None else default_model_path()
    m = open_model(str(path))
    tok = Tokenizer.from_gguf(m.file)
    ids = tok.encode(text)
    if weights.n_ctx < points[-1] + gen_tokens + 1:
        weights = dataclasses.replace(weights, n_ctx=points[-1] + gen_tokens + 1)
    loaded = open_engine(m, weights, log=say)
    ceiling, what = b.copy_ceiling(loaded.kind)
    per_token = b.weight_bytes_per_token(m)
    lines = [b.CSV_HEADER]
    if csv is None:
        print(b.CSV_HEADER, flush=True)

    def on_row(row):
        lines.append(row.csv())
        if csv is None:
            print(row.csv(), flush=True)
    notice = CompileNotice(say)
    with notice.install():               # the engine's warm-up compiles before the clocks start
        rows = b.run_bench(loaded.engine, ids, tok.eos_id, points, gen_tokens, on_row=on_row)
    if csv is not None:
        try:
            csv.write_text("\n".join(lines) + "\n")
        except OSError as e:
            raise Ds4Error(f"{csv}: cannot write the CSV ({e.strerror})") from None
    regime = getattr(loaded.source, "regime", "cpu")
    console.print(b.bench_table(rows, regime, per_token, ceiling, what))
    if regime != "cpu":
        console.print(f"ds4py: bench: {_counters_text(loaded.source)}", highlight=False)
    if notice.seconds >= 0.5:
        say(f"ds4py: bench: {notice.seconds:.1f} s compiling kernels")
    loaded.close()


@app.command()
def tokenize(text: str = typer.Argument(..., help="Text to tokenize (a prompt starting with the BOS string is read as pre-rendered)."),
             model: Optional[Path] = typer.Option(None, "-m", "--model", help="GGUF whose tokenizer to use (default: the embedded tiny model)."),
             ids_only: bool = typer.Option(False, "--ids", help="Print only the ids, as one JSON list on one line.")):
    """Tokenize TEXT with the model's tokenizer: one `id -> 'piece'` line per token, like llama.cpp's tool."""
    from ds4py.chat import is_rendered, tokenize_rendered
    from ds4py.io.gguf import GGUFFile
    from ds4py.io.spec import read_spec
    from ds4py.tokenizer import Tokenizer

    path = model if model is not None else default_model_path()
    with GGUFFile(str(path)) as g:
        read_spec(g)                     # a foreign GGUF gets the one-line error, not a tokenizer guess
        tok = Tokenizer.from_gguf(g)
    ids = tokenize_rendered(tok, text) if is_rendered(text) else tok.encode(text)
    if ids_only:
        print(json.dumps(ids))
        return
    for i in ids:
        print(f"{i:6d} -> '{tok.token_piece(i)}'")


if __name__ == "__main__":
    main()
