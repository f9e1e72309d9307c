"""kernels/precompile.py without a GPU: argument types as JSON, the manifest's keys and files, the
split over workers, and a worker's report of a kernel it cannot build (the GPU side:
test_forward_cuda.py::test_recorded_kernels_rebuild_in_workers)."""

import json

import pytest
from numba.core import types

from ds4py import synth
from ds4py.kernels import precompile as P


@pytest.mark.parametrize("t", [types.Array(types.float32, 1, "C"), types.Array(types.int8, 2, "C"),
                               types.Array(types.float32, 2, "A"), types.Array(types.uint32, 1, "C", readonly=True),
                               types.Array(types.float64, 3, "C"), types.Array(types.complex64, 1, "C"), types.int64, types.float32, types.float64,
                               types.uint32, types.boolean])
def test_argument_types_survive_json(t):
    j = P.type_to_json(t)
    assert P.type_from_json(json.loads(json.dumps(j))) == t


def test_other_argument_kinds_are_left_out():
    assert P.type_to_json(types.UniTuple(types.int64, 2)) is None


def test_shape_key_follows_dimensions_and_types_not_depth():
    tiny, flash = synth.preset_spec("tiny"), synth.preset_spec("flash")
    q2 = (8, 10, 16, 1, 0)
    assert P.shape_key(tiny, q2) != P.shape_key(flash, q2)
    deeper = type(flash)(**{**vars(flash), "n_layer": flash.n_layer + 1})
    assert P.shape_key(deeper, q2) == P.shape_key(flash, q2)
    assert P.shape_key(flash, q2 + (12,)) != P.shape_key(flash, q2)


def _entry(name, n, kind="factory"):
    return {"kind": kind, "name": name, "args": [n], "sig": [["scalar", "int64"]]}


def test_manifest_records_merges_and_marks_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(P, "SHIPPED", tmp_path / "shipped.json")
    assert P.manifest_for("k") == [] and not P.compiled_for_these_sources("k")
    P.record("k", kernels=[_entry("f", 1)])
    assert P.manifest_for("k") == [_entry("f", 1)] and P.compiled_for_these_sources("k")
    P.record("k", kernels=[_entry("f", 1), _entry("g", 2)])          # only the new one is added
    assert P.manifest_for("k") == [_entry("f", 1), _entry("g", 2)]
    # the package's manifest serves a shape the user has not run; a digest change re-arms the workers
    (tmp_path / "shipped.json").write_text(json.dumps({"version": P.VERSION, "shapes": {
        "s": [_entry("h", 3)], "k": [dict(_entry("g", 2), fn="old:1"), _entry("h", 4)]}}))
    assert P.manifest_for("s") == [_entry("h", 3)] and not P.compiled_for_these_sources("s")
    # both manifests for one shape: the user's kernels, then the package's others, each once
    assert P.manifest_for("k") == [_entry("f", 1), _entry("g", 2), _entry("h", 4)]
    (tmp_path / "shipped.json").write_text(json.dumps({"version": P.VERSION, "shapes": {"s": [_entry("h", 3)]}}))
    monkeypatch.setattr(P, "SOURCES_DIGEST", "another")
    assert not P.compiled_for_these_sources("k")
    P.record("k", kernels=[])
    assert P.compiled_for_these_sources("k") and len(P.manifest_for("k")) == 2
    (tmp_path / "ds4py" / "kernel-manifest.json").write_text("not json")   # a broken file is no manifest
    assert P.manifest_for("k") == [] and not P.compiled_for_these_sources("k")


def test_split_groups_by_function_when_known():
    """Two module kernels built by one factory function share its cache index: one worker."""
    a = dict(_entry("attention_combine", 0, "ops"), fn="m.f:1")
    b = dict(_entry("attention_combine_one", 0, "ops"), fn="m.f:1")
    c = dict(_entry("hc_pre", 0, "ops"), fn="m.g:9")
    bins = P.split_for_workers([a, b, c], 8)
    assert len(bins) == 2 and any(a in x and b in x for x in bins)


def test_split_keeps_each_function_in_one_worker():
    kernels = [_entry("f", i) for i in range(5)] + [_entry("g", i) for i in range(3)] + \
              [_entry("hc_pre", 0, "ops"), _entry("embed", 0, "ops")]
    bins = P.split_for_workers(kernels, 3)
    assert len(bins) == 3 and sorted(map(len, bins)) == [2, 3, 5]
    assert sorted(json.dumps(e) for b in bins for e in b) == sorted(json.dumps(e) for e in kernels)
    for name in ("f", "g"):
        assert sum(any(e["name"] == name for e in b) for b in bins) == 1
    assert len(P.split_for_workers(kernels, 64)) == 4 and len(P.split_for_workers(kernels[:1], 0)) == 1


def test_a_worker_reports_what_it_cannot_build():
    """A factory that no longer exists: the worker says so on one line and the rest goes on."""
    done = []
    seconds, failures = P.compile_in_workers([_entry("_no_such_factory", 1)], 2, on_done=done.append)
    assert done == [] and len(failures) == 1
    assert failures[0].startswith("failed factory _no_such_factory: AttributeError")


_KEY_SCRIPT = """
import hashlib, sys
if sys.argv[1] == "engine-first":
    import ds4py.forward_cuda, ds4py.cli  # noqa: F401  (the order `ds4py run` and scripts import in)
from numba.core.serialize import dumps
from ds4py.kernels import cuda as CK, cuda_ops as ops
for k in (CK._cached(CK._q8_0_kernel, 1, 1, 4, False, True), ops.attention_combine):
    cells = tuple(c.cell_contents for c in k.py_func.__closure__)
    print(hashlib.sha256(dumps(cells)).hexdigest())
"""


def test_kernel_cache_keys_do_not_depend_on_import_order():
    """numba keys a cached kernel by a pickle of its closure, which reaches the intrinsics' code:
    had they named `numba.types` (a redirect module, pickled by value in some import orders) a
    process importing the engine first would miss every kernel a compile worker cached."""
    import subprocess
    import sys
    runs = [subprocess.run([sys.executable, "-c", _KEY_SCRIPT, order], capture_output=True, text=True)
            for order in ("kernels-first", "engine-first")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout.split() == runs[1].stdout.split() and len(runs[0].stdout.split()) == 2


def test_every_module_kernel_is_disk_cached():
    """A kernel built with plain cuda.jit compiles again in every process (attention_combine and
    attention_prefill_mma did: ~4 s of each flash run) and its workers' output would be lost."""
    from numba.cuda.dispatcher import CUDADispatcher

    from ds4py.kernels import cuda as CK, cuda_ops as ops
    kernels = {f"{m.__name__}.{n}": o for m in (CK, ops) for n, o in vars(m).items()
               if isinstance(o, CUDADispatcher) and not o.targetoptions.get("device")}
    assert len(kernels) > 30
    assert [n for n, k in kernels.items() if type(k._cache).__name__ != "KernelCache"] == []


def _shipped_keys(tiny_model) -> tuple[str, str]:
    """The CUDA manifest keys of the tiny model and of the flash preset (its tensors' types)."""
    from ds4py.engine import kernel_key
    from ds4py.io.spec import open_model
    model = open_model(tiny_model)
    try:
        return kernel_key(model), P.shape_key(synth.preset_spec("flash"),
                                              [t.ggml_type for t in model.file.tensors.values()])
    finally:
        model.close()


def test_the_shipped_manifest_covers_tiny_and_flash_and_matches_the_code(tiny_model, tmp_path, monkeypatch):
    """kernels/manifest.json (recorded on the H200 by `ds4py run` on the embedded tiny model and
    the flash preset, ds4's q2 shapes, and on a CPU-only machine for the tiny model's CPU engine)
    names kernels that exist, with as many argument types as each kernel takes: a renamed factory
    or a changed kernel signature makes it stale (re-record it with scripts/device-precompile.sh,
    or a CPU `ds4py run`, and scripts/merge_manifest.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # no user manifest in the way
    tiny_key, flash_key = _shipped_keys(tiny_model)
    for key, least in ((tiny_key, 40), (flash_key, 40), ("cpu;" + tiny_key, 30)):
        kernels = P.manifest_for(key)
        assert len(kernels) >= least, key
        for e in kernels:
            disp = P._dispatcher_for(e)
            assert disp.py_func.__code__.co_argcount == len(e["sig"]), e["name"]
            assert all(P.type_from_json(j) is not None for j in e["sig"])


def test_workers_compile_the_decode_attention_this_gpu_takes(tiny_model, tmp_path, monkeypatch):
    """The package's manifest names the decode attention its recording GPU ran (an H200: f64 on the
    tensor cores); with_decode_attention makes the workers compile the kernel this run takes, with
    the argument types scripts/check_cuda_compile.py compiles it with (its partials f32 for --attention
    f32), each entry once, every other entry as it was."""
    import runpy
    from pathlib import Path

    from ds4py.kernels import cuda_ops as ops
    path = Path(__file__).resolve().parents[1] / "scripts" / "check_cuda_compile.py"
    catalogue = runpy.run_path(str(path), run_name="catalogue")["sigs"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # no user manifest in the way
    kernels = P.manifest_for(_shipped_keys(tiny_model)[1])
    is_attention = (lambda e: e["kind"] == "ops" and e["name"] in ops.DECODE_ATTENTION_KERNELS)
    assert sum(map(is_attention, kernels)) == 1
    for f64, tc, want in ((True, True, "attention_partial_tc"), (False, True, "attention_partial_f32"),
                          (True, False, "attention_partial")):
        monkeypatch.setattr(ops, "ATTN_TC", tc)
        mapped = P.with_decode_attention(kernels + kernels, f64)      # twice: each entry once
        assert [e for e in mapped if not is_attention(e)] == [e for e in kernels if not is_attention(e)]
        (entry,) = [e for e in mapped if is_attention(e)]
        assert entry["name"] == want and ops.decode_attention_kernel(f64) is getattr(ops, want)
        assert entry["sig"] == [P.type_to_json(t) for t in catalogue[want]]


def test_kernel_plan_says_what_a_gpu_run_will_do(tiny_model, tmp_path, monkeypatch):
    """probe's "CUDA kernels" line: ahead in workers for a known shape, nothing once the cache
    holds the shape for these sources, at first use with --compile-jobs 1."""
    from ds4py.engine import kernel_plan, kernel_plan_text
    from ds4py.io.spec import open_model
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = open_model(tiny_model)
    try:
        plan = kernel_plan(model, 4)
        assert plan["ahead"] and plan["recorded"] >= 40 and plan["jobs"] == 4 and not plan["cached"]
        assert "compiled ahead in 4 processes" in kernel_plan_text(plan)
        assert not kernel_plan(model, 1)["ahead"]
        P.record(plan["key"], kernels=[])
        plan = kernel_plan(model, 4)
        assert plan["cached"] and not plan["ahead"] and "disk cache" in kernel_plan_text(plan)
        cpu = kernel_plan(model, 4, "cpu")                # the CPU engine's kernels: their own key
        assert cpu["key"] == "cpu;" + plan["key"] and cpu["target"] == "cpu"
        assert cpu["ahead"] and cpu["recorded"] >= 30 and not cpu["cached"]
    finally:
        model.close()


def test_compile_ahead_runs_the_workers_once_per_sources(tiny_model, tmp_path, monkeypatch):
    """engine.compile_ahead with the workers replaced: the shipped kernels of the tiny shape go to
    `jobs` workers with one line said (the decode attention of --attention f32 among them); the
    shape is then marked compiled and the next call starts none; a worker failure is said and
    leaves the shape unmarked (the next run tries again)."""
    from ds4py import engine
    from ds4py.io.spec import open_model
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls, lines = [], []
    result = {"failures": ["failed factory _q8_0_kernel: RuntimeError: boom"]}

    def fake(kernels, jobs, on_done=None):
        calls.append((len(kernels), jobs, {e["name"] for e in kernels}))
        return 2.5, list(result["failures"])

    monkeypatch.setattr(P, "compile_in_workers", fake)
    model = open_model(tiny_model)
    try:
        engine.compile_ahead(model, 3, attention_f64=False, progress=False, log=lines.append)
        assert calls and calls[0][1] == 3 and calls[0][0] >= 40
        assert "attention_partial_f32" in calls[0][2] and "attention_partial_tc" not in calls[0][2]
        assert "in 3 processes" in lines[0] and "1 kernels will compile at first use" in lines[1]
        assert not P.compiled_for_these_sources(engine.kernel_key(model))
        result["failures"] = []
        engine.compile_ahead(model, 3, progress=False, log=lines.append)
        assert len(calls) == 2 and P.compiled_for_these_sources(engine.kernel_key(model))
        engine.compile_ahead(model, 3, progress=False, log=lines.append)
        assert len(calls) == 2                              # cached for these sources: no workers
    finally:
        model.close()


def test_cpu_kernels_compiled_by_workers_are_loaded_by_the_run(tiny_model, tmp_path):
    """The whole CPU path with an empty numba cache: `ds4py run` hands the shipped manifest's CPU
    kernels to 2 worker processes, then its engine loads every one of them (no compile is
    heard); a second run starts no worker. Would fail if a worker's cache key or argument types
    differed from the engine's (the GPU side had such a bug: test_kernel_cache_keys_...)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               DS4PY_COMPILE_JOBS="2")
    cmd = [sys.executable, "-m", "ds4py", "run", "-m", str(tiny_model), "-p", "Ciao, come stai?", "-n", "4",
           "--temp", "0"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "CPU kernels in 2 processes" in first.stderr, first.stderr[-2000:]
    assert "went to compiling kernels" not in first.stderr and "compiling kernels with numba" not in first.stderr, \
        first.stderr[-2000:]
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0 and "processes" not in second.stderr, second.stderr[-2000:]
    assert second.stdout == first.stdout
