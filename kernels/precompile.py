"""Compile a model's kernels in parallel worker processes before its first step.

numba compiles a kernel at its first call, one at a time on one core: a machine's first GPU
run spent 69-75 s there on the full-shape model, 48-59 s on the tiny one (H200), and a first CPU
run 14 s on the tiny one (2 cores); later runs load the kernels from numba's disk cache in
seconds. Which kernels a model needs is known once a run has built them: `record` writes the
kernels this process built (a factory of kernels/cuda.py or kernels/cpu.py with its arguments, or
a module-level kernel, and the argument types of each call) into a manifest keyed by the model's
shape and target ("cuda" or "cpu": the CPU engine's keys start with "cpu;"); `compile_in_workers`
hands a manifest's kernels to worker
processes (`python -m ds4py.kernels.precompile FILE`) that compile them into the same disk cache,
so the engine then only loads them. The package ships the manifests of the synthetic tiny and
flash models (flash has ds4's q2 shapes) in `manifest.json`; a user's own runs add theirs to
`~/.cache/ds4py/kernel-manifest.json`, which also remembers which shapes are compiled for the
current kernel sources (SOURCES_DIGEST), so a run whose kernels are cached starts no worker.

The kernels of one Python function share one numba cache index file, which numba rewrites whole:
each function's kernels go to one worker, so two workers never write the same index. On the H200
the first `ds4py run` of the tiny model took 19.9 s with 8 workers against 71.0 s without (session
28). DS4PY_COMPILE_DEBUG=1 shows the workers' output (each kernel compiled or loaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .digest import SOURCES_DIGEST

SHIPPED = Path(__file__).resolve().parent / "manifest.json"
VERSION = 1


def user_manifest_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ds4py" / "kernel-manifest.json"


def shape_key(spec, tensor_types) -> str:
    """What decides which kernels a model builds: its integer dimensions and its tensors' types
    (a q4 file's experts take other kernels than a q2 file's)."""
    dims = {k: v for k, v in sorted(vars(spec).items()) if isinstance(v, int) and not isinstance(v, bool)}
    dims.pop("n_layer", None)                   # layers repeat the same kernels
    return ",".join(f"{k}={v}" for k, v in dims.items()) + ";types=" + ",".join(map(str, sorted(set(tensor_types))))


# ---- argument types as JSON ------------------------------------------------------------------------

def type_to_json(t):
    """A numba argument type as a JSON list, or None for a kind this module does not rebuild."""
    from numba.core import types
    if isinstance(t, types.Array) and isinstance(t.dtype, (types.Integer, types.Float, types.Complex, types.Boolean)):
        return ["array", str(t.dtype), t.ndim, t.layout, not t.mutable]
    if isinstance(t, (types.Integer, types.Float, types.Boolean)):
        return ["scalar", str(t)]
    return None


def type_from_json(j):
    from numba.core import types
    scalar = (lambda name: types.boolean if name == "bool" else getattr(types, name))
    if j[0] == "array":
        return types.Array(scalar(j[1]), j[2], j[3], readonly=j[4])
    return scalar(j[1])


# ---- what this process built -----------------------------------------------------------------------

def _dispatchers(target):
    """(entry without "sig", dispatcher) for every kernel of the target this process can name: the
    factory kernels (the _KERNELS of kernels/cuda.py or kernels/cpu.py) and the module-level
    kernels (cuda.py and cuda_ops.py, or cpu.py and cpu_ops.py). The CPU side imports no numba.cuda."""
    if target == "cpu":
        from numba.core.registry import CPUDispatcher

        from . import cpu, cpu_ops
        factories, modules = cpu._KERNELS, ((cpu, "cpu"), (cpu_ops, "cpu_ops"))
        is_kernel = (lambda obj: isinstance(obj, CPUDispatcher))
    else:
        from numba.cuda.dispatcher import CUDADispatcher

        from . import cuda as CK, cuda_ops as ops
        factories, modules = CK._KERNELS, ((CK, "cuda"), (ops, "ops"))
        # kernels, not device functions (those compile inside the kernels calling them)
        is_kernel = (lambda obj: isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device"))
    kind = "cpu_factory" if target == "cpu" else "factory"
    for key, disp in list(factories.items()):
        yield {"kind": kind, "name": key[0], "args": [_plain(a) for a in key[1:]]}, disp
    for module, kind in modules:
        for name, obj in sorted(vars(module).items()):
            if is_kernel(obj):
                yield {"kind": kind, "name": name}, obj


def built_kernels(target: str = "cuda") -> list[dict]:
    """One entry per (kernel, argument types) of the target this process has compiled or loaded."""
    entries = []
    for entry, disp in _dispatchers(target):
        py = disp.py_func
        fn = f"{py.__module__}.{py.__qualname__}:{py.__code__.co_firstlineno}"   # its cache index file
        for sig in list(disp.overloads):
            sig_json = [type_to_json(t) for t in sig]
            if all(j is not None for j in sig_json):
                entries.append(dict(entry, fn=fn, sig=sig_json))
    return entries


def built_once(table: dict, factory, *args):
    """factory(*args), built once per process and kept in table (kernels/cuda.py's and
    kernels/cpu.py's _KERNELS) under (factory name, *args): the entry `record` writes and a worker
    rebuilds the kernel from (numpy scalars as Python ones, as the worker's JSON gives them back)."""
    args = tuple(_plain(a) for a in args)
    key = (factory.__name__,) + args
    if key not in table:
        table[key] = factory(*args)
    return table[key]


def _plain(value):
    """A factory argument as JSON keeps it (numpy scalars as Python ones)."""
    return value.item() if hasattr(value, "item") else value


def _dispatcher_for(entry):
    kind = entry["kind"]
    if kind in ("cpu_factory", "cpu", "cpu_ops"):
        from . import cpu, cpu_ops
        if kind == "cpu_factory":
            return cpu._cached(getattr(cpu, entry["name"]), *entry["args"])
        return getattr(cpu if kind == "cpu" else cpu_ops, entry["name"])
    from . import cuda as CK, cuda_ops as ops
    if kind == "factory":
        return CK._cached(getattr(CK, entry["name"]), *entry["args"])
    return getattr(CK if kind == "cuda" else ops, entry["name"])


def _group(entry):
    """Entries whose kernels share a numba cache index file: one Python function (two module
    kernels may come from one factory function, attention_combine and attention_combine_one)."""
    return entry.get("fn") or (entry["kind"], entry["name"])


# ---- manifests -------------------------------------------------------------------------------------

def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if data.get("version") == VERSION else {}
    except (OSError, ValueError, AttributeError):
        return {}


def _identity(entry: dict) -> str:
    """What makes two manifest entries the same kernel: everything but "fn" (a line number, which
    an edit of the source moves)."""
    return json.dumps({k: v for k, v in entry.items() if k != "fn"}, sort_keys=True)


def manifest_for(key: str) -> list[dict]:
    """The kernels a model of this shape built before: the user's runs', then those of the
    package's manifest the user's runs have not built (a short run builds fewer), each kernel once
    (_identity)."""
    kernels, seen = [], set()
    for path in (user_manifest_path(), SHIPPED):
        for e in _read(path).get("shapes", {}).get(key, []):
            what = _identity(e)
            if what not in seen:
                seen.add(what)
                kernels.append(e)
    return kernels


def with_decode_attention(kernels: list[dict], f64: bool) -> list[dict]:
    """kernels with each decode attention entry (a manifest names the kernel its GPU's --attention
    took) naming the one this run takes, its partial arrays (the last three arguments) in that
    arithmetic's float type, each entry once: the package's manifest, recorded on an H200 (f64 on
    the tensor cores), then has the workers compile the f32 kernel of a GeForce card."""
    from . import cuda_ops as ops
    name, ft = ops.decode_attention_name(f64), ("float64" if f64 else "float32")
    out, seen = [], set()
    for e in kernels:
        if e.get("kind") == "ops" and e["name"] in ops.DECODE_ATTENTION_KERNELS:
            e = dict(e, name=name, sig=e["sig"][:-3] + [[a[0], ft, *a[2:]] for a in e["sig"][-3:]])
        what = _identity(e)
        if what not in seen:
            seen.add(what)
            out.append(e)
    return out


def compiled_for_these_sources(key: str) -> bool:
    return _read(user_manifest_path()).get("compiled", {}).get(key) == SOURCES_DIGEST


def record(key: str, path: Path | None = None, kernels: list[dict] | None = None, target: str = "cuda") -> None:
    """Add what this process built for target to the manifest at path (the user's by default) under
    key, and mark the shape compiled for the current sources. Never raises: a manifest is an
    optimisation."""
    path = path or user_manifest_path()
    try:
        data = _read(path) or {"version": VERSION}
        shapes = data.setdefault("shapes", {})
        known = {json.dumps(e, sort_keys=True) for e in shapes.get(key, [])}
        new = [e for e in (kernels if kernels is not None else built_kernels(target))
               if json.dumps(e, sort_keys=True) not in known]
        if not new and data.get("compiled", {}).get(key) == SOURCES_DIGEST:
            return
        if new:
            shapes[key] = shapes.get(key, []) + new
        data.setdefault("compiled", {})[key] = SOURCES_DIGEST
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")       # two runs closing at once: each its own file
        tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
        tmp.replace(path)
    except Exception:             # an unwritable cache, an argument JSON cannot hold: no manifest
        pass


_WORKER_STDERR = None if os.environ.get("DS4PY_COMPILE_DEBUG") else subprocess.DEVNULL


def default_jobs() -> int:
    """One worker per CPU up to 8: the parent only waits for them."""
    return max(1, min(8, os.cpu_count() or 1))


# ---- the workers -----------------------------------------------------------------------------------

def split_for_workers(kernels: list[dict], jobs: int) -> list[list[dict]]:
    """At most `jobs` lists, every function's kernels in one of them, the biggest groups first
    into the lightest list."""
    groups: dict[tuple, list[dict]] = {}
    for e in kernels:
        groups.setdefault(_group(e), []).append(e)
    bins: list[list[dict]] = [[] for _ in range(max(1, min(jobs, len(groups))))]
    for g in sorted(groups.values(), key=len, reverse=True):
        min(bins, key=len).extend(g)
    return bins


def compile_in_workers(kernels: list[dict], jobs: int, on_done=None) -> tuple[float, list[str]]:
    """Compile kernels into the disk cache in `jobs` worker processes; on_done(n) after each kernel.
    Returns (seconds, failure lines). Kernels of one function stay in one worker (_group)."""
    bins = split_for_workers(kernels, jobs)
    t0 = time.perf_counter()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ds4py-compile-") as tmp:
        procs = []
        for i, part in enumerate(bins):
            job = Path(tmp) / f"part{i}.json"
            job.write_text(json.dumps(part))
            procs.append(subprocess.Popen([sys.executable, "-m", "ds4py.kernels.precompile", str(job)],
                                          stdout=subprocess.PIPE, stderr=_WORKER_STDERR, text=True))

        def read(proc):
            for line in proc.stdout:
                if _WORKER_STDERR is None:
                    print("[worker]", line.rstrip(), file=sys.stderr, flush=True)
                if line.startswith("ok") and on_done:
                    on_done(1)
                elif line.startswith("failed"):
                    failures.append(line.strip())

        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
        for r in readers:
            r.start()
        for p, r in zip(procs, readers):
            p.wait()
            r.join()
            if p.returncode:
                failures.append(f"a compile worker exited with status {p.returncode}")
    return time.perf_counter() - t0, failures


def _worker(job: Path) -> int:
    """Compile each kernel of the job file; one line per kernel on stdout ("ok" / "failed ...")."""
    from . import compat  # noqa: F401  (the numpy shim before the first CUDA compile)
    for entry in json.loads(job.read_text()):
        try:
            disp = _dispatcher_for(entry)
            hits = sum(disp._cache_hits.values())
            disp.compile(tuple(type_from_json(j) for j in entry["sig"]))
            print("ok", entry["name"], "loaded" if sum(disp._cache_hits.values()) > hits else "compiled", flush=True)
        except Exception as e:           # a renamed factory, a changed signature: built lazily instead
            print(f"failed {entry['kind']} {entry['name']}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker(Path(sys.argv[1])))
