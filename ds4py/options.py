"""The weight and memory options, defined once: flags, environment twins, parsing, conflicts.

`OPTIONS` is the single table. From it come the typer parameters of every command that loads
weights (`@weight_options` adds them to a command and hands it one `WeightOptions`), the README
table (`markdown_table()`, checked by a test), and what `ds4py probe` prints.

Precedence: flag > environment > default/auto. Environment names are ds4's where ds4 has the knob
(antirez/ds4, see docs/weight-residency.md §3) and `DS4PY_*` otherwise. Booleans read 1/true/yes/on
and 0/false/no/off (ds4 treats any value as "set"; here `=0` means off). Sizes are binary: 512M,
80G, 80GiB, 1.5T (G = GB = GiB = 2^30, as in ds4); a bare number is GiB for --gpu-vram and
--ram-budget, and a slot count for --ssd-streaming-cache-experts (ds4's N|NGB).

Every bad value, from a flag or from the environment, and every conflicting pair of choices is one
`Ds4Error` line naming the option (and, for conflicts, both options with where each came from).

Using it in a command:

    @app.command()
    @weight_options
    def run(prompt: str, weights: WeightOptions = None):
        ...                            # weights.weights, weights.n_ctx, weights.sources["n_ctx"], ...
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from ds4py.errors import Ds4Error

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
_UNITS = {"": None, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_TRUE, _FALSE = {"1", "true", "yes", "on", "y", "t"}, {"0", "false", "no", "off", "n", "f"}

WEIGHT_CHOICES = ("auto", "device", "page-cache", "stream")
ATTENTION_CHOICES = ("auto", "f64", "f32")
_WEIGHT_ALIASES = {"pagecache": "page-cache", "page_cache": "page-cache", "direct": "stream",
                   "streaming": "stream", "ssd-streaming": "stream", "gpu": "device", "vram": "device"}
DEFAULT_CTX = 32768                 # ds4's -c/--ctx default; KV is 0.44 GiB there on the q2 model
MAX_CTX = 1 << 20                   # DeepSeek-V4's 1M-token context
COPY_CHUNK_MB_RANGE = (16, 4096)    # ds4's clamp for DS4_CUDA_MODEL_COPY_CHUNK_MB
DEFAULT_PREFILL_CHUNK = 2048        # tokens per GPU prefill chunk (ds4: 4096). H200, session 17: 2,775 tok/s at 2k
                                    # against 1,651 with 512, whose chunks (~1,850 eager launches) took
                                    # ~310 ms for 205 ms of kernels: the host's enqueue bound them
MAX_PREFILL_CHUNK = 4096            # ds4's default, the chunk io/detect.py budgets VRAM scratch for


# ---- value parsers (each raises Ds4Error with the option's name) -----------------------------------

def parse_size(text: str, what: str, bare_unit: int = GiB) -> int:
    """'80G', '80GB', '80GiB', '512m', '1.5T', '4096k' -> bytes; a bare number is in bare_unit."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise Ds4Error(f"{what}: {text!r} is not a size; write e.g. 80G, 512M or 1.5T (binary units)")
    unit = _UNITS[m.group(2)] or bare_unit
    return int(float(m.group(1)) * unit)


def parse_bool(text: str, what: str) -> bool:
    v = str(text).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise Ds4Error(f"{what}: {text!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _parse_weights(text: str) -> str:
    v = str(text).strip().lower()
    v = _WEIGHT_ALIASES.get(v, v)
    if v not in WEIGHT_CHOICES:
        raise Ds4Error(f"--weights: {text!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    return v


def _parse_attention(text: str) -> str:
    v = str(text).strip().lower()
    if v not in ATTENTION_CHOICES:
        raise Ds4Error(f"--attention: {text!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    return v


def _parse_auto_size(what: str):
    def parse(text: str):
        if str(text).strip().lower() == "auto":
            return None
        return parse_size(text, what)
    return parse


def _parse_cache(text: str):
    """auto | N slots | SIZE -> None | ("slots", N) | ("bytes", B)."""
    v = str(text).strip().lower()
    if v == "auto":
        return None
    if re.fullmatch(r"[0-9]+", v):
        return ("slots", int(v))
    return ("bytes", parse_size(v, "--ssd-streaming-cache-experts"))


def _parse_int(what: str, lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*([0-9]+)\s*([kK]?)\s*", str(text))
        if not m:
            raise Ds4Error(f"{what}: {text!r} is not a whole number")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < lo or (hi is not None and n > hi):
            raise Ds4Error(f"{what}: {n} is outside {lo}..{hi if hi is not None else '∞'}")
        return n
    return parse


def _parse_chunk_mb(text: str) -> int:
    # any positive count parses; resolve() clamps to ds4's 16..4096 and says so
    return _parse_int("--copy-chunk-mb", 1)(text)


def _identity(value):
    return value


# ---- the table -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Opt:
    dest: str                    # WeightOptions field and typer parameter name
    flag: str
    env: str
    kind: str                    # "bool" or "value"
    default: object              # value when neither flag nor environment gives one
    metavar: str
    help: str
    parse: Callable[[str], object] = _identity
    from_ds4: bool = False       # the environment name is ds4's own

    @property
    def default_text(self) -> str:
        if self.kind == "bool":
            return "off"
        return "auto" if self.default is None else str(self.default)


OPTIONS: tuple[Opt, ...] = (
    Opt("weights", "--weights", "DS4PY_WEIGHTS", "value", "auto", "MODE",
        "Where the weights live: auto (measure and pick), device (all in VRAM), page-cache (file kept in RAM, "
        "experts cached in VRAM) or stream (experts read from disk on demand, O_DIRECT).",
        _parse_weights),
    Opt("gpu_resident", "--gpu-resident", "DS4_CUDA_COPY_MODEL_CHUNKED", "bool", False, "",
        "Copy the whole model into VRAM at load (same as --weights device).", from_ds4=True),
    Opt("no_direct_io", "--no-direct-io", "DS4_CUDA_NO_DIRECT_IO", "bool", False, "",
        "Never read the model with O_DIRECT; use buffered reads through the page cache.", from_ds4=True),
    Opt("keep_model_pages", "--keep-model-pages", "DS4_CUDA_KEEP_MODEL_PAGES", "bool", False, "",
        "Never drop the model's file pages (no madvise/fadvise DONTNEED) after uploading them.", from_ds4=True),
    Opt("no_model_copy", "--no-model-copy", "DS4_CUDA_NO_MODEL_COPY", "bool", False, "",
        "Never copy the whole model into VRAM (auto then picks page-cache or stream).", from_ds4=True),
    Opt("direct_model", "--direct-model", "DS4_CUDA_DIRECT_MODEL", "bool", False, "",
        "Host-mapped weights: register the file mapping with the driver and let kernels read it in place "
        "across PCIe (no VRAM copy; slow, for debugging and tiny GPUs).", from_ds4=True),
    Opt("copy_chunk_mb", "--copy-chunk-mb", "DS4_CUDA_MODEL_COPY_CHUNK_MB", "value", 64, "MiB",
        "Size of each of the 4 pinned staging buffers for weight uploads (clamped to 16..4096).",
        _parse_chunk_mb, from_ds4=True),
    Opt("gpu_vram", "--gpu-vram", "DS4PY_GPU_VRAM", "value", None, "SIZE",
        "VRAM budget: auto = free - max(2 GiB, 5 %) as measured by NVML; SIZE overrides it (bare number = "
        "GiB); 0 runs on the CPU.", _parse_auto_size("--gpu-vram")),
    Opt("expert_cache", "--ssd-streaming-cache-experts", "DS4PY_SSD_STREAMING_CACHE_EXPERTS", "value", None, "N|SIZE",
        "VRAM expert cache for page-cache and stream: N slots of one (layer, expert), or a SIZE budget; "
        "auto = all VRAM left after dense weights, KV and scratch.", _parse_cache),
    Opt("ram_budget", "--ram-budget", "DS4PY_RAM_BUDGET", "value", None, "SIZE",
        "RAM the page cache may hold for the model: auto = available RAM (psutil) minus max(4 GiB, 5 %); "
        "SIZE overrides it (for hosts whose reported RAM grows as it is used).",
        _parse_auto_size("--ram-budget")),
    Opt("n_ctx", "--ctx", "DS4PY_CTX", "value", DEFAULT_CTX, "N",
        "Context length to allocate (tokens; 32k = 32768); sizes the KV cache the detector budgets for.",
        _parse_int("--ctx", 1, MAX_CTX)),
    Opt("prefill_chunk", "--prefill-chunk", "DS4PY_PREFILL_CHUNK", "value", DEFAULT_PREFILL_CHUNK, "N",
        "Tokens per GPU prefill chunk (ds4's --prefill-chunk): larger chunks give the grouped experts "
        "fuller tensor-core tiles and fewer host launches per token, and need more VRAM scratch.",
        _parse_int("--prefill-chunk", 1, MAX_PREFILL_CHUNK)),
    Opt("no_pdl", "--no-pdl", "DS4PY_NO_PDL", "bool", False, "",
        "Replay the GPU decode graph with ordinary edges. By default (sm_90+) each kernel is launched "
        "while the one before it finishes (programmatic dependent launch)."),
    Opt("attention", "--attention", "DS4PY_ATTENTION", "value", "auto", "MODE",
        "Decode attention's arithmetic on the GPU: f64 (the CPU engine's numerics: the same scores to "
        "~1e-16), f32 (faster where f64 is slow), or auto: f64 on GPUs with full-rate f64 (A100, H100, "
        "H200, B200), f32 on the others (GeForce, RTX workstation, L4/L40: f64 at 1/64 of f32).",
        _parse_attention),
    Opt("warm_weights", "--warm-weights", "DS4PY_WARM_WEIGHTS", "bool", False, "",
        "Fault the whole file into the page cache before loading (MADV_POPULATE_READ, with progress)."),
    Opt("io_threads", "--io-threads", "DS4PY_IO_THREADS", "value", 0, "N",
        "Reader threads filling the staging buffers (0 = auto: min(16, CPUs)).", _parse_int("--io-threads", 0, 256)),
    Opt("compile_jobs", "--compile-jobs", "DS4PY_COMPILE_JOBS", "value", 0, "N",
        "Processes compiling the kernels (CUDA, or the CPU engine's) of a model shape seen before when "
        "the kernel cache lacks them (a first run, an upgrade; the package knows the tiny and full-size "
        "q2 shapes): 0 = auto (min(8, CPUs)); 1 compiles at first use, one kernel at a time.",
        _parse_int("--compile-jobs", 0, 256)),
)
BY_DEST = {o.dest: o for o in OPTIONS}


# ---- resolved options ----------------------------------------------------------------------------

@dataclass
class WeightOptions:
    weights: str = "auto"
    gpu_resident: bool = False
    no_direct_io: bool = False
    keep_model_pages: bool = False
    no_model_copy: bool = False
    direct_model: bool = False
    copy_chunk_mb: int = 64
    gpu_vram: int | None = None
    expert_cache: tuple[str, int] | None = None
    ram_budget: int | None = None
    n_ctx: int = DEFAULT_CTX
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    no_pdl: bool = False
    attention: str = "auto"
    warm_weights: bool = False
    io_threads: int = 0
    compile_jobs: int = 0
    sources: dict[str, str] = field(default_factory=dict)   # dest -> "flag" | "env" | "default"
    given: dict[str, str] = field(default_factory=dict)     # dest -> the text the user wrote
    notes: list[str] = field(default_factory=list)          # e.g. clamping

    @property
    def regime_request(self) -> str:
        """The --weights choice with --gpu-resident folded in."""
        return "device" if self.gpu_resident else self.weights

    def to_request(self):
        from ds4py.io.detect import Request
        slots = self.expert_cache[1] if self.expert_cache and self.expert_cache[0] == "slots" else None
        nbytes = self.expert_cache[1] if self.expert_cache and self.expert_cache[0] == "bytes" else None
        return Request(weights=self.regime_request, direct_model=self.direct_model,
                       no_model_copy=self.no_model_copy, no_direct_io=self.no_direct_io,
                       keep_model_pages=self.keep_model_pages, gpu_vram=self.gpu_vram,
                       ram_budget=self.ram_budget, expert_cache_slots=slots, expert_cache_bytes=nbytes)

    def value_text(self, dest: str) -> str:
        value = getattr(self, dest)
        opt = BY_DEST[dest]
        if opt.kind == "bool":
            return "on" if value else "off"
        if value is None:
            return "auto"
        if dest in ("gpu_vram", "ram_budget"):
            return _size_text(value)
        if dest == "expert_cache":
            return f"{value[1]} slots" if value[0] == "slots" else _size_text(value[1])
        return str(value)

    def origin(self, dest: str) -> str:
        """How the user set an option, for messages: '--flag' or 'ENV=value'."""
        opt = BY_DEST[dest]
        if self.sources.get(dest) == "env":
            return f"{opt.env}={self.given.get(dest, '')}"
        if opt.kind == "bool":
            return opt.flag
        return f"{opt.flag} {self.given.get(dest, self.value_text(dest))}"

    def table(self) -> list[dict]:
        """One row per option: name, value, source, env — what `probe` prints."""
        return [{"option": o.flag, "value": self.value_text(o.dest), "source": self.sources.get(o.dest, "default"),
                 "env": o.env} for o in OPTIONS]


def _size_text(n: int) -> str:
    from ds4py.io.detect import fmt_bytes
    return fmt_bytes(n)


def resolve(flag_values: dict[str, object], environ=None) -> WeightOptions:
    """Options from explicit values (flags, already parsed or raw text) over the environment.

    `flag_values` maps dest -> value for the options given on the command line (or by a caller);
    the environment fills the rest; defaults fill what is left. Raises Ds4Error on a bad value or a
    conflicting pair."""
    environ = os.environ if environ is None else environ
    opts = WeightOptions()
    for opt in OPTIONS:
        if opt.dest in flag_values and flag_values[opt.dest] is not None:
            raw, source = flag_values[opt.dest], "flag"
        elif environ.get(opt.env, "").strip() != "":
            raw, source = environ[opt.env], "env"
        else:
            raw, source = None, "default"
        if raw is None:
            value = opt.default
        elif opt.kind == "bool":
            value = raw if isinstance(raw, bool) else parse_bool(raw, opt.env if source == "env" else opt.flag)
        else:
            value = opt.parse(raw) if isinstance(raw, str) else raw
        if isinstance(raw, str):
            opts.given[opt.dest] = raw
        setattr(opts, opt.dest, value)
        opts.sources[opt.dest] = source
    _clamp_chunk(opts)
    check_conflicts(opts)
    return opts


def _clamp_chunk(opts: WeightOptions) -> None:
    lo, hi = COPY_CHUNK_MB_RANGE
    if not lo <= opts.copy_chunk_mb <= hi:
        clamped = min(max(opts.copy_chunk_mb, lo), hi)
        opts.notes.append(f"--copy-chunk-mb {opts.copy_chunk_mb} clamped to {clamped} (range {lo}..{hi}, as ds4)")
        opts.copy_chunk_mb = clamped


def check_conflicts(o: WeightOptions) -> None:
    """Raise Ds4Error naming both options of the first contradictory pair."""
    def on(dest):
        v = getattr(o, dest)
        return v is not None and v is not False and not (dest == "weights" and v == "auto")

    def clash(a: str, b: str, why: str):
        raise Ds4Error(f"{o.origin(a)} conflicts with {o.origin(b)}: {why}; drop one of them")

    device = o.weights == "device"
    if o.gpu_resident and o.weights in ("page-cache", "stream"):
        clash("gpu_resident", "weights", "--gpu-resident asks for the device regime")
    for vetoer in ("no_model_copy", "direct_model"):
        if on(vetoer):
            if device:
                clash("weights", vetoer, f"device copies the model into VRAM, {BY_DEST[vetoer].flag} forbids that copy")
            if o.gpu_resident:
                clash("gpu_resident", vetoer, f"--gpu-resident copies the model into VRAM, {BY_DEST[vetoer].flag} forbids it")
    if o.direct_model and o.weights in ("page-cache", "stream"):
        clash("weights", "direct_model", "--direct-model reads every weight host-mapped, with no VRAM copy or expert cache")
    if o.expert_cache is not None:
        for other in ("weights", "gpu_resident", "direct_model"):
            if on(other) and (other != "weights" or device):
                clash(other, "expert_cache", "that regime has no expert cache")
    if o.warm_weights and o.weights == "stream" and not o.keep_model_pages:
        clash("weights", "warm_weights", "stream mode drops the pages --warm-weights fills (add --keep-model-pages to keep them)")
    if o.gpu_vram == 0:
        for other in ("weights", "gpu_resident", "direct_model", "expert_cache"):
            if on(other):
                clash("gpu_vram", other, "--gpu-vram 0 selects the CPU path")


def from_env(environ=None, **flags) -> WeightOptions:
    """For library callers and tests: keyword arguments act as flags over the environment."""
    unknown = set(flags) - set(BY_DEST)
    if unknown:
        raise TypeError(f"unknown weight options: {', '.join(sorted(unknown))}")
    return resolve(flags, environ)


# ---- typer glue -----------------------------------------------------------------------------------

def _check_environment(ctx=None, param=None, value=None):
    """Eager callback: vet every option's environment variable before typer parses them, so a bad
    value is one clean `error:` line rather than a usage box."""
    for opt in OPTIONS:
        raw = os.environ.get(opt.env, "")
        if raw.strip() == "":
            continue
        if opt.kind == "bool":
            parse_bool(raw, opt.env)
        else:
            try:
                opt.parse(raw)
            except Ds4Error as e:
                raise Ds4Error(f"{opt.env}={raw!r}: {str(e).split(': ', 1)[-1]}") from None
    return value


def _env_parser(opt: Opt):
    def parse(text):
        if isinstance(text, str):
            opt.parse(text)          # validate now (one-line error); resolve() parses again
        return text
    return parse


def typer_parameters() -> list[inspect.Parameter]:
    import typer
    params = [inspect.Parameter("_ds4py_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    for i, opt in enumerate(OPTIONS):
        help_text = opt.help + ("" if opt.kind == "bool" else f" [default: {opt.default_text}]")
        extra = {"callback": _check_environment, "is_eager": True} if i == 0 else {}
        if opt.kind == "bool":
            default = typer.Option(False, opt.flag, envvar=opt.env, show_envvar=True, help=help_text,
                                   show_default=False, rich_help_panel="Weights and memory", **extra)
            annotation = bool
        else:
            default = typer.Option(None, opt.flag, envvar=opt.env, show_envvar=True, help=help_text,
                                   metavar=opt.metavar, show_default=False, parser=_env_parser(opt),
                                   rich_help_panel="Weights and memory", **extra)
            annotation = Optional[str]
        params.append(inspect.Parameter(opt.dest, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
    return params


def _source_of(ctx, opt: Opt, value) -> str:
    getter = getattr(ctx, "get_parameter_source", None)
    if getter is not None:
        src = getter(opt.dest)
        name = getattr(src, "name", str(src)).upper()
        if "COMMANDLINE" in name:
            return "flag"
        if "ENVIRONMENT" in name:
            return "env"
        return "default"
    if os.environ.get(opt.env, "").strip():
        return "env"
    return "default" if value in (None, False) else "flag"


def _evaluated(annotation, fn):
    """A string annotation (from `from __future__ import annotations`) as the object it names."""
    if isinstance(annotation, str):
        return eval(annotation, fn.__globals__)   # noqa: S307 - the module's own annotation text
    return annotation


def weight_options(fn):
    """Decorator: add every option of OPTIONS to a typer command; it receives `weights=WeightOptions`.

    Put it below `@app.command()`. The command declares a `weights` parameter (any default); the
    decorator replaces it with the table's options in the signature typer reads."""
    sig = inspect.signature(fn)
    if "weights" not in sig.parameters:
        raise TypeError(f"{fn.__name__} needs a `weights` parameter to receive WeightOptions")
    own = [p.replace(annotation=_evaluated(p.annotation, fn)) for name, p in sig.parameters.items()
           if name != "weights"]
    added = typer_parameters()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = kwargs.pop("_ds4py_ctx")
        flags = {}
        for opt in OPTIONS:
            value = kwargs.pop(opt.dest)
            if _source_of(ctx, opt, value) == "flag":
                flags[opt.dest] = value
        kwargs["weights"] = resolve(flags)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + added)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
    del wrapper.__wrapped__          # typer must read the new signature, not fn's
    return wrapper


# ---- documentation -------------------------------------------------------------------------------

def markdown_table() -> str:
    """The options table for README.md (a test keeps the README in sync with it)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        metavar = o.metavar.replace("|", "\\|")      # a bare | would end the table cell
        flag = f"`{o.flag}`" + (f" `{metavar}`" if o.kind != "bool" else "")
        env = f"`{o.env}`" + (" (ds4)" if o.from_ds4 else "")
        rows.append(f"| {flag} | {env} | {o.default_text} | {o.help.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
