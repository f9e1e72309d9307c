"""Weight sources: where the engine's weight bytes come from, with counters.

The engine asks a source for tensors by name and never learns where the bytes live. Every source
counts what it moves, so `--stats` and the tests can prove e.g. that a device-resident first request
uploads 0 bytes.

Sources and regimes (io/detect.py decides which; `open_source` builds it):

    HostSource       cpu          tensors are zero-copy views of the file mapping (CPU engine)
    DeviceSource     device       every tensor copied at load into ONE VRAM arena
                     host-mapped  the file mapping registered read-only with the driver; kernels
                                  read it in place (--direct-model, or the device fallback when the
                                  arena cannot be allocated)
    PageCacheSource  page-cache   dense tensors in a VRAM arena; routed experts copied on demand
                                  from the page-locked page cache into a VRAM expert cache
    StreamSource     stream       dense tensors in a VRAM arena; routed experts read on demand with
                                  O_DIRECT into pinned buffers, uploaded into the VRAM expert
                                  cache, file pages dropped after use

The GPU-facing interface (all three GPU sources):

    source.regime                       "device" | "host-mapped" | "page-cache" | "stream"
    source.counters                     Counters (bytes read, uploaded at load / per request, cache)
    source.arena                        the ONE 1-D uint8 device array (length a multiple of 256) that
                                        holds every dense tensor, and the expert slots or experts
    source.dense(name) -> (arena, byte_offset)          any non-routed tensor; never uploads
    source.dense_view(name) -> device uint8 view of that tensor's bytes
    source.scales_last                  the dense tensors whose rows the source rewrote in VRAM in
                                        the scales-last layout (kernels/formats.py; Q8_0 only): pass
                                        `scales_last=name in source.scales_last` to the kernels
    source.expert_arena                 the array expert offsets point into (is source.arena)
    source.fetch_experts(layer, expert_ids, stream=None) -> np.int64[n, 3]
        byte offsets in the arena of the gate, up and down matrices of each requested expert
        (row i for expert_ids[i]). Misses are copied on `stream`: pass the stream the kernels run
        on, so the copies are ordered after the kernels that read the evicted slots and before
        those that read the new ones (default: the legacy default stream 0, which orders against
        numba's default launches and every blocking stream). The host array is ready on return.
    source.expert_base(layer) -> ExpertBase | None
        device and host-mapped only: (gate_off, up_off, down_off, gate_stride, up_stride,
        down_stride), so a kernel computes expert e's matrix k at off_k + e * stride_k from device
        expert ids with no host sync (`expert_base_table()` gives all layers as np.int64[n_layer, 6]).
    source.host(name) -> numpy view of the tensor in the file mapping (as HostSource.host)
    source.stream                       the source's own gpu.Stream (`.numba` for launches)
    source.mark() -> Counters; source.rewind(mark)
        a throwaway run (the engine's warm-up) leaves no trace: the counters go back to the mark
        and an expert cache forgets every entry (the run overwrote its slots)
    source.synchronize(), source.close()

`fetch_experts` semantics: an expert of the current selection is never evicted, so all n rows are
valid together; the slots stay valid until the next fetch_experts call (of any layer).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np

from ds4py.errors import ResourceError
from ds4py.io import diskio, layout
from ds4py.io.expert_cache import ExpertCachePolicy
from ds4py.io.spec import Model, is_routed_expert

MiB = 1 << 20
GiB = 1 << 30
REGISTER_WINDOW = 1 << 30        # page-lock the page cache this much at a time for a warm device load
LOAD_PATHS = ("auto", "staged", "registered")
# After the upload, rewrite the dense Q8_0 matrices in VRAM scales-last (kernels/formats.py): the
# same bytes, which the GPU kernels read with wider loads. False keeps the file's layout (for A/B).
SCALES_LAST = True


@dataclass
class Counters:
    disk_read_bytes: int = 0          # bytes read from the file by us (pread / O_DIRECT)
    h2d_load_bytes: int = 0           # host->device bytes uploaded while loading
    h2d_request_bytes: int = 0        # host->device bytes uploaded while serving requests
    expert_hits: int = 0
    expert_misses: int = 0
    expert_evictions: int = 0
    dropped_bytes: int = 0            # file bytes handed back to the kernel (DONTNEED)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def set_to(self, other: "Counters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))


class HostSource:
    """The CPU path: tensors are zero-copy views of the file mapping, read in place."""

    regime = "cpu"

    def __init__(self, model: Model):
        self.model = model
        self.counters = Counters()

    def host(self, name: str) -> np.ndarray:
        """The tensor as GGUFFile.rows() lays it out (typed for F32/F16/I32, uint8 rows otherwise)."""
        return self.model.file.rows(name)

    def has(self, name: str) -> bool:
        return name in self.model.file.tensors

    def close(self) -> None:
        pass


class ExpertBase(NamedTuple):
    gate_off: int
    up_off: int
    down_off: int
    gate_stride: int
    up_stride: int
    down_stride: int


@dataclass
class LoadStats:
    nbytes: int = 0
    seconds: float = 0.0
    how: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _arena_size(nbytes: int) -> int:
    """Allocation size: rounded to 256 so the engine can view the arena as f16/f32/i32/i64."""
    return diskio.align_up(max(nbytes, 1), 256)


def _default_threads(io_threads: int) -> int:
    return io_threads if io_threads > 0 else max(2, min(16, os.cpu_count() or 4))


@contextmanager
def _progress_bar(enabled, description: str, total: int):
    """Yield advance(n). enabled: True (rich bar on stderr), False, or a callable(description, total)
    returning an advance function (tests, other front ends)."""
    if callable(enabled):
        yield enabled(description, total)
        return
    if not enabled or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.update(task, advance=n)


def warm_page_cache(model: Model, progress=True) -> int:
    """--warm-weights: fault the whole file into the page cache now. Returns bytes warmed."""
    mm = model.file.mm
    with _progress_bar(progress, "warming page cache", len(mm)) as advance:
        diskio.populate(mm, progress=advance)
    return len(mm)


# ---- the GPU sources -------------------------------------------------------------------------------

class GpuSource:
    """What the three GPU sources share: the dense arena, the staging ring, the counters."""

    regime = "gpu"

    def __init__(self, model: Model, *, chunk_mb: int = 64, n_slots: int = 4, io_threads: int = 0,
                 direct_io: bool = False, drop_pages: bool = False, progress=True, log=None,
                 load_path: str = "auto", gpu=None):
        if gpu is None:                          # tests pass a numpy stand-in with the same functions
            from ds4py.io import gpu
        if load_path not in LOAD_PATHS:
            raise ValueError(f"load_path must be one of {LOAD_PATHS}")
        self.load_path = load_path
        self.gpu = gpu
        self.model = model
        self.counters = Counters()
        self.log = log or _stderr_line
        self.progress = progress
        self.chunk_bytes = chunk_mb * MiB
        self.n_slots = n_slots
        self.threads = _default_threads(io_threads)
        self.drop_pages = drop_pages
        self.load_stats = LoadStats()
        self._loading = True
        self._closed = False
        self._registered: list[int] = []         # host addresses registered with the driver
        self._staging: list[np.ndarray] = []
        self.arena = None
        self.expert_arena = None
        self.scales_last: frozenset[str] = frozenset()   # dense tensors whose rows are scales-last
        self._rewrites: list[layout.Rewrite] = []        # the ranges that may be (_rewrite_scales_last)
        self._geometry = layout.expert_geometry(model)
        gpu.ensure_context()
        self.stream = gpu.Stream()
        self.reader = diskio.FileReader(model.path, direct=direct_io, log=self.log)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ds4py-read")

    # ---- the engine's interface ---------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.model.file.tensors

    def host(self, name: str) -> np.ndarray:
        return self.model.file.rows(name)

    def dense(self, name: str):
        info = self.model.file.tensors[name]
        if is_routed_expert(name) and self.regime not in ("device", "host-mapped"):
            raise KeyError(f"{name} is a routed-expert tensor: ask fetch_experts() for its experts")
        return self.arena, self.plan.offset_of(info.offset, info.nbytes)

    def dense_view(self, name: str):
        arena, off = self.dense(name)
        return arena[off:off + self.model.file.tensors[name].nbytes]

    def expert_base(self, layer: int) -> ExpertBase | None:
        return None

    def expert_base_table(self) -> np.ndarray | None:
        rows = [self.expert_base(il) for il in range(self.model.spec.n_layer)]
        return None if rows[0] is None else np.array(rows, dtype=np.int64)

    def fetch_experts(self, layer: int, expert_ids, stream=None) -> np.ndarray:
        raise NotImplementedError

    def mark(self) -> Counters:
        return replace(self.counters)

    def rewind(self, mark: Counters) -> None:
        self.counters.set_to(mark)          # in place: callers may hold source.counters

    def experts_at_once(self) -> int | None:
        """How many distinct experts of one layer fetch_experts can hold resident at once (None:
        all of them, the experts live in the arena)."""
        return None

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ---- loading helpers ------------------------------------------------------------------------

    def _staging_ring(self) -> list[np.ndarray]:
        if not self._staging:
            from ds4py.io.staging import slot_bytes_for
            self._staging = [self.gpu.pinned_bytes(slot_bytes_for(self.chunk_bytes)) for _ in range(self.n_slots)]
        return self._staging

    def _upload_plan(self, plan: layout.ArenaPlan, arena, what: str) -> None:
        """Copy every interval of `plan` from the file into `arena` through the pinned ring."""
        before = self.reader.stats.direct_bytes + self.reader.stats.buffered_bytes
        mm = self.model.file.mm

        def after_chunk(c):
            if self.drop_pages:
                self.reader.drop(c.file_offset, c.nbytes, mm)
                self.counters.dropped_bytes += c.nbytes

        with _progress_bar(self.progress, what, plan.copy_bytes) as advance:
            self.load_stats = upload_staged(self.gpu, self.reader, plan, self.gpu.device_ptr(arena), self.stream,
                                            self._staging_ring(), self.pool, self.threads, self.chunk_bytes,
                                            progress=advance, after_chunk=after_chunk)
        self.counters.disk_read_bytes += self.reader.stats.direct_bytes + self.reader.stats.buffered_bytes - before
        self.counters.h2d_load_bytes += self.load_stats.nbytes
        if self.drop_pages:      # stragglers: folios that straddled a chunk edge
            self.reader.drop(0, self.reader.size, mm)

    def _load_plan(self, plan: layout.ArenaPlan, arena, what: str) -> None:
        """Fill `arena` from the file: load_path "staged" (and "auto") runs the reader threads into
        the pinned ring; "registered" page-locks the page cache 1 GiB at a time and DMAs from it.

        Measured on the H200 machine (PCIe Gen5, 16 cores, pinned H2D 55.4 GB/s), warm file:
        staged 36.1 GB/s (3.4 GiB) and 44.9 GB/s (20 GB), registered 23.5 and 21.1 GB/s (the
        registration itself, ~25 ms/GiB, does not overlap well enough); cold, O_DIRECT staged
        reads run at 93-108 % of the disk's O_DIRECT rate. So auto = staged."""
        path = "staged" if self.load_path == "auto" else self.load_path
        if path == "registered":
            try:
                with _progress_bar(self.progress, what, plan.copy_bytes) as advance:
                    self.load_stats = upload_windows(self.gpu, self.model.file.mm, plan, self.gpu.device_ptr(arena),
                                                     self.stream, self.chunk_bytes, progress=advance)
                self.counters.h2d_load_bytes += self.load_stats.nbytes
                return
            except self.gpu.CudaCallError as e:
                self.log(f"ds4py: page-locking the page cache failed ({e}); reading through pinned staging instead")
        self._upload_plan(plan, arena, what)

    def _upload_registered(self, plan: layout.ArenaPlan, arena, base_addr: int, what: str) -> None:
        """Copy every interval of `plan` straight from the registered mapping (no staging, no reads)."""
        from ds4py.io.staging import plan_chunks
        dst = self.gpu.device_ptr(arena)
        t0 = time.perf_counter()
        moved = 0
        with _progress_bar(self.progress, what, plan.copy_bytes) as advance:
            for c in plan_chunks(plan, self.chunk_bytes):
                self.gpu.copy_htod_async(dst + c.dest, base_addr + c.file_offset, c.nbytes, self.stream)
                moved += c.nbytes
                advance(c.nbytes)
            self.stream.synchronize()
        self.counters.h2d_load_bytes += moved
        self.load_stats = LoadStats(moved, time.perf_counter() - t0, "DMA from the page-locked page cache")

    def _register_mapping(self) -> int:
        """Register the whole file mapping read-only (page-locking it); returns its host address."""
        mm = self.model.file.mm
        addr = diskio.buffer_address(mm)
        self.gpu.register_host(addr, diskio.align_up(len(mm), diskio.PAGE))   # the mapping covers whole pages
        self._registered.append(addr)
        return addr

    def _rewrite_scales_last(self) -> None:
        """After the upload: the eligible dense Q8_0 matrices of the arena scales-last (each range
        once: aliased tensors share one), unless SCALES_LAST is off."""
        self._rewrites = layout.scales_last_rewrites(self.model, self.plan, layout.dense_names(self.model))
        self.keep_scales_last(SCALES_LAST)

    def keep_scales_last(self, on: bool) -> None:
        """Put the rewritable matrices scales-last (on) or back in the file's layout, and name them
        in `scales_last` accordingly (scripts/decode_ab.py A/Bs the two in one process; an engine
        captures its graphs again after a change)."""
        if bool(on) == bool(self.scales_last):
            return
        for r in self._rewrites:
            self.gpu.rewrite_scales_last(self.arena, r.arena_offset, r.n_rows, r.K, self.stream, back=not on)
        self.stream.synchronize()
        self.scales_last = frozenset(n for r in self._rewrites for n in r.names) if on else frozenset()

    def _report_load(self, what: str) -> None:
        s = self.load_stats
        self.log(f"ds4py: {what}: {s.nbytes / GiB:.2f} GiB in {s.seconds:.2f} s ({s.gbps:.1f} GB/s; {s.how})")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.stream.synchronize()
        except Exception:
            pass
        self.pool.shutdown(wait=True)
        self.reader.close()
        self.arena = self.expert_arena = None
        self._staging = []
        for addr in self._registered:
            try:
                self.gpu.unregister_host(addr)
            except Exception:
                pass
        self._registered = []
        self.stream.close()
        try:
            self.gpu.release_deferred()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def upload_staged(gpu, reader: diskio.FileReader, plan: layout.ArenaPlan, arena_ptr: int, stream, ring, pool,
                  threads: int, chunk_bytes: int, progress=None, after_chunk=None) -> LoadStats:
    """File -> pinned ring (reader threads, O_DIRECT or buffered as `reader` does) -> arena."""
    from ds4py.io.staging import plan_chunks, pump
    uploader = DeviceUploader(gpu, arena_ptr, stream, len(ring))
    t0 = time.perf_counter()
    try:
        moved = pump(reader, plan_chunks(plan, chunk_bytes), ring, uploader, pool, threads,
                     progress=progress, after_chunk=after_chunk)
        stream.synchronize()
    finally:
        uploader.close()
    mode = "O_DIRECT" if reader.direct else "buffered"
    return LoadStats(moved, time.perf_counter() - t0,
                     f"{mode} reads, {threads} threads, {len(ring)} × {chunk_bytes // MiB} MiB pinned staging")


def upload_windows(gpu, mm, plan: layout.ArenaPlan, arena_ptr: int, stream, chunk_bytes: int,
                   progress=None, window: int = 0) -> LoadStats:
    """Page cache -> arena by DMA: page-lock the mapping one window at a time (at most two at once),
    copy that window's part of the plan from it, unlock it when its copies are done."""
    from collections import deque

    from ds4py.io.staging import plan_chunks
    window = window or REGISTER_WINDOW
    base = diskio.buffer_address(mm)
    map_size = diskio.align_up(len(mm), diskio.PAGE)
    by_window: dict[int, list[tuple[int, int, int]]] = {}
    for c in plan_chunks(plan, chunk_bytes):
        pos, end = c.file_offset, c.file_offset + c.nbytes
        while pos < end:                       # a copy must not straddle two registrations
            w = pos // window
            stop = min(end, (w + 1) * window)
            by_window.setdefault(w, []).append((pos, stop - pos, c.dest + pos - c.file_offset))
            pos = stop
    pinned: deque = deque()                    # (host address, event after its copies)

    def release_oldest():
        addr, ev = pinned.popleft()
        ev.synchronize()
        ev.close()
        gpu.unregister_host(addr)

    t0, moved = time.perf_counter(), 0
    try:
        for w in sorted(by_window):
            start, stop = w * window, min((w + 1) * window, map_size)
            gpu.pin_host(base + start, stop - start)
            ev = gpu.Event()
            pinned.append((base + start, ev))
            n_window = 0
            for off, n, dest in by_window[w]:
                gpu.copy_htod_async(arena_ptr + dest, base + off, n, stream)
                n_window += n
            ev.record(stream)
            moved += n_window
            if progress:
                progress(n_window)
            while len(pinned) > 2:
                release_oldest()
        stream.synchronize()
    finally:
        while pinned:
            try:
                release_oldest()
            except Exception:
                pass
    return LoadStats(moved, time.perf_counter() - t0,
                     f"DMA from the page cache, page-locked {window // MiB} MiB at a time")


class DeviceUploader:
    """staging.pump's uploader: async copies on one stream, one event per ring slot."""

    def __init__(self, gpu, arena_ptr: int, stream, n_slots: int):
        self.gpu, self.arena_ptr, self.stream = gpu, arena_ptr, stream
        self.events = [gpu.Event() for _ in range(n_slots)]

    def upload(self, slot: int, data: np.ndarray, dest: int) -> None:
        self.gpu.copy_htod_async(self.arena_ptr + dest, self.gpu.host_addr(data), data.nbytes, self.stream)
        self.events[slot].record(self.stream)

    def wait(self, slot: int) -> None:
        self.events[slot].synchronize()

    def close(self) -> None:
        for e in self.events:
            e.close()


class DeviceSource(GpuSource):
    """device: the whole model in one VRAM arena; falls back to host-mapped if VRAM says no.

    arena_limit: most bytes the arena may take (the detector's VRAM budget minus KV and scratch);
    an arena larger than that is treated exactly like a failed allocation. host_mapped=True skips
    the copy altogether (--direct-model)."""

    regime = "device"

    def __init__(self, model: Model, *, arena_limit: int | None = None, host_mapped: bool = False, **kw):
        super().__init__(model, **kw)
        try:
            all_spans = layout.spans_of(model, model.file.tensors)
            self.plan = layout.plan_arena(all_spans)
            if host_mapped:
                self.log("ds4py: host-mapped weights (--direct-model): the file mapping is page-locked and "
                         "kernels read it in place across PCIe")
                self._map_host(None)
                return
            self.regime = "device"
            why = None
            try:
                if arena_limit is not None and self.plan.nbytes > arena_limit:
                    raise self.gpu.CudaCallError(
                        "the VRAM budget", f"arena of {self.plan.nbytes / GiB:.2f} GiB > limit {arena_limit / GiB:.2f} GiB")
                self.arena = self.gpu.device_bytes(_arena_size(self.plan.nbytes))
            except self.gpu.CudaCallError as e:
                why = str(e)
            if why is not None:
                self.arena = None
                self.gpu.release_deferred()
                self.log(f"ds4py: VRAM arena for the model ({self.plan.nbytes / GiB:.2f} GiB) not available ({why}); "
                         f"falling back to host-mapped weights: kernels read them across PCIe every token (slow)")
                self._map_host(why)
                return
            self._load_plan(self.plan, self.arena, "copying weights to VRAM")
            self._rewrite_scales_last()
            self._report_load("device-resident")
        except BaseException:
            self.close()
            raise
        finally:
            self._loading = False
        self.expert_arena = self.arena

    def _map_host(self, vram_failure: str | None) -> None:
        self.regime = "host-mapped"
        try:
            addr = self._register_mapping()
        except Exception as e:
            before = f"the VRAM arena failed ({vram_failure}) and " if vram_failure else ""
            raise ResourceError(f"{self.model.path}: {before}registering the file mapping with the driver failed "
                                f"({e}); use --weights stream") from None
        size = len(self.model.file.mm)
        dptr = int(self.gpu.call("cuMemHostGetDevicePointer", addr, 0))
        # the whole last page is mapped, so the view may end there (typed views need even sizes)
        self.arena = self.gpu.wrap_device(dptr, diskio.align_up(size, diskio.PAGE), owner=self.model.file.mm)
        self.plan = layout.ArenaPlan([layout.Interval(0, size, 0)], size)   # arena offset = file offset
        self.expert_arena = self.arena
        self._loading = False

    def expert_base(self, layer: int) -> ExpertBase:
        g = self._geometry[layer]
        offs = [self.plan.offset_of(o, s * self.model.spec.n_exp) for o, s in zip(g.offset, g.stride)]
        return ExpertBase(*offs, *g.stride)

    def fetch_experts(self, layer: int, expert_ids, stream=None) -> np.ndarray:
        """Every expert is resident: offsets only, nothing uploaded."""
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        b = self.expert_base(layer)
        out = np.empty((ids.size, 3), dtype=np.int64)
        out[:, 0] = b.gate_off + ids * b.gate_stride
        out[:, 1] = b.up_off + ids * b.up_stride
        out[:, 2] = b.down_off + ids * b.down_stride
        self.counters.expert_hits += ids.size
        return out


class _ExpertCachingSource(GpuSource):
    """page-cache and stream: dense arena at load, routed experts through a VRAM LRU cache."""

    def __init__(self, model: Model, *, expert_slots: int, **kw):
        super().__init__(model, **kw)
        n_used = model.spec.n_used
        if expert_slots < n_used:
            self.close()
            raise ResourceError(f"an expert cache of {expert_slots} slots cannot hold one selection of {n_used} experts")
        self.slots = layout.slot_layout(self._geometry)
        self.policy = ExpertCachePolicy(expert_slots)
        self.plan = layout.plan_arena(layout.spans_of(model, layout.dense_names(model)))
        # one arena: dense tensors first, then the expert slots (kernels take one arena + offsets)
        self.slot_base = diskio.align_up(self.plan.nbytes, layout.ARENA_ALIGN)
        cache_bytes = expert_slots * self.slots.slot_bytes
        try:
            self.arena = self.gpu.device_bytes(_arena_size(self.slot_base + cache_bytes))
        except self.gpu.CudaCallError as e:
            self.close()
            raise ResourceError(f"{self.regime}: VRAM for dense weights ({self.plan.nbytes / GiB:.2f} GiB) + "
                                f"{expert_slots} expert slots ({cache_bytes / GiB:.2f} GiB) is not available ({e}); "
                                f"lower --ssd-streaming-cache-experts or --ctx") from None
        self.expert_arena = self.arena
        self._expert_ptr = self.gpu.device_ptr(self.arena) + self.slot_base

    def experts_at_once(self) -> int:
        return self.policy.n_slots

    def rewind(self, mark: Counters) -> None:
        super().rewind(mark)
        self.policy.clear()

    def expert_slot_offsets(self, slots) -> np.ndarray:
        """Arena byte offsets (gate, up, down) of the given slots."""
        sub = np.asarray(self.slots.sub_offset, dtype=np.int64)
        return self.slot_base + np.asarray(slots, dtype=np.int64)[:, None] * self.slots.slot_bytes + sub[None, :]

    def fetch_experts(self, layer: int, expert_ids, stream=None) -> np.ndarray:
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        before = (self.policy.hits, self.policy.misses, self.policy.evictions)
        assignment = self.policy.assign(layer, ids.tolist())
        self.counters.expert_hits += self.policy.hits - before[0]
        self.counters.expert_misses += self.policy.misses - before[1]
        self.counters.expert_evictions += self.policy.evictions - before[2]
        if assignment.fills:
            try:
                # default: the legacy default stream, which orders against numba's default launches
                # and every blocking stream, so a refilled slot is never overwritten under a kernel
                self._fill(layer, assignment.fills, stream if stream is not None else 0)
            except BaseException:
                for expert, _slot in assignment.fills:
                    self.policy.forget(layer, expert)
                raise
        return self.expert_slot_offsets(assignment.slots)

    def _fill(self, layer: int, fills: list[tuple[int, int]], stream) -> None:
        raise NotImplementedError

    # staged fills (stream, and page-cache without registration): parallel preads into pinned
    # buffers, uploads on the caller's stream, one event per wave so buffers are reused safely

    def _stage_buffers(self) -> list[np.ndarray]:
        if not hasattr(self, "_expert_stage"):
            per_matrix = [diskio.align_up(max(g.stride[k] for g in self._geometry), diskio.DIRECT_ALIGN)
                          + 2 * diskio.DIRECT_ALIGN for k in range(3)]
            n = max(2 * self.model.spec.n_used, 4)
            self._expert_stage = [[self.gpu.pinned_bytes(size) for size in per_matrix] for _ in range(n)]
            self._stage_event = self.gpu.Event()
        return self._expert_stage

    def _fill_staged(self, layer: int, fills, stream) -> None:
        g = self._geometry[layer]
        stage = self._stage_buffers()
        mm = self.model.file.mm
        for start in range(0, len(fills), len(stage)):
            wave = fills[start:start + len(stage)]
            self._stage_event.synchronize()          # the previous wave's uploads left these buffers
            futures = []
            for (expert, _slot), bufs in zip(wave, stage):
                for k, (off, n) in enumerate(g.file_ranges(expert)):
                    futures.append(self.pool.submit(self.reader.read_into, bufs[k], off, n))
            views = [f.result() for f in futures]
            for i, (expert, slot) in enumerate(wave):
                dst = self._expert_ptr + slot * self.slots.slot_bytes
                for k in range(3):
                    data = views[3 * i + k]
                    self.gpu.copy_htod_async(dst + self.slots.sub_offset[k], self.gpu.host_addr(data), data.nbytes, stream)
                    self.counters.h2d_request_bytes += data.nbytes
                    self.counters.disk_read_bytes += data.nbytes
                    if self.drop_pages:
                        off, n = g.file_ranges(expert)[k]
                        self.reader.drop(off, n, mm)
                        self.counters.dropped_bytes += n
            self._stage_event.record(stream)

    def close(self) -> None:
        ev = getattr(self, "_stage_event", None)
        if ev is not None:
            try:
                ev.synchronize()
                ev.close()
            except Exception:
                pass
        super().close()


class PageCacheSource(_ExpertCachingSource):
    """page-cache: the file stays in RAM (page-locked by registration), nothing is ever dropped."""

    regime = "page-cache"

    def __init__(self, model: Model, **kw):
        kw["direct_io"] = False
        kw["drop_pages"] = False
        super().__init__(model, **kw)
        try:
            self._host_base = None
            mm = model.file.mm
            if diskio.residency(mm) < 0.99:   # registration would fault it in silently: do it with a bar
                warm_page_cache(model, self.progress)
            try:
                self._host_base = self._register_mapping()
            except Exception as e:
                self.log(f"ds4py: could not page-lock the file mapping ({e}); experts are copied through pinned "
                         f"staging from the page cache instead (slower misses)")
            if self._host_base is not None:
                self._upload_registered(self.plan, self.arena, self._host_base, "copying dense weights to VRAM")
            else:
                self._upload_plan(self.plan, self.arena, "copying dense weights to VRAM")
            self._rewrite_scales_last()
            self._report_load("page-cache: dense weights in VRAM")
        except BaseException:
            self.close()
            raise
        finally:
            self._loading = False

    def _fill(self, layer: int, fills, stream) -> None:
        if self._host_base is None:
            self._fill_staged(layer, fills, stream)
            return
        g = self._geometry[layer]
        for expert, slot in fills:
            dst = self._expert_ptr + slot * self.slots.slot_bytes
            for k, (off, n) in enumerate(g.file_ranges(expert)):
                self.gpu.copy_htod_async(dst + self.slots.sub_offset[k], self._host_base + off, n, stream)
                self.counters.h2d_request_bytes += n


class StreamSource(_ExpertCachingSource):
    """stream: experts read from disk on demand (O_DIRECT when allowed), pages dropped after use."""

    regime = "stream"

    def __init__(self, model: Model, **kw):
        kw.setdefault("direct_io", True)
        kw.setdefault("drop_pages", True)
        super().__init__(model, **kw)
        try:
            self._upload_plan(self.plan, self.arena, "copying dense weights to VRAM")
            self._rewrite_scales_last()
            self._report_load("stream: dense weights in VRAM")
        except BaseException:
            self.close()
            raise
        finally:
            self._loading = False

    def _fill(self, layer: int, fills, stream) -> None:
        self._fill_staged(layer, fills, stream)


# ---- building a source ------------------------------------------------------------------------------

def open_source(model: Model, decision, options=None, *, progress=True, log=None, expert_slots: int | None = None):
    """The source for a Decision (io/detect.py) and the resolved options (ds4py/options.py)."""
    from ds4py.options import WeightOptions
    opts = options or WeightOptions()
    log = log or _stderr_line
    if opts.warm_weights:
        warm_page_cache(model, progress)
    common = dict(chunk_mb=opts.copy_chunk_mb, io_threads=opts.io_threads, progress=progress, log=log)
    regime = decision.regime
    if regime == "cpu":
        return HostSource(model)
    if regime == "device":
        return DeviceSource(model, arena_limit=decision.arena_limit, direct_io=decision.direct_io,
                            drop_pages=decision.drop_pages, **common)
    if regime == "host-mapped":
        return DeviceSource(model, host_mapped=True, **common)
    slots = expert_slots if expert_slots is not None else decision.expert_cache_slots
    if regime == "page-cache":
        return PageCacheSource(model, expert_slots=slots, **common)
    if regime == "stream":
        return StreamSource(model, expert_slots=slots, direct_io=decision.direct_io,
                            drop_pages=decision.drop_pages, **common)
    raise ValueError(f"unknown regime {regime!r}")


def plan_weights(model: Model, options=None, report=None):
    """Measure the machine and decide: (Decision, MachineReport). ResourceError if a forced
    regime cannot run."""
    from ds4py.io import machine
    from ds4py.io.detect import Refusal, decide
    from ds4py.options import WeightOptions
    opts = options or WeightOptions()
    report = report or machine.measure(model)
    try:
        decision = decide(report.facts(model, opts.n_ctx), opts.to_request())
    except Refusal as e:
        raise ResourceError(str(e)) from None
    return decision, report


def load_weights(model: Model, options=None, *, progress=True, log=None, before_open=None):
    """Decide, say so in one line (plus warnings), and open the source: (source, decision).
    before_open(decision): called between the two (the engine compiles its kernels there, before
    the source takes its VRAM)."""
    log = log or _stderr_line
    decision, _report = plan_weights(model, options)
    log(f"ds4py: weights {decision.summary()}")
    for w in decision.warnings:
        log(f"ds4py: warning: {w}")
    if before_open is not None:
        before_open(decision)
    return open_source(model, decision, options, progress=progress, log=log), decision
