"""The auto-detector: which weight regime a machine should use, as a pure function of facts.

`decide(facts, request) -> Decision`. `facts` are measurements (io/machine.py takes them: RAM via
psutil, page-cache share via mincore, VRAM via NVML) or a test's table row; `request` holds the
user's choices and overrides. Nothing here touches the machine.

Regimes, best first:
- device       every tensor copied into one VRAM arena at load; decode reads only HBM.
- page-cache   the file kept in RAM (mmap, registered with the driver, never dropped); dense
               tensors in VRAM, routed experts copied on demand into a VRAM expert cache.
- stream       dense tensors in VRAM; routed experts read from disk on demand (O_DIRECT), pages
               dropped after use, hot experts kept in the VRAM expert cache.
- host-mapped  every tensor read by the kernels in place from the registered file mapping, across
               PCIe on every token (ds4's no-copy path). Only by --direct-model, or as the device
               regime's fallback when its VRAM arena cannot be had.
- cpu          no usable GPU: the CPU engine reads the mmap.

Auto picks device if model + KV + scratch fit the VRAM budget (free - max(2 GiB, 5 %), ds4's
`--gpu-vram auto` margin), else page-cache if the file fits in RAM with headroom, else stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 1 << 30
MiB = 1 << 20

REGIMES = ("device", "page-cache", "stream", "host-mapped", "cpu")
AUTO_ORDER = ("device", "page-cache", "stream")
FORCE_FLAG = {"device": "--weights device", "page-cache": "--weights page-cache",
              "stream": "--weights stream", "host-mapped": "--direct-model", "cpu": "--gpu-vram 0"}


def fmt_bytes(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


# ---- inputs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    total: int
    free: int
    pcie_gen: int | None = None
    pcie_width: int | None = None
    compute_capability: tuple[int, int] | None = None    # (major, minor); None: not measured


# ds4py's CUDA kernels use int8 tensor-core MMA (mma.m16n8k32) and cp.async: Ampere (8.0) on.
MIN_COMPUTE_CAPABILITY = (8, 0)


def unsupported_gpu(gpu: GpuFacts) -> str | None:
    """Why ds4py's kernels cannot run on this GPU (None: they can, or its capability is unknown)."""
    cc = gpu.compute_capability
    if cc is None or tuple(cc) >= MIN_COMPUTE_CAPABILITY:
        return None
    return (f"{gpu.name} is compute capability {cc[0]}.{cc[1]}; ds4py's CUDA kernels need "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} or newer (int8 tensor-core MMA, cp.async)")


# GPUs that run f64 at half the f32 rate (A100 / A30, H100 / H200, B200). Every other supported
# card (GeForce and RTX workstation cards, RTX 50's 12.0 included; L4 / L40 / A10 / A40; Jetson;
# B300) runs it at 1/32 to 1/64 of f32, and so does anything not listed here yet.
FULL_RATE_F64 = {(8, 0), (9, 0), (10, 0)}


def decode_attention(choice: str, compute_capability) -> tuple[bool, str]:
    """--attention: (True for f64, False for f32, why). f64 is the CPU engine's numerics (the
    same scores to ~1e-16, the same logits); at 640 rows it is ~1.8 G multiply-adds a token,
    ~2.8 ms where f64 runs at 1/64 of f32 (an RTX 4090), so auto takes f32 there."""
    if choice != "auto":
        return choice == "f64", f"--attention {choice}"
    if compute_capability is None:
        return True, "the GPU's compute capability is unknown: f64, the CPU engine's numerics"
    cc = f"compute capability {compute_capability[0]}.{compute_capability[1]}"
    if tuple(compute_capability) in FULL_RATE_F64:
        return True, f"{cc} runs f64 at full rate: the CPU engine's numerics (--attention f32 is faster)"
    return False, f"{cc} runs f64 at 1/32-1/64 of f32 (--attention f64 for the CPU engine's numerics)"


@dataclass(frozen=True)
class ModelFacts:
    file_size: int
    model_bytes: int             # distinct tensor bytes: what a device copy holds
    dense_bytes: int             # distinct non-routed-expert bytes: in VRAM in every GPU regime
    expert_bytes: int            # distinct routed-expert bytes
    expert_slot_bytes: int       # one (layer, expert): gate + up + down, slot-aligned
    n_layer: int
    n_exp: int
    n_used: int
    kv_bytes: int                # KV state at the requested context
    scratch_bytes: int           # activations, logits and staging at the prefill chunk
    cached_bytes: int = 0        # bytes of the file already in the page cache


@dataclass(frozen=True)
class Facts:
    ram_total: int
    ram_available: int           # psutil's available: free + reclaimable cache
    gpus: tuple[GpuFacts, ...]
    model: ModelFacts
    direct_io: bool | None = None   # O_DIRECT accepted on the model's filesystem (None: not probed)


@dataclass(frozen=True)
class Request:
    weights: str = "auto"               # auto | device | page-cache | stream
    direct_model: bool = False          # host-mapped: no copy, kernels read the mapping
    no_model_copy: bool = False         # never copy the whole model into VRAM
    no_direct_io: bool = False
    keep_model_pages: bool = False
    gpu_vram: int | None = None         # VRAM budget override in bytes (0: CPU path)
    ram_budget: int | None = None       # RAM override in bytes (replaces psutil's available)
    expert_cache_slots: int | None = None
    expert_cache_bytes: int | None = None


# ---- output --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Alternative:
    regime: str
    flag: str                    # what forces it
    verdict: str                 # "fits", or why it does not / what it would do


@dataclass(frozen=True)
class Decision:
    regime: str
    reasons: tuple[str, ...]     # first: the inequality that decided, numbers filled in
    forced: bool = False
    gpu: GpuFacts | None = None
    vram_budget: int = 0
    ram_budget: int = 0
    arena_limit: int | None = None    # device regime: most VRAM the weight arena may take
    expert_cache_slots: int = 0
    expert_cache_bytes: int = 0
    direct_io: bool = False           # read with O_DIRECT (falls back to buffered if refused)
    drop_pages: bool = False          # DONTNEED file pages after use
    warnings: tuple[str, ...] = ()
    fit: str = ""                     # this regime's own condition, as met (for alternatives)
    runner_up: str | None = None
    alternatives: tuple[Alternative, ...] = ()

    def summary(self) -> str:
        return f"{self.regime}: {self.reasons[0]}"


class Refusal(Exception):
    """A regime cannot run on these facts; the message says by how much and what to do."""


# ---- arithmetic shared by the regimes ------------------------------------------------------------

def auto_vram_budget(free: int) -> int:
    """ds4's `--gpu-vram auto`: free - max(2 GiB, 5 % of free)."""
    return max(0, free - max(2 * GiB, free // 20))


def ram_headroom(total: int) -> int:
    """RAM left for everything else when the page cache holds the model: max(4 GiB, 5 %)."""
    return max(4 * GiB, total // 20)


@dataclass(frozen=True)
class _Budgets:
    gpu: GpuFacts | None
    vram: int
    vram_note: str
    ram: int
    ram_note: str
    ram_headroom: int


def _budgets(f: Facts, r: Request) -> _Budgets:
    gpu = f.gpus[0] if f.gpus and r.gpu_vram != 0 else None
    too_old = unsupported_gpu(gpu) if gpu is not None else None
    if too_old:
        gpu, vram, vram_note = None, 0, too_old
    elif gpu is None:
        vram, vram_note = 0, ("--gpu-vram 0" if f.gpus else "no GPU")
    elif r.gpu_vram is not None:
        vram, vram_note = r.gpu_vram, "--gpu-vram"
    else:
        vram, vram_note = auto_vram_budget(gpu.free), f"free {fmt_bytes(gpu.free)} - max(2 GiB, 5 %)"
    if r.ram_budget is not None:
        ram, ram_note, headroom = r.ram_budget, "--ram-budget", 0
    else:
        ram, ram_note, headroom = f.ram_available, "available", ram_headroom(f.ram_total)
    return _Budgets(gpu, vram, vram_note, ram, ram_note, headroom)


def _fits_ram(f: Facts, b: _Budgets) -> bool:
    return f.model.file_size + b.ram_headroom <= b.ram


def _ram_inequality(f: Facts, b: _Budgets, fits: bool) -> str:
    head = f" + headroom {fmt_bytes(b.ram_headroom)}" if b.ram_headroom else ""
    return (f"file {fmt_bytes(f.model.file_size)}{head} {'≤' if fits else '>'} "
            f"RAM {fmt_bytes(b.ram)} ({b.ram_note})")


def _device_need(m: ModelFacts) -> int:
    return m.model_bytes + m.kv_bytes + m.scratch_bytes


def _device_inequality(m: ModelFacts, b: _Budgets, fits: bool) -> str:
    return (f"model {fmt_bytes(m.model_bytes)} + KV {fmt_bytes(m.kv_bytes)} + scratch "
            f"{fmt_bytes(m.scratch_bytes)} = {fmt_bytes(_device_need(m))} {'≤' if fits else '>'} "
            f"VRAM budget {fmt_bytes(b.vram)} ({b.vram_note})")


def _need_gpu(b: _Budgets, regime: str) -> None:
    if b.gpu is None:
        raise Refusal(f"{regime} needs a GPU but {_no_gpu_reason(b)}; drop {FORCE_FLAG[regime].split()[0]} to run on the CPU")


def _no_gpu_reason(b: _Budgets) -> str:
    if b.vram_note == "--gpu-vram 0":
        return "--gpu-vram 0 selects the CPU path"
    return "no NVIDIA GPU was found" if b.vram_note == "no GPU" else b.vram_note


def _expert_cache(f: Facts, r: Request, b: _Budgets, regime: str) -> tuple[int, list[str], list[str]]:
    """(slots, reasons, warnings) for page-cache and stream; Refusal when even the minimum fails."""
    m = f.model
    fixed = m.dense_bytes + m.kv_bytes + m.scratch_bytes
    left = b.vram - fixed
    slot = max(m.expert_slot_bytes, 1)
    fixed_text = (f"dense {fmt_bytes(m.dense_bytes)} + KV {fmt_bytes(m.kv_bytes)} + scratch "
                  f"{fmt_bytes(m.scratch_bytes)}")
    if left < m.n_used * slot:
        raise Refusal(f"{regime} needs {fixed_text} + {m.n_used} expert slots "
                      f"({fmt_bytes(fixed + m.n_used * slot)}) of VRAM but the budget is {fmt_bytes(b.vram)} "
                      f"({b.vram_note}), short by {fmt_bytes(fixed + m.n_used * slot - b.vram)}; "
                      f"lower --ctx, free VRAM, or run on the CPU with --gpu-vram 0")
    whole_model = m.n_layer * m.n_exp
    if r.expert_cache_slots is not None or r.expert_cache_bytes is not None:
        want = r.expert_cache_slots if r.expert_cache_slots is not None else r.expert_cache_bytes // slot
        asked = (f"--ssd-streaming-cache-experts {r.expert_cache_slots}" if r.expert_cache_slots is not None
                 else f"--ssd-streaming-cache-experts {fmt_bytes(r.expert_cache_bytes)}")
        if want < m.n_used:
            raise Refusal(f"{asked} gives {want} slots; one token needs {m.n_used} (the experts one layer "
                          f"selects); ask for at least {m.n_used} slots ({fmt_bytes(m.n_used * slot)})")
        if want * slot > left:
            raise Refusal(f"{asked} needs {fmt_bytes(want * slot)} of VRAM but only {fmt_bytes(left)} are "
                          f"left after {fixed_text} (budget {fmt_bytes(b.vram)}); ask for at most "
                          f"{left // slot} slots")
        slots, how = min(want, whole_model), asked
    else:
        slots = min(left // slot, whole_model)
        how = f"VRAM left after {fixed_text}"
    reasons = [f"expert cache: {slots} slots × {fmt_bytes(slot)} = {fmt_bytes(slots * slot)} ({how})"]
    warnings = []
    recommended = 2 * m.n_layer * m.n_used
    if slots < recommended:
        warnings.append(f"expert cache of {slots} slots is below 2 × {m.n_layer} layers × {m.n_used} experts = "
                        f"{recommended}: expect many misses (each one a read of {fmt_bytes(slot)})")
    return slots, reasons, warnings


# ---- one evaluation per regime -------------------------------------------------------------------

def _plan(regime: str, f: Facts, r: Request, b: _Budgets) -> Decision:
    m = f.model
    fits_ram = _fits_ram(f, b)
    common = dict(gpu=b.gpu, vram_budget=b.vram, ram_budget=b.ram)
    if regime == "cpu":
        why = _no_gpu_reason(b) + ": " if b.gpu is None else ""
        return Decision("cpu", (f"{why}the CPU engine reads the file mapping in place",),
                        fit="runs anywhere (slowest)", **common)

    _need_gpu(b, regime)
    if regime == "device":
        need = _device_need(m)
        fits = need <= b.vram
        arena_limit = max(0, b.vram - m.kv_bytes - m.scratch_bytes)
        direct = not r.no_direct_io and not fits_ram and f.direct_io is not False
        drop = not r.keep_model_pages and not fits_ram
        io = _io_reason(direct, drop, r, f, "load")
        if fits:
            return Decision("device", (_device_inequality(m, b, True), io), arena_limit=arena_limit,
                            direct_io=direct, drop_pages=drop, fit=_device_inequality(m, b, True), **common)
        if not fits_ram:
            raise Refusal(f"device needs {fmt_bytes(need)} of VRAM (budget {fmt_bytes(b.vram)}, {b.vram_note}, short by "
                          f"{fmt_bytes(need - b.vram)}) and its host-mapped fallback needs {_ram_inequality(f, b, False)}; "
                          f"use --weights stream, or --gpu-vram / --ram-budget if a measurement is wrong")
        warn = (f"the device copy needs {fmt_bytes(need)} but the VRAM budget is {fmt_bytes(b.vram)}: "
                f"the load will fall back to host-mapped weights (read across PCIe every token)")
        return Decision("device", (_device_inequality(m, b, False) + " (forced: falls back to host-mapped)", io),
                        arena_limit=arena_limit, direct_io=False, drop_pages=False, warnings=(warn,), **common)

    if regime == "host-mapped":
        if not fits_ram:
            raise Refusal(f"host-mapped weights page-lock the whole file: {_ram_inequality(f, b, False)}, short by "
                          f"{fmt_bytes(m.file_size + b.ram_headroom - b.ram)}; use --weights stream")
        if m.kv_bytes + m.scratch_bytes > b.vram:
            raise Refusal(f"host-mapped needs KV {fmt_bytes(m.kv_bytes)} + scratch {fmt_bytes(m.scratch_bytes)} of VRAM "
                          f"but the budget is {fmt_bytes(b.vram)}; lower --ctx")
        return Decision("host-mapped", (f"--direct-model: kernels read every weight in place from the registered "
                                        f"file mapping; {_ram_inequality(f, b, True)}",
                                        "no VRAM copy: every token reads the weights across PCIe"),
                        fit=_ram_inequality(f, b, True) + " (every token crosses PCIe)", **common)

    if regime == "page-cache":
        if not fits_ram:
            raise Refusal(f"page-cache keeps the whole file in RAM but {_ram_inequality(f, b, False)}, short by "
                          f"{fmt_bytes(m.file_size + b.ram_headroom - b.ram)}; use --weights stream, or --ram-budget "
                          f"if the measurement is wrong")
        slots, cache_reasons, warns = _expert_cache(f, r, b, regime)
        first = f"{_passed_over_device(m, b, r, regime)}, and {_ram_inequality(f, b, True)}"
        io = "reads: buffered from the page cache, pages kept" + (
            f" ({fmt_bytes(m.cached_bytes)} of the file cached now)" if m.cached_bytes else "")
        return Decision("page-cache", (first, *cache_reasons, io), expert_cache_slots=slots,
                        expert_cache_bytes=slots * m.expert_slot_bytes, direct_io=False, drop_pages=False,
                        warnings=tuple(warns), fit=f"{_ram_inequality(f, b, True)}; {cache_reasons[0]}", **common)

    if regime == "stream":
        slots, cache_reasons, warns = _expert_cache(f, r, b, regime)
        direct = not r.no_direct_io and f.direct_io is not False
        drop = not r.keep_model_pages
        first = f"{_passed_over_device(m, b, r, regime)}, and {_ram_inequality(f, b, fits_ram)}"
        return Decision("stream", (first, *cache_reasons, _io_reason(direct, drop, r, f, "expert")),
                        expert_cache_slots=slots, expert_cache_bytes=slots * m.expert_slot_bytes,
                        direct_io=direct, drop_pages=drop, warnings=tuple(warns), fit=cache_reasons[0], **common)
    raise ValueError(f"unknown regime {regime!r}")


def _passed_over_device(m: ModelFacts, b: _Budgets, r: Request, regime: str) -> str:
    """Why device was not taken: its inequality, or the option that vetoed a device that fits."""
    if _device_need(m) > b.vram:
        return _device_inequality(m, b, False)
    return ("--no-model-copy" if r.no_model_copy else f"--weights {regime}") + " (the device copy would fit)"


def _io_reason(direct: bool, drop: bool, r: Request, f: Facts, what: str) -> str:
    if direct:
        how = "O_DIRECT"
    elif r.no_direct_io:
        how = "buffered (--no-direct-io)"
    elif f.direct_io is False:
        how = "buffered (the filesystem refuses O_DIRECT)"
    else:
        how = "buffered (the file fits in RAM: the page cache keeps it for the next start)"
    pages = "pages dropped after use" if drop else (
        "pages kept (--keep-model-pages)" if r.keep_model_pages else "pages kept")
    return f"{what} reads: {how}, {pages}"


def _forced_regime(r: Request) -> str | None:
    if r.direct_model:
        return "host-mapped"
    if r.gpu_vram == 0:
        return "cpu"
    return None if r.weights == "auto" else r.weights


def decide(facts: Facts, request: Request = Request()) -> Decision:
    """The regime for these facts, with the reasons, the runner-up and how to force the others.

    Raises Refusal (one line: the shortfall and what to do) when a forced regime cannot run."""
    b = _budgets(facts, request)
    outcomes: dict[str, Decision | Refusal] = {}
    for regime in REGIMES:
        try:
            outcomes[regime] = _plan(regime, facts, request, b)
        except Refusal as e:
            outcomes[regime] = e

    forced = _forced_regime(request)
    if forced is not None:
        chosen = outcomes[forced]
        if isinstance(chosen, Refusal):
            raise chosen
    else:
        chosen = _auto_choice(outcomes, request)

    alternatives, runner_up = [], None
    for regime in REGIMES:
        if regime == chosen.regime:
            continue
        d = outcomes[regime]
        if isinstance(d, Refusal):
            verdict = f"no: {d}"
        elif d.warnings and regime == "device":
            verdict = "no: " + d.warnings[0]
        else:
            verdict = "fits: " + d.fit
            if runner_up is None and regime in AUTO_ORDER + ("cpu",):
                runner_up = regime
        alternatives.append(Alternative(regime, FORCE_FLAG[regime], verdict))
    if chosen.regime != "cpu" and len(facts.gpus) > 1:
        chosen = replace(chosen, reasons=chosen.reasons + (
            f"GPU 0 of {len(facts.gpus)} ({chosen.gpu.name}): ds4py runs on one GPU; pick it with CUDA_VISIBLE_DEVICES",))
    return replace(chosen, forced=forced is not None, runner_up=runner_up, alternatives=tuple(alternatives))


def _auto_choice(outcomes: dict, request: Request) -> Decision:
    """The first regime of AUTO_ORDER that fits; cpu when there is no GPU or nothing fits."""
    cpu = outcomes["cpu"]
    if cpu.gpu is None:
        return cpu
    for regime in AUTO_ORDER:
        d = outcomes[regime]
        if not isinstance(d, Decision):
            continue
        if regime == "device" and (request.no_model_copy or d.warnings):
            continue            # a device plan that would fall back to host-mapped is never automatic
        return d
    if request.expert_cache_slots is not None or request.expert_cache_bytes is not None:
        raise outcomes["stream"]    # the user's own cache size is what does not fit: say so
    return replace(cpu, reasons=("no GPU regime fits: " + str(outcomes["stream"]),) + cpu.reasons)


# ---- estimates the facts need ---------------------------------------------------------------------

PREFILL_CHUNK = 4096             # tokens per prefill step (ds4's --prefill-chunk default)
CONTEXT_OVERHEAD = 512 * MiB     # CUDA context, modules and allocator slack not seen by NVML before start


def scratch_bytes(spec, prefill_chunk: int = PREFILL_CHUNK, n_ctx: int | None = None) -> int:
    """VRAM the engine needs besides weights and KV: f32 activations of one prefill chunk.

    Per token: the HC residual streams in and out (2 · n_hc · n_embd), the attention queries and
    output (2 · n_head · head_dim), the low-rank projections (q_lora + n_group · o_lora), the routed
    and shared FFN intermediates ((n_used + 1) · 2 · n_ff), the indexer's scores over every
    compressed row (n_ctx / 4), plus one f32 logits row per sequence. (Flash shapes, 32k context:
    the engine allocates ~1.85 GiB for its default 2,048-token chunk; this budgets ds4's 4,096
    tokens, 2.2 GiB, plus the overhead.)"""
    tokens = min(prefill_chunk, n_ctx) if n_ctx else prefill_chunk
    score_rows = spec.compressed_rows(n_ctx, 4) if n_ctx else 0
    per_token = (2 * spec.n_hc * spec.n_embd + 2 * spec.n_head * spec.head_dim + spec.q_lora
                 + spec.n_group * spec.o_lora + (spec.n_used + spec.n_shared) * 2 * spec.n_ff
                 + score_rows) * 4
    return CONTEXT_OVERHEAD + tokens * per_token + 2 * spec.n_vocab * 4
