"""Weight-source machinery that runs without a GPU: aligned reads, page-cache control, arena plans,
the staging ring (into a numpy arena), expert geometry and the expert cache's LRU policy."""

import errno
import mmap
import os

import numpy as np
import pytest

from ds4py.io import diskio, layout
from ds4py.io.diskio import DIRECT_ALIGN, FileReader
from ds4py.io.expert_cache import ExpertCachePolicy
from ds4py.io.sources import Counters, HostSource
from ds4py.io.spec import open_model
from ds4py.io.staging import NumpyUploader, plan_chunks, pump, slot_bytes_for
from concurrent.futures import ThreadPoolExecutor


@pytest.fixture
def data_file(tmp_path):
    """A 3 MiB + 123 B file of known random bytes (size deliberately not block-aligned)."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=3 * (1 << 20) + 123, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


# ---- O_DIRECT reader -------------------------------------------------------------------------------

def _ranges(size, rng, n=40):
    out = [(0, size), (size - 1, 1), (4095, 2), (4096, 4096), (size - 5000, 5000)]
    for _ in range(n):
        off = int(rng.integers(0, size - 1))
        out.append((off, int(rng.integers(1, min(300_000, size - off) + 1))))
    return out


@pytest.mark.parametrize("direct", [True, False])
def test_reader_returns_exact_bytes(data_file, direct):
    path, data = data_file
    lines = []
    with FileReader(path, direct=direct, log=lines.append) as r:
        buf = diskio.aligned_empty(FileReader.span_bytes(0, len(data)) + DIRECT_ALIGN)
        for off, n in _ranges(len(data), np.random.default_rng(1)):
            got = r.read_into(buf, off, n)
            assert got.nbytes == n and np.array_equal(got, data[off:off + n]), (off, n)
        if direct and r.direct:
            assert r.stats.direct_bytes > 0 and r.stats.buffered_bytes == 0
            assert r.stats.direct_bytes % DIRECT_ALIGN == 0
        if not direct:
            assert r.stats.direct_bytes == 0


def test_reader_read_at_places_bytes_at_file_offsets(data_file):
    path, data = data_file
    with FileReader(path, direct=True, log=lambda m: None) as r:
        base = 8192
        buf = diskio.aligned_empty(1 << 20)
        r.read_at(buf, base, 10_000, 50_000)
        assert np.array_equal(buf[10_000 - base:60_000 - base], data[10_000:60_000])
        with pytest.raises(ValueError):
            r.read_at(buf, base + 1, 10_000, 10)          # unaligned base
        with pytest.raises(ValueError):
            r.read_into(buf, len(data) - 10, 20)           # past the end


def test_reader_falls_back_to_buffered_on_einval_once(data_file, monkeypatch):
    """A filesystem refusing an O_DIRECT read (EINVAL) -> buffered reads, one line, right bytes."""
    path, data = data_file
    lines = []
    r = FileReader(path, direct=True, log=lines.append)
    if not r.direct:
        pytest.skip(f"this filesystem refuses O_DIRECT outright ({r.fallback_reason})")
    real = FileReader._pread

    def refuse_direct(fd, view, offset):
        if fd == r.direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, view, offset)

    monkeypatch.setattr(r, "_pread", refuse_direct)
    buf = diskio.aligned_empty(1 << 20)
    for off, n in [(100, 5000), (70_000, 300_000), (0, 4096)]:
        assert np.array_equal(r.read_into(buf, off, n), data[off:off + n])
    assert not r.direct
    assert len(lines) == 1 and "EINVAL" in lines[0] and "buffered" in lines[0]
    assert r.stats.buffered_bytes == 5000 + 300_000 + 4096
    r.close()


def test_reader_open_refusal_falls_back(data_file, monkeypatch):
    """O_DIRECT refused at open (tmpfs on older kernels) -> buffered from the start, said once."""
    path, data = data_file
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    lines = []
    with FileReader(path, direct=True, log=lines.append) as r:
        assert not r.direct and "refused O_DIRECT at open" in r.fallback_reason
        buf = diskio.aligned_empty(1 << 16)
        assert np.array_equal(r.read_into(buf, 3, 1000), data[3:1003])
    assert len(lines) == 1


def test_direct_io_support_probe(data_file):
    path, _ = data_file
    ok, why = diskio.direct_io_support(path)
    assert ok or why
    assert diskio.filesystem_of(path) != ""


def test_direct_read_errors_other_than_refusal_propagate(data_file, monkeypatch):
    path, _ = data_file
    r = FileReader(path, direct=False, log=lambda m: None)
    monkeypatch.setattr(r, "_pread", lambda fd, view, off: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError):
        r.read_into(diskio.aligned_empty(8192), 0, 10)
    r.close()


# ---- page cache: mincore, DONTNEED, populate ------------------------------------------------------------

def _mapped(path):
    fd = os.open(path, os.O_RDONLY)
    return fd, mmap.mmap(fd, 0, access=mmap.ACCESS_READ)


def test_mincore_sees_pages_read(tmp_path):
    path = tmp_path / "m.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd, mm = _mapped(str(path))
    try:
        diskio.populate(mm)
        assert diskio.residency(mm) == 1.0
        assert diskio.resident_bytes(mm) == 4 << 20
        assert diskio.resident_pages(mm, 4096, 8192).size == 2
    finally:
        mm.close()
        os.close(fd)


def test_dontneed_drops_pages(tmp_path):
    """madvise(MADV_DONTNEED) + posix_fadvise(DONTNEED) empties the page cache for the file."""
    path = tmp_path / "d.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())          # dirty pages cannot be dropped
    fd, mm = _mapped(str(path))
    try:
        diskio.populate(mm)
        assert diskio.residency(mm) == 1.0
        diskio.drop_pages(fd, 0, len(mm), mm)
        after = diskio.residency(mm)
        if after > 0.5:
            fs = diskio.filesystem_of(str(path))
            pytest.skip(f"{fs} at {tmp_path} keeps pages after POSIX_FADV_DONTNEED (residency {after:.2f}); "
                        f"the filesystem, not ds4py, refuses")
        assert after < 0.05
        # a partial drop leaves the rest
        diskio.populate(mm)
        diskio.drop_pages(fd, 0, 4 << 20, mm)
        pages = diskio.resident_pages(mm)
        assert pages[len(pages) // 2:].all() and pages[:len(pages) // 2].mean() < 0.05
    finally:
        mm.close()
        os.close(fd)


def test_o_direct_reads_leave_page_cache_alone(tmp_path):
    path = tmp_path / "o.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    fd, mm = _mapped(str(path))
    try:
        diskio.drop_pages(fd, 0, len(mm), mm)
        if diskio.residency(mm) > 0.05:
            pytest.skip("this filesystem keeps pages after DONTNEED")
        with FileReader(str(path), direct=True, log=lambda m: None) as r:
            if not r.direct:
                pytest.skip(f"no O_DIRECT here: {r.fallback_reason}")
            r.read_into(diskio.aligned_empty(5 << 20), 0, 4 << 20)
        assert diskio.residency(mm) < 0.05
    finally:
        mm.close()
        os.close(fd)


# ---- arena plans and expert geometry -------------------------------------------------------------------

def test_merge_spans_and_plan():
    spans = [(100, 200), (100, 200), (150, 300), (10_000, 10_100), (1 << 20, (1 << 20) + 10)]
    assert layout.merge_spans(spans, 0) == [(100, 300), (10_000, 10_100), (1 << 20, (1 << 20) + 10)]
    assert layout.merge_spans(spans, 64 << 10) == [(100, 10_100), (1 << 20, (1 << 20) + 10)]
    plan = layout.plan_arena(spans, 0)
    for s, e in spans:
        off = plan.offset_of(s, e - s)
        assert off % 4096 == s % 4096          # file alignment survives in the arena
    assert plan.copy_bytes == 200 + 100 + 10
    with pytest.raises(KeyError):
        plan.offset_of(5000)
    with pytest.raises(KeyError):
        plan.offset_of(250, 100)               # runs past its interval


def test_plan_copies_aliased_tensors_once(tmp_path):
    import dataclasses

    from ds4py import synth
    path = tmp_path / "alias.gguf"
    spec = dataclasses.replace(synth.preset_spec("tiny"), n_vocab=512)
    synth.build_model(str(path), "tiny", "per-role", seed=2, spec=spec)
    m = open_model(path)
    try:
        plan = layout.plan_arena(layout.spans_of(m, m.file.tensors))
        assert plan.copy_bytes <= m.validation.unique_bytes + 64 * len(plan.intervals) * 1024
        assert plan.copy_bytes < sum(t.nbytes for t in m.file.tensors.values())
        spans = {}
        for name, t in m.file.tensors.items():
            spans.setdefault(t.span, set()).add(plan.offset_of(t.offset, t.nbytes))
        assert all(len(offs) == 1 for offs in spans.values())   # same range, same arena bytes
    finally:
        m.close()


def test_expert_geometry_matches_the_file(tiny_model):
    m = open_model(tiny_model)
    try:
        geo = layout.expert_geometry(m)
        slots = layout.slot_layout(geo)
        assert len(geo) == m.spec.n_layer
        for g in geo:
            for k, sfx in enumerate(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")):
                rows = m.file.rows(f"blk.{g.layer}.{sfx}")          # (n_exp, rows, row_bytes)
                for e in (0, 5, m.spec.n_exp - 1):
                    off, n = g.file_ranges(e)[k]
                    got = np.frombuffer(m.file.mm, np.uint8, n, off)
                    assert np.array_equal(got, rows[e].reshape(-1))
            assert slots.slot_bytes >= g.expert_bytes
        assert all(o % layout.SLOT_ALIGN == 0 for o in slots.sub_offset)
        assert slots.offsets(3)[0] == 3 * slots.slot_bytes
    finally:
        m.close()


# ---- the staging ring, into a numpy arena ---------------------------------------------------------------

@pytest.mark.parametrize("direct,chunk,slots,threads", [(True, 1 << 20, 4, 4), (False, 1 << 20, 4, 3),
                                                        (True, 256 << 10, 1, 2), (True, 8 << 20, 2, 8)])
def test_pump_moves_every_tensor_byte_exactly(tiny_model, direct, chunk, slots, threads):
    m = open_model(tiny_model)
    try:
        plan = layout.plan_arena(layout.spans_of(m, m.file.tensors))
        arena = np.zeros(plan.nbytes, dtype=np.uint8)
        chunks = plan_chunks(plan, chunk)
        assert sum(c.nbytes for c in chunks) == plan.copy_bytes
        assert all(c.nbytes <= chunk for c in chunks)
        buffers = [diskio.aligned_empty(slot_bytes_for(chunk)) for _ in range(slots)]
        uploader = NumpyUploader(arena)
        seen = []
        with FileReader(m.path, direct=direct, log=lambda s: None) as r, ThreadPoolExecutor(threads) as pool:
            moved = pump(r, chunks, buffers, uploader, pool, threads, progress=seen.append)
        assert moved == plan.copy_bytes == sum(seen)
        assert uploader.uploads == len(chunks)
        for name, t in m.file.tensors.items():
            off = plan.offset_of(t.offset, t.nbytes)
            assert np.array_equal(arena[off:off + t.nbytes], m.file.bytes_view(name)), name
    finally:
        m.close()


def test_pump_propagates_read_errors(tiny_model):
    m = open_model(tiny_model)
    try:
        plan = layout.plan_arena(layout.spans_of(m, m.file.tensors))
        chunks = plan_chunks(plan, 1 << 20)
        buffers = [diskio.aligned_empty(slot_bytes_for(1 << 20)) for _ in range(4)]
        r = FileReader(m.path, direct=False, log=lambda s: None)
        calls = {"n": 0}
        real = FileReader._pread

        def flaky(fd, view, off):
            calls["n"] += 1
            if calls["n"] == 7:
                raise OSError(errno.EIO, "I/O error")
            return real(fd, view, off)

        r._pread = flaky
        with ThreadPoolExecutor(4) as pool, pytest.raises(OSError):
            pump(r, chunks, buffers, NumpyUploader(np.zeros(plan.nbytes, np.uint8)), pool, 4)
        r.close()
    finally:
        m.close()


# ---- the expert cache's policy ------------------------------------------------------------------

def test_expert_cache_hits_misses_and_lru_eviction():
    c = ExpertCachePolicy(4)
    a = c.assign(0, [1, 2])
    assert a.slots == [0, 1] and a.fills == [(1, 0), (2, 1)] and (c.hits, c.misses) == (0, 2)
    a = c.assign(0, [2, 3])
    assert a.slots == [1, 2] and a.fills == [(3, 2)] and (c.hits, c.misses) == (1, 3)
    a = c.assign(1, [1])                    # another layer: a different key
    assert a.fills == [(1, 3)] and len(c) == 4
    # full: (0,1) is the least recently used, so it goes first
    a = c.assign(1, [7])
    assert a.evicted == [(0, 1)] and a.slots == [0] and c.evictions == 1
    assert c.slot_of(0, 1) is None and c.slot_of(1, 7) == 0


def test_expert_cache_never_evicts_the_current_selection():
    c = ExpertCachePolicy(3)
    c.assign(0, [0, 1, 2])
    c.assign(0, [0])                        # 0 most recent; LRU order now 1, 2, 0
    a = c.assign(0, [1, 5, 2])              # 1 and 2 are old but selected: 0 must go
    assert a.evicted == [(0, 0)] and a.fills == [(5, 0)]
    assert sorted(a.slots) == [0, 1, 2] and len(set(a.slots)) == 3


def test_expert_cache_duplicates_and_capacity():
    c = ExpertCachePolicy(2)
    a = c.assign(3, [4, 4, 5])
    assert a.slots[0] == a.slots[1] != a.slots[2] and len(a.fills) == 2 and c.misses == 2
    with pytest.raises(ValueError):
        c.assign(3, [1, 2, 3])
    c.forget(3, 4)
    assert c.slot_of(3, 4) is None
    a = c.assign(3, [9])
    assert a.evicted == [] and a.fills                # the forgotten slot was free again
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError):
        ExpertCachePolicy(0)


def test_expert_cache_random_workload_invariants():
    rng = np.random.default_rng(3)
    c = ExpertCachePolicy(20)
    resident = {}
    for step in range(2000):
        layer = int(rng.integers(0, 4))
        ids = rng.choice(16, size=6, replace=False).tolist()
        a = c.assign(layer, ids)
        for key in a.evicted:
            resident.pop(key)
        for e, slot in a.fills:
            assert slot not in resident.values()
            resident[(layer, e)] = slot
        assert [resident[(layer, e)] for e in ids] == a.slots
        assert len(resident) <= 20 and len(set(resident.values())) == len(resident)
    assert c.hits + c.misses == 2000 * 6
    assert c.misses - c.evictions == len(c)


# ---- the CPU path ------------------------------------------------------------------------------------

def test_host_source_reads_the_mapping(tiny_model):
    m = open_model(tiny_model)
    try:
        src = HostSource(m)
        assert src.regime == "cpu" and src.has("output.weight") and not src.has("nope")
        for name in list(m.file.tensors)[:20]:
            assert np.shares_memory(src.host(name), np.frombuffer(m.file.mm, np.uint8))
        assert src.counters.as_dict() == Counters().as_dict()
        src.close()
    finally:
        m.close()


def test_counters_as_dict_lists_every_field():
    c = Counters(disk_read_bytes=5)
    d = c.as_dict()
    assert d["disk_read_bytes"] == 5 and set(d) >= {"h2d_load_bytes", "h2d_request_bytes", "expert_hits",
                                                    "expert_misses", "expert_evictions"}


def test_io_imports_without_cuda():
    """CI has neither a GPU nor numba-cuda: the io package must import with both blocked."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['numba.cuda'] = None; sys.modules['cuda'] = None; "
            "sys.modules['cuda.bindings'] = None; sys.modules['pynvml'] = None; "
            "import ds4py.io.sources, ds4py.io.detect, ds4py.io.machine, ds4py.io.staging, ds4py.io.gpu; "
            "from ds4py.io import machine; p = machine.probe_gpus(); print(p.via, len(p.gpus))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none", "0"]


def test_host_registrations_are_shared(monkeypatch):
    """io.gpu page-locks a host range once per process: a second register or pin inside a range it
    holds adds a user instead of a driver call (which would fail ALREADY_REGISTERED), and the
    driver's unregister comes with the last user's release, whatever the order."""
    from ds4py.io import gpu
    driver_calls = []

    def fake_call(name, *args):
        driver_calls.append((name, args[0]))
        return args[0] if name == "cuMemHostGetDevicePointer" else None
    monkeypatch.setattr(gpu, "call", fake_call)
    monkeypatch.setattr(gpu, "ensure_context", lambda: None)
    monkeypatch.setattr(gpu, "_registrations", [])
    monkeypatch.setattr(gpu, "_handed_out", {})
    base, size = 1 << 20, 1 << 16
    registers = lambda: [c for c in driver_calls if c[0] == "cuMemHostRegister"]      # noqa: E731
    unregisters = lambda: [c for c in driver_calls if c[0] == "cuMemHostUnregister"]  # noqa: E731
    assert gpu.register_host(base, size) == base               # the first source: the driver registers
    assert gpu.register_host(base, size) == base               # a second source over the same mapping
    gpu.pin_host(base + 4096, 8192)                             # a window inside it (the DMA loader)
    assert registers() == [("cuMemHostRegister", base)]
    gpu.pin_host(base + size, 4096)                             # a range outside: its own registration
    assert len(registers()) == 2
    for addr in (base, base + 4096, base + size):
        gpu.unregister_host(addr)
    assert unregisters() == [("cuMemHostUnregister", base + size)]   # the mapping still has a user
    gpu.unregister_host(base)
    assert unregisters()[-1] == ("cuMemHostUnregister", base) and not gpu._registrations
    gpu.unregister_host(base + 3 * size)                        # never registered: the driver answers
    assert unregisters()[-1] == ("cuMemHostUnregister", base + 3 * size)


# ---- the GPU sources' logic, on a numpy stand-in for the device -----------------------------------------

from fake_gpu import FakeGpu, resident_bytes  # noqa: E402

from ds4py.io import sources  # noqa: E402


def _expert_bytes(m, layer, e):
    g = layout.expert_geometry(m)[layer]
    return [np.frombuffer(m.file.mm, np.uint8, n, off) for off, n in g.file_ranges(e)]


def _check_dense(src, m):
    for name, t in m.file.tensors.items():
        if src.regime in ("page-cache", "stream") and layout.is_routed_expert(name):
            continue
        arena, off = src.dense(name)
        assert arena is src.arena
        assert np.array_equal(np.asarray(arena[off:off + t.nbytes]), resident_bytes(src, m, name)), name


def _check_experts(src, m, layer, ids):
    offs = src.fetch_experts(layer, ids)
    assert offs.shape == (len(ids), 3) and offs.dtype == np.int64
    for row, e in zip(offs, ids):
        for k, want in enumerate(_expert_bytes(m, layer, e)):
            got = np.asarray(src.expert_arena[row[k]:row[k] + want.nbytes])
            assert np.array_equal(got, want), (layer, e, k)
    return offs


@pytest.fixture
def tiny(tiny_model):
    m = open_model(tiny_model)
    yield m
    m.close()


@pytest.mark.parametrize("load_path,direct", [("staged", True), ("staged", False), ("registered", False),
                                              ("auto", False)])
def test_device_source_holds_every_byte_and_first_request_uploads_nothing(tiny, load_path, direct):
    gpu, lines = FakeGpu(), []
    src = sources.DeviceSource(tiny, gpu=gpu, load_path=load_path, direct_io=direct, chunk_mb=1, progress=False,
                               log=lines.append)
    assert src.regime == "device" and src.arena.nbytes % 256 == 0
    loaded = src.counters.h2d_load_bytes
    assert loaded == src.plan.copy_bytes == gpu.h2d_bytes
    # a request, as the engine makes it: every dense tensor, then the experts of every layer
    _check_dense(src, tiny)
    for il in range(tiny.spec.n_layer):
        _check_experts(src, tiny, il, [0, 3, tiny.spec.n_exp - 1, 5, 1, 2])
        b = src.expert_base(il)
        offs = src.fetch_experts(il, [7])
        assert offs[0].tolist() == [b.gate_off + 7 * b.gate_stride, b.up_off + 7 * b.up_stride,
                                    b.down_off + 7 * b.down_stride]
    assert src.counters.h2d_request_bytes == 0 and gpu.h2d_bytes == loaded
    assert src.expert_base_table().shape == (tiny.spec.n_layer, 6)
    assert gpu.copies_from_unpinned == 0
    src.close()
    assert not gpu.registered
    assert any("device-resident" in line and "GB/s" in line for line in lines)


def test_device_source_keeps_eligible_q8_0_matrices_scales_last(tiny):
    """Every dense Q8_0 matrix with K % 256 == 0 is rewritten scales-last, once, and named in
    src.scales_last; the others (tiny: K = 128) keep the file's bytes (_check_dense checks both)."""
    from ds4py.kernels import formats
    gpu = FakeGpu()
    src = sources.DeviceSource(tiny, gpu=gpu, progress=False, log=lambda s: None)
    want = {n for n in layout.dense_names(tiny) if tiny.file.tensors[n].ggml_type == formats.Q8_0
            and tiny.file.tensors[n].ne[0] % 256 == 0}
    assert src.scales_last == want and "output.weight" in want
    assert any(tiny.file.tensors[n].ggml_type == formats.Q8_0 and n not in want for n in layout.dense_names(tiny))
    assert len(gpu.rewrites) == len(want)                   # no tensor aliases another in this file
    _check_dense(src, tiny)
    src.keep_scales_last(False)                         # back to the file's bytes, and again
    assert not src.scales_last
    _check_dense(src, tiny)
    src.keep_scales_last(True)
    assert src.scales_last == want
    _check_dense(src, tiny)
    src.close()
    sources.SCALES_LAST = False
    try:
        plain = sources.DeviceSource(tiny, gpu=FakeGpu(), progress=False, log=lambda s: None)
        assert not plain.scales_last
        _check_dense(plain, tiny)
        plain.close()
    finally:
        sources.SCALES_LAST = True


def test_aliased_matrices_are_rewritten_once(tmp_path):
    """--alias per-role: the layers' matrices share one range, which is rewritten once and every
    alias is named; a range that another tensor overlaps partially is left alone."""
    from ds4py import synth
    from ds4py.kernels import formats
    path = tmp_path / "aliased.gguf"
    synth.build_model(str(path), "tiny", "per-role", seed=0)
    m = open_model(path)
    try:
        gpu = FakeGpu()
        src = sources.DeviceSource(m, gpu=gpu, progress=False, log=lambda s: None)
        q_a = {n for n in src.scales_last if n.endswith("attn_q_a.weight")}
        assert len(q_a) == m.spec.n_layer
        assert len(gpu.rewrites) == len({m.file.tensors[n].span for n in src.scales_last})
        assert len(gpu.rewrites) < len(src.scales_last)
        _check_dense(src, m)
        src.close()
        # a partial view of the q_a range (another tensor starting inside it) keeps the range as it is
        info = m.file.tensors["blk.0.attn_q_a.weight"]
        plan = layout.plan_arena(layout.spans_of(m, m.file.tensors))
        view = type(info)("view", info.ggml_type, (info.ne[0], 1), info.offset + info.row_bytes, info.row_bytes)
        m.file.tensors["view"] = view
        try:
            names = layout.scales_last_rewrites(m, plan, layout.dense_names(m))
            assert not any("blk.0.attn_q_a.weight" in r.names for r in names)
            assert names and all(formats.scales_last_ok(formats.Q8_0, r.K, r.arena_offset) for r in names)
        finally:
            del m.file.tensors["view"]
    finally:
        m.close()


def test_device_source_falls_back_to_host_mapped_when_the_arena_exceeds_the_budget(tiny):
    gpu, lines = FakeGpu(), []
    src = sources.DeviceSource(tiny, gpu=gpu, arena_limit=1 << 20, progress=False, log=lines.append)
    assert src.regime == "host-mapped"
    assert len(lines) == 1 and "falling back to host-mapped" in lines[0] and "limit" in lines[0]
    assert src.counters.h2d_load_bytes == 0 and gpu.h2d_bytes == 0
    _check_dense(src, tiny)
    _check_experts(src, tiny, 1, [2, 4])
    assert src.dense("output.weight")[1] == tiny.file.tensors["output.weight"].offset   # file offsets
    src.close()
    assert not gpu.registered


def test_device_source_falls_back_when_vram_is_taken(tiny):
    gpu, lines = FakeGpu(vram_bytes=10 << 20), []
    src = sources.DeviceSource(tiny, gpu=gpu, progress=False, log=lines.append)
    assert src.regime == "host-mapped" and "OUT_OF_MEMORY" in lines[0]
    _check_dense(src, tiny)
    src.close()


def test_direct_model_is_host_mapped_without_copying(tiny):
    gpu, lines = FakeGpu(), []
    src = sources.DeviceSource(tiny, gpu=gpu, host_mapped=True, progress=False, log=lines.append)
    assert src.regime == "host-mapped" and gpu.h2d_bytes == 0 and "--direct-model" in lines[0]
    assert not src.scales_last and not gpu.rewrites      # the file mapping is never written
    _check_experts(src, tiny, 0, [1])
    src.close()


def test_page_cache_source_caches_experts_lru_and_keeps_pages(tiny):
    # the whole file in the page cache first: the kernel may reclaim a page of it at any time
    # before this test (CI, session 15: 1 page of ~30,000 gone), and the check below is about
    # what the source does, not what the machine did before
    diskio.populate(tiny.file.mm)
    assert diskio.residency(tiny.file.mm) == 1.0
    gpu = FakeGpu()
    n_used = tiny.spec.n_used
    src = sources.PageCacheSource(tiny, gpu=gpu, expert_slots=2 * n_used, progress=False, log=lambda s: None)
    assert src.regime == "page-cache" and src.expert_arena is src.arena
    _check_dense(src, tiny)
    with pytest.raises(KeyError):
        src.dense("blk.0.ffn_up_exps.weight")
    dense_loaded = src.counters.h2d_load_bytes
    ids = list(range(n_used))
    _check_experts(src, tiny, 0, ids)
    per_expert = sum(layout.expert_geometry(tiny)[0].stride)
    c = src.counters
    assert (c.expert_misses, c.expert_hits, c.h2d_request_bytes) == (n_used, 0, n_used * per_expert)
    _check_experts(src, tiny, 0, ids)                       # all hits, nothing uploaded
    assert (c.expert_hits, c.h2d_request_bytes) == (n_used, n_used * per_expert)
    _check_experts(src, tiny, 1, ids)                       # fills the other half of the slots
    _check_experts(src, tiny, 2, ids)                       # evicts layer 0's
    assert c.expert_evictions == n_used
    _check_experts(src, tiny, 0, ids)                       # back, right bytes
    assert c.h2d_load_bytes == dense_loaded and c.disk_read_bytes == 0 and c.dropped_bytes == 0
    assert gpu.copies_from_unpinned == 0
    assert diskio.residency(tiny.file.mm) == 1.0            # page cache untouched
    src.close()
    assert not gpu.registered


def test_rewind_restores_the_counters_and_empties_the_expert_cache(tiny):
    """A throwaway run between mark() and rewind() (the engine's warm-up) leaves no trace: the
    counters are those of the mark, the same object, and the next fetch misses again and loads
    the right bytes."""
    src = sources.StreamSource(tiny, gpu=FakeGpu(), expert_slots=2 * tiny.spec.n_used, progress=False,
                               log=lambda s: None)
    ids = list(range(tiny.spec.n_used))
    _check_experts(src, tiny, 0, ids)
    counters = src.counters
    mark = src.mark()
    _check_experts(src, tiny, 1, ids)
    assert counters.as_dict() != mark.as_dict()
    src.rewind(mark)
    assert src.counters is counters and counters.as_dict() == mark.as_dict()
    assert len(src.policy) == 0
    _check_experts(src, tiny, 0, ids)
    assert counters.expert_misses == 2 * len(ids)
    src.close()


def test_page_cache_source_without_registration_stages_from_the_page_cache(tiny, monkeypatch):
    gpu, lines = FakeGpu(), []

    def refuse(addr, nbytes, read_only=True):
        raise CudaCallError("cuMemHostRegister", "CUDA_ERROR_NOT_SUPPORTED")

    from ds4py.io.gpu import CudaCallError
    monkeypatch.setattr(gpu, "register_host", refuse)
    src = sources.PageCacheSource(tiny, gpu=gpu, expert_slots=tiny.spec.n_used, progress=False, log=lines.append)
    assert "could not page-lock" in lines[0]
    _check_dense(src, tiny)
    for il in range(tiny.spec.n_layer):
        _check_experts(src, tiny, il, [il, il + 1, 9, 10, 11, 12])
    assert gpu.copies_from_unpinned == 0 and src.counters.disk_read_bytes > 0
    src.close()


@pytest.mark.parametrize("direct", [True, False])
def test_stream_source_reads_on_demand_and_drops_pages(tiny, direct):
    gpu = FakeGpu()
    n_used = tiny.spec.n_used
    src = sources.StreamSource(tiny, gpu=gpu, expert_slots=n_used + 2, direct_io=direct, drop_pages=True,
                               chunk_mb=1, progress=False, log=lambda s: None)
    assert src.regime == "stream"
    _check_dense(src, tiny)
    rng = np.random.default_rng(0)
    for step in range(30):
        il = int(rng.integers(0, tiny.spec.n_layer))
        ids = rng.choice(tiny.spec.n_exp, size=n_used, replace=False).tolist()
        _check_experts(src, tiny, il, ids)
    c = src.counters
    per_expert = sum(layout.expert_geometry(tiny)[0].stride)
    assert c.expert_misses * per_expert == c.h2d_request_bytes
    assert c.expert_hits + c.expert_misses == 30 * n_used and c.expert_evictions > 0
    assert c.dropped_bytes > 0 and gpu.copies_from_unpinned == 0
    # a miss the test has not read through the mapping: its pages are gone after the fetch
    e = next(e for e in range(tiny.spec.n_exp) if src.policy.slot_of(1, e) is None)
    ranges = layout.expert_geometry(tiny)[1].file_ranges(e)
    src.fetch_experts(1, [e])
    left = max(diskio.residency(tiny.file.mm, off, n) for off, n in ranges)
    if diskio.filesystem_of(tiny.path) not in ("tmpfs", "overlay", "ramfs"):
        assert left == 0.0
    src.close()


def test_expert_cache_smaller_than_a_selection_is_refused(tiny):
    from ds4py.errors import ResourceError
    with pytest.raises(ResourceError, match="cannot hold one selection"):
        sources.StreamSource(tiny, gpu=FakeGpu(), expert_slots=2, progress=False, log=lambda s: None)


def test_expert_cache_vram_shortage_is_one_clear_error(tiny):
    from ds4py.errors import ResourceError
    with pytest.raises(ResourceError, match="not available .* lower --ssd-streaming-cache-experts"):
        sources.StreamSource(tiny, gpu=FakeGpu(vram_bytes=1 << 20), expert_slots=6, progress=False,
                             log=lambda s: None)


def test_open_source_follows_the_decision(tiny, monkeypatch):
    from ds4py.io.detect import Decision
    from ds4py.options import from_env
    gpu = FakeGpu()
    real_init = sources.GpuSource.__init__
    monkeypatch.setattr(sources.GpuSource, "__init__", lambda self, model, **kw: real_init(self, model, gpu=gpu, **kw))
    opts = from_env({}, copy_chunk_mb="16")
    cases = [(Decision("device", ("r",), arena_limit=None), "device"),
             (Decision("device", ("r",), arena_limit=1024), "host-mapped"),
             (Decision("host-mapped", ("r",)), "host-mapped"),
             (Decision("page-cache", ("r",), expert_cache_slots=8), "page-cache"),
             (Decision("stream", ("r",), expert_cache_slots=8, direct_io=True, drop_pages=True), "stream"),
             (Decision("cpu", ("r",)), "cpu")]
    for decision, regime in cases:
        src = sources.open_source(tiny, decision, opts, progress=False, log=lambda s: None)
        assert src.regime == regime
        if regime != "cpu":
            assert src.chunk_bytes == 16 << 20
        src.close()
