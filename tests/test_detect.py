"""The auto-detector as a table of machines, the facts measured on this machine, and `ds4py probe`."""

import json
import os
import subprocess
import sys

import pytest

from ds4py.io import machine
from ds4py.io.detect import (GiB, MiB, Facts, GpuFacts, ModelFacts, Refusal, Request, auto_vram_budget, decide,
                             scratch_bytes)
from ds4py.io.spec import open_model
from ds4py import synth

FLASH = synth.preset_spec("flash")
GB = 10 ** 9

# The q2 model of antirez/ds4 (weight-residency.md): 80.76 GiB of tensors in an 86.7 GB file,
# 43 layers × 256 experts of 6.75 MiB.
Q2 = ModelFacts(file_size=int(86.7 * GB), model_bytes=int(80.76 * GiB), dense_bytes=int(8.2 * GiB),
                expert_bytes=43 * 256 * int(6.75 * MiB), expert_slot_bytes=int(6.75 * MiB), n_layer=43, n_exp=256,
                n_used=6, kv_bytes=FLASH.kv_bytes(32768), scratch_bytes=scratch_bytes(FLASH, n_ctx=32768))


def gpu(total_gb, free_gb=None, name="GPU", index=0):
    total = int(total_gb * GB)
    return GpuFacts(index, name, total, int(free_gb * GB) if free_gb is not None else total - GiB)


def box(ram_gb, gpus=(), avail_gb=None, model=Q2, direct_io=True):
    total = int(ram_gb * GB)
    avail = int(avail_gb * GB) if avail_gb is not None else total - 4 * GiB
    return Facts(total, avail, tuple(gpus), model, direct_io)


# (name, facts, request, regime) — the seed machines first
TABLE = [
    ("96 GB card + 80.76 GiB model -> device", box(128, [gpu(96, name="RTX PRO 6000")]), Request(), "device"),
    ("2 x 16 GB cards + 128 GB RAM -> page cache", box(128, [gpu(16, index=0), gpu(16, index=1)]), Request(),
     "page-cache"),
    ("16 GB card + 64 GB RAM -> streaming", box(64, [gpu(16)]), Request(), "stream"),
    ("no GPU -> cpu", box(128), Request(), "cpu"),
    ("H200 141 GB -> device", box(128, [gpu(150.3, 149)]), Request(), "device"),
    ("96 GB card but --no-model-copy -> page cache", box(128, [gpu(96)]), Request(no_model_copy=True), "page-cache"),
    ("96 GB card, RAM short, --no-model-copy -> stream", box(64, [gpu(96)]), Request(no_model_copy=True), "stream"),
    ("--gpu-vram 0 -> cpu", box(128, [gpu(96)]), Request(gpu_vram=0), "cpu"),
    ("reported VRAM small, --gpu-vram 90G overrides -> device", box(128, [gpu(96, 20)]),
     Request(gpu_vram=90 * GiB), "device"),
    ("RAM reported small, --ram-budget 120G -> page cache", box(128, [gpu(16)], avail_gb=30),
     Request(ram_budget=120 * GiB), "page-cache"),
    ("RAM reported big, --ram-budget 32G -> stream", box(256, [gpu(16)]), Request(ram_budget=32 * GiB), "stream"),
    ("forced stream on the 96 GB card", box(128, [gpu(96)]), Request(weights="stream"), "stream"),
    ("forced page-cache on the 96 GB card", box(128, [gpu(96)]), Request(weights="page-cache"), "page-cache"),
    ("--direct-model -> host-mapped", box(128, [gpu(96)]), Request(direct_model=True), "host-mapped"),
    ("GPU too small even for dense weights -> cpu", box(64, [gpu(8)]), Request(), "cpu"),
    ("forced device beyond VRAM, RAM holds the file -> device that falls back", box(128, [gpu(16)]),
     Request(weights="device"), "device"),
]


@pytest.mark.parametrize("name,facts,request_,regime", TABLE, ids=[t[0] for t in TABLE])
def test_detector_table(name, facts, request_, regime):
    d = decide(facts, request_)
    assert d.regime == regime, d.reasons
    assert d.reasons and all(isinstance(r, str) and r for r in d.reasons)
    assert d.regime not in {a.regime for a in d.alternatives}
    assert {a.regime for a in d.alternatives} | {d.regime} == {"device", "page-cache", "stream", "host-mapped", "cpu"}


def test_device_reason_is_the_inequality_with_numbers():
    d = decide(box(128, [gpu(96)]))
    first = d.reasons[0]
    assert first.startswith("model 80.76 GiB + KV") and "≤ VRAM budget" in first and "max(2 GiB, 5 %)" in first
    assert d.arena_limit is not None and d.arena_limit >= Q2.model_bytes
    assert d.runner_up == "page-cache"
    assert {a.regime: a.flag for a in d.alternatives}["stream"] == "--weights stream"
    assert d.direct_io is False and d.drop_pages is False      # 128 GB RAM keeps the file cached


def test_page_cache_on_two_small_cards_uses_one_and_sizes_the_cache():
    d = decide(box(128, [gpu(16, index=0), gpu(16, index=1)]))
    assert "> VRAM budget" in d.reasons[0] and "≤ RAM" in d.reasons[0]
    assert any("GPU 0 of 2" in r for r in d.reasons)
    vram_left = auto_vram_budget(gpu(16).free) - Q2.dense_bytes - Q2.kv_bytes - Q2.scratch_bytes
    assert d.expert_cache_slots == vram_left // Q2.expert_slot_bytes
    assert d.warnings and "2 × 43 layers × 6 experts = 516" in d.warnings[0]
    assert not d.direct_io and not d.drop_pages
    assert d.runner_up == "stream"


def test_stream_reads_direct_and_drops_unless_told():
    d = decide(box(64, [gpu(16)]))
    assert d.direct_io and d.drop_pages and "O_DIRECT" in d.reasons[-1]
    d = decide(box(64, [gpu(16)]), Request(no_direct_io=True, keep_model_pages=True))
    assert not d.direct_io and not d.drop_pages
    d = decide(box(64, [gpu(16)], direct_io=False))
    assert not d.direct_io and "refuses O_DIRECT" in d.reasons[-1]


def test_device_without_ram_reads_direct_and_drops():
    d = decide(box(64, [gpu(96)]))
    assert d.regime == "device" and d.direct_io and d.drop_pages


def test_forced_regimes_refuse_with_the_shortfall():
    with pytest.raises(Refusal, match=r"page-cache keeps the whole file in RAM .* short by .* --weights stream"):
        decide(box(64, [gpu(16)]), Request(weights="page-cache"))
    with pytest.raises(Refusal, match=r"device needs .* short by .* host-mapped fallback"):
        decide(box(64, [gpu(16)]), Request(weights="device"))
    with pytest.raises(Refusal, match=r"needs a GPU but no NVIDIA GPU was found"):
        decide(box(128), Request(weights="stream"))
    with pytest.raises(Refusal, match=r"stream needs dense .* short by"):
        decide(box(64, [gpu(8)]), Request(weights="stream"))
    with pytest.raises(Refusal, match=r"host-mapped weights page-lock the whole file"):
        decide(box(64, [gpu(16)]), Request(direct_model=True))


def test_gpu_older_than_ampere_runs_on_the_cpu_and_says_why():
    """A Turing or Volta card (no int8 mma.m16n8k32): the CPU engine, with the card's capability
    named; a forced GPU regime refuses with the same reason. Ampere and newer, and cards whose
    capability was not measured, keep the GPU regimes."""
    old = GpuFacts(0, "Tesla T4", 16 * GB, 15 * GB, compute_capability=(7, 5))
    d = decide(box(64, [old]))
    assert d.regime == "cpu" and d.gpu is None
    assert "Tesla T4 is compute capability 7.5" in d.reasons[0] and "8.0 or newer" in d.reasons[0]
    with pytest.raises(Refusal, match=r"stream needs a GPU but Tesla T4 is compute capability 7.5"):
        decide(box(64, [old]), Request(weights="stream"))
    for cc in ((8, 0), (8, 6), (9, 0), None):
        card = GpuFacts(0, "card", 16 * GB, 15 * GB, compute_capability=cc)
        assert decide(box(64, [card])).regime == "stream"


def test_forced_device_over_budget_plans_the_host_mapped_fallback():
    d = decide(box(128, [gpu(150, 149)]), Request(weights="device", gpu_vram=10 * GiB))
    assert d.regime == "device" and d.forced and d.arena_limit < Q2.model_bytes
    assert "fall back to host-mapped" in d.warnings[0]


def test_expert_cache_requests():
    facts = box(64, [gpu(24)])
    assert decide(facts, Request(expert_cache_slots=100)).expert_cache_slots == 100
    d = decide(facts, Request(expert_cache_bytes=GiB))
    assert d.regime == "stream" and d.expert_cache_slots == GiB // Q2.expert_slot_bytes
    with pytest.raises(Refusal, match="needs .* of VRAM but only"):
        decide(facts, Request(expert_cache_slots=100_000))     # auto, but the asked-for size cannot fit
    with pytest.raises(Refusal, match="at least 6 slots"):
        decide(facts, Request(expert_cache_slots=3))
    # auto never asks for more slots than the model has experts
    big = decide(box(128, [gpu(150, 149)]), Request(weights="stream"))
    assert big.expert_cache_slots == 43 * 256 and not big.warnings


def test_budget_margin_is_ds4s():
    assert auto_vram_budget(100 * GiB) == 95 * GiB            # 5 % > 2 GiB
    assert auto_vram_budget(16 * GiB) == 14 * GiB             # 2 GiB floor
    assert auto_vram_budget(GiB) == 0


def test_kv_and_scratch_grow_with_context():
    assert FLASH.kv_bytes(65536) > FLASH.kv_bytes(32768) > FLASH.kv_bytes(4096)
    assert 0.3 * GiB < FLASH.kv_bytes(32768) < 0.6 * GiB
    assert scratch_bytes(FLASH, n_ctx=256) < scratch_bytes(FLASH, n_ctx=32768)


# ---- measured facts on this machine -----------------------------------------------------------------

def test_measured_facts_for_the_tiny_model(tiny_model):
    m = open_model(tiny_model)
    try:
        report = machine.measure(m)
        assert report.ram.total > 0 and 0 < report.ram.available <= report.ram.total
        mp = report.model
        assert mp.file_size == os.path.getsize(tiny_model)
        assert 0 <= mp.cached_bytes <= mp.file_size
        assert mp.dense_bytes + mp.expert_bytes == mp.distinct_bytes
        assert sum(mp.bytes_by_role.values()) == sum(t.nbytes for t in m.file.tensors.values())
        facts = report.facts(m, 4096)
        assert facts.model.kv_bytes == m.spec.kv_bytes(4096)
        d = decide(facts)
        assert d.regime in ("cpu", "device")
        json.dumps(report.as_dict())
    finally:
        m.close()


# ---- ds4py probe --------------------------------------------------------------------------------------

def _cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DS4_", "DS4PY_"))}
    e.update(env or {})
    e["COLUMNS"] = "160"
    return subprocess.run([sys.executable, "-m", "ds4py.cli", *args], capture_output=True, text=True, env=e,
                          timeout=300)


def test_probe_prints_facts_options_and_decision(tiny_model):
    r = _cli("probe", "-m", str(tiny_model), "--ctx", "4k", env={"DS4_CUDA_NO_DIRECT_IO": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in ("RAM", "page cache", "O_DIRECT", "bytes by role", "routed experts", "KV", "--ctx", "4096",
                   "DS4_CUDA_NO_DIRECT_IO", "decision:", "other regimes"):
        assert needle in out, needle
    row = next(line for line in out.splitlines() if "--no-direct-io" in line)
    assert "on" in row and "env" in row
    row = next(line for line in out.splitlines() if "--ctx" in line and "DS4PY_CTX" in line)
    assert "flag" in row


def test_probe_json_is_documented_shape(tiny_model, tmp_path):
    # no user manifest: the shipped one's CPU kernels of the tiny shape
    r = _cli("probe", "-m", str(tiny_model), "--json", "--gpu-vram", "0", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == {"machine", "model", "options", "notes", "decision", "refusal", "kernels", "attention"}
    assert report["kernels"]["target"] == "cpu"        # the CPU engine's kernels
    assert report["attention"] is None                 # no GPU attention on the CPU
    assert report["kernels"]["key"].startswith("cpu;") and report["kernels"]["recorded"] >= 30
    assert report["decision"]["regime"] == "cpu" and report["refusal"] is None
    assert report["model"]["kv_bytes"] > 0 and report["model"]["n_ctx"] == 32768
    opts = {o["option"]: o for o in report["options"]}
    assert opts["--gpu-vram"]["source"] == "flag" and opts["--gpu-vram"]["value"] == "0 B"
    assert {"regime", "forced", "reasons", "warnings", "runner_up", "alternatives"} <= set(report["decision"])


def test_probe_forced_regime_that_cannot_run_is_one_error_line(tiny_model):
    r = _cli("probe", "-m", str(tiny_model), "--weights", "stream", "--gpu-vram", "1G", "--ram-budget", "1G")
    if r.returncode == 0:
        pytest.skip("this machine has a GPU big enough: nothing to refuse")
    assert r.returncode == 3
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:")


@pytest.mark.parametrize("args,env,needle", [
    (["--gpu-vram", "lots"], {}, "--gpu-vram"),
    (["--ctx", "0"], {}, "--ctx"),
    (["--weights", "vramm"], {}, "--weights"),
    (["--attention", "f16"], {}, "--attention"),
    ([], {"DS4_CUDA_KEEP_MODEL_PAGES": "maybe"}, "DS4_CUDA_KEEP_MODEL_PAGES"),
    ([], {"DS4PY_RAM_BUDGET": "-3G"}, "DS4PY_RAM_BUDGET"),
    ([], {"DS4_CUDA_MODEL_COPY_CHUNK_MB": "big"}, "DS4_CUDA_MODEL_COPY_CHUNK_MB"),
    (["--weights", "device"], {"DS4_CUDA_NO_MODEL_COPY": "1"}, "DS4_CUDA_NO_MODEL_COPY=1"),
    (["-m", "/nonexistent/model.gguf"], {}, "/nonexistent/model.gguf"),
])
def test_probe_bad_input_is_one_clean_line(tiny_model, args, env, needle):
    if "-m" not in args:
        args = ["-m", str(tiny_model), *args]
    r = _cli("probe", *args, env=env)
    assert r.returncode in (2, 3), r.stdout
    assert r.stderr.startswith("error:") and r.stderr.strip().count("\n") == 0, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and "Usage" not in r.stderr


@pytest.mark.parametrize("cc,f64", [((9, 0), True), ((8, 0), True), ((10, 0), True), ((8, 6), False),
                                    ((8, 9), False), ((12, 0), False), ((10, 3), False), ((13, 0), False)])
def test_decode_attention_is_f64_only_where_f64_runs_at_full_rate(cc, f64):
    """--attention auto: f64 (the CPU engine's numerics) on A100 / H100 / H200 / B200, f32 on the
    GeForce and workstation parts (RTX 50 is 12.0) and on anything not listed, whose f64 runs at
    1/32-1/64 of f32; a forced choice wins; an unknown capability keeps f64."""
    from ds4py.io import detect
    chosen, why = detect.decode_attention("auto", cc)
    assert chosen is f64 and f"compute capability {cc[0]}.{cc[1]}" in why
    assert detect.decode_attention("f32", (9, 0))[0] is False
    assert detect.decode_attention("f64", (8, 9))[0] is True
    assert detect.decode_attention("auto", None)[0] is True
