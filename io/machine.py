"""Measure the facts the detector decides from: RAM, GPUs, the page cache, the model's bytes.

Every probe degrades to "unknown" rather than failing: no NVML library, no driver, no GPU, a
filesystem without O_DIRECT. VRAM comes from NVML (`pynvml`, package nvidia-ml-py), which creates
no CUDA context; without it, from numba.cuda (which does create one, ~0.5 GiB); else "no GPU".
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, field

from ds4py.io import diskio, layout
from ds4py.io.detect import Facts, GpuFacts, ModelFacts, scratch_bytes
from ds4py.io.spec import Model, ROLE_ORDER, alias_summary, bytes_by, tensor_role


@dataclass
class GpuProbe:
    gpus: list[GpuFacts] = field(default_factory=list)
    via: str = "none"              # nvml | numba | none
    driver: str | None = None
    note: str = ""                 # why no GPU, or which devices are hidden


def visible_device_filter() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries (None when unset: all devices visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def probe_gpus() -> GpuProbe:
    probe = _probe_nvml()
    if probe is None:
        probe = _probe_numba()
    return probe


def _probe_nvml() -> GpuProbe | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:          # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        return GpuProbe(via="nvml", note=f"NVML could not start ({type(e).__name__})")
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        wanted = visible_device_filter()
        order = list(range(count))
        if wanted is not None:
            order = []
            for entry in wanted:
                if entry.isdigit() and int(entry) < count:
                    order.append(int(entry))
                else:
                    for i, h in enumerate(handles):
                        if _text(pynvml.nvmlDeviceGetUUID(h)).startswith(entry):
                            order.append(i)
                            break
                    else:
                        break       # CUDA stops at the first invalid entry
        gpus = []
        for cuda_index, i in enumerate(order):
            h = handles[i]
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            cc = _maybe(pynvml.nvmlDeviceGetCudaComputeCapability, h)
            gpus.append(GpuFacts(cuda_index, _text(pynvml.nvmlDeviceGetName(h)), int(mem.total), int(mem.free),
                                 _maybe(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                                 _maybe(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                                 tuple(int(v) for v in cc) if cc else None))
        driver = _maybe(pynvml.nvmlSystemGetDriverVersion)
        note = "" if wanted is None else f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
        if not gpus and count:
            note = f"{count} GPU(s) present but hidden by CUDA_VISIBLE_DEVICES"
        return GpuProbe(gpus, "nvml", _text(driver) if driver else None, note)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _probe_numba() -> GpuProbe:
    try:
        from ds4py.io.gpu import cuda_module
        cuda = cuda_module()
        if not cuda.is_available():
            return GpuProbe(note="no CUDA driver or GPU (numba.cuda.is_available() is False)")
        dev = cuda.get_current_device()
        free, total = cuda.current_context().get_memory_info()
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        cc = tuple(int(v) for v in dev.compute_capability)
        return GpuProbe([GpuFacts(0, name, int(total), int(free), compute_capability=cc)], "numba",
                        note="VRAM read through a CUDA context (install nvidia-ml-py for a context-free probe)")
    except Exception as e:
        return GpuProbe(note=f"no GPU probe available ({type(e).__name__}: nvidia-ml-py and numba-cuda missing or failing)")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(fn, *args):
    try:
        return fn(*args)
    except Exception:
        return None


# ---- RAM and limits -----------------------------------------------------------------------------

@dataclass
class RamProbe:
    total: int
    available: int
    memlock_limit: int | None      # RLIMIT_MEMLOCK soft limit in bytes (None: unlimited)


def probe_ram() -> RamProbe:
    import psutil
    vm = psutil.virtual_memory()
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return RamProbe(int(vm.total), int(vm.available), None if soft == resource.RLIM_INFINITY else int(soft))


# ---- the model ------------------------------------------------------------------------------------

@dataclass
class ModelProbe:
    path: str
    file_size: int
    filesystem: str
    direct_io: bool
    direct_io_note: str
    cached_bytes: int
    bytes_by_role: dict[str, int]        # described (aliases counted every time)
    distinct_bytes: int
    dense_bytes: int
    expert_bytes: int
    expert_slot_bytes: int


def probe_model(model: Model) -> ModelProbe:
    g = model.file
    by_role = bytes_by(g, lambda t: tensor_role(t.name))
    dense = sum(iv.nbytes for iv in layout.plan_arena(layout.spans_of(model, layout.dense_names(model)), 0).intervals)
    experts = sum(iv.nbytes for iv in layout.plan_arena(layout.spans_of(model, layout.expert_names(model)), 0).intervals)
    _aliased, distinct = alias_summary(g)
    ok, note = diskio.direct_io_support(model.path)
    return ModelProbe(model.path, g.file_size, diskio.filesystem_of(model.path), ok, note,
                      diskio.resident_bytes(g.mm), {r: by_role[r] for r in ROLE_ORDER if r in by_role},
                      distinct, dense, experts, layout.expert_slot_bytes(model))


def model_facts(model: Model, probe: ModelProbe, n_ctx: int) -> ModelFacts:
    s = model.spec
    return ModelFacts(file_size=probe.file_size, model_bytes=probe.distinct_bytes, dense_bytes=probe.dense_bytes,
                      expert_bytes=probe.expert_bytes, expert_slot_bytes=probe.expert_slot_bytes,
                      n_layer=s.n_layer, n_exp=s.n_exp, n_used=s.n_used, kv_bytes=s.kv_bytes(n_ctx),
                      scratch_bytes=scratch_bytes(s, n_ctx=n_ctx), cached_bytes=probe.cached_bytes)


@dataclass
class MachineReport:
    """Everything measured, kept together so `probe` can print and `decide` can use it."""

    ram: RamProbe
    gpu: GpuProbe
    model: ModelProbe | None = None

    def facts(self, model: Model, n_ctx: int) -> Facts:
        return Facts(ram_total=self.ram.total, ram_available=self.ram.available, gpus=tuple(self.gpu.gpus),
                     model=model_facts(model, self.model, n_ctx), direct_io=self.model.direct_io)

    def as_dict(self) -> dict:
        return {"ram": asdict(self.ram), "gpu": {"via": self.gpu.via, "driver": self.gpu.driver, "note": self.gpu.note,
                                                 "devices": [asdict(g) for g in self.gpu.gpus]},
                "model": asdict(self.model) if self.model else None}


def measure(model: Model | None = None) -> MachineReport:
    return MachineReport(probe_ram(), probe_gpus(), probe_model(model) if model is not None else None)
