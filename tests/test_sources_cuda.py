"""The GPU weight sources on a real device: bytes in VRAM equal the file, the device-resident first
request uploads nothing, the VRAM-OOM fallback to host-mapped weights, the expert cache.

Run on the GPU machine: `python -m pytest -m gpu tests/test_sources_cuda.py`."""

import numpy as np
import pytest

from ds4py.io import diskio, gpu, layout, sources
from ds4py.io.spec import open_model
from fake_gpu import resident_bytes

pytestmark = pytest.mark.gpu

if not gpu.available():
    pytest.skip("needs an NVIDIA GPU with numba-cuda", allow_module_level=True)

cuda = gpu.cuda_module()


@pytest.fixture
def tiny(tiny_model):
    m = open_model(tiny_model)
    yield m
    m.close()


def quiet(**kw):
    return dict(progress=False, log=kw.pop("log", lambda s: None), **kw)


def arena_host(src):
    return src.arena.copy_to_host()


def check_dense(src, m, host=None):
    host = arena_host(src) if host is None else host
    for name, t in m.file.tensors.items():
        if src.regime in ("page-cache", "stream") and layout.is_routed_expert(name):
            continue
        arena, off = src.dense(name)
        assert arena is src.arena
        assert np.array_equal(host[off:off + t.nbytes], resident_bytes(src, m, name)), name


def check_experts(src, m, layer, ids, stream=None):
    offs = src.fetch_experts(layer, ids, stream=stream)
    if stream is not None:
        stream.synchronize()
    host = src.expert_arena.copy_to_host()
    g = layout.expert_geometry(m)[layer]
    for row, e in zip(offs, ids):
        for k, (off, n) in enumerate(g.file_ranges(e)):
            assert np.array_equal(host[row[k]:row[k] + n], np.frombuffer(m.file.mm, np.uint8, n, off)), (layer, e, k)
    return offs


@pytest.mark.parametrize("load_path,direct", [("staged", True), ("staged", False), ("registered", False)])
def test_device_source_bytes_and_zero_upload_first_request(tiny, load_path, direct):
    lines = []
    src = sources.DeviceSource(tiny, load_path=load_path, direct_io=direct, chunk_mb=16, **quiet(log=lines.append))
    try:
        assert src.regime == "device"
        loaded = src.counters.h2d_load_bytes
        assert loaded == src.plan.copy_bytes
        assert src.load_stats.how.startswith("DMA" if load_path == "registered" else ("O_DIRECT" if direct else "buffered"))
        host = arena_host(src)
        check_dense(src, tiny, host)
        # the first request, as the engine makes it: dense offsets, then every layer's experts
        for il in range(tiny.spec.n_layer):
            check_experts(src, tiny, il, [0, 5, 3, tiny.spec.n_exp - 1, 8, 9])
        assert src.counters.h2d_request_bytes == 0 and src.counters.h2d_load_bytes == loaded
        # the engine views the arena as f16/f32/i32
        assert src.arena.view(np.float16).size == src.arena.size // 2
        assert src.expert_base_table().shape == (tiny.spec.n_layer, 6)
    finally:
        src.close()


def test_vram_budget_smaller_than_the_model_falls_back_to_host_mapped(tiny):
    lines = []
    src = sources.DeviceSource(tiny, arena_limit=1 << 20, **quiet(log=lines.append))
    try:
        assert src.regime == "host-mapped"
        assert len(lines) == 1 and "falling back to host-mapped" in lines[0]
        assert src.counters.h2d_load_bytes == 0
        check_dense(src, tiny)
        check_experts(src, tiny, 2, [1, 2, 3])
        # kernels read the mapping in place: sum a tensor's bytes on the device
        name = "output.weight"
        arena, off = src.dense(name)
        n = tiny.file.tensors[name].nbytes
        out = cuda.to_device(np.zeros(1, np.uint64))

        @cuda.jit
        def byte_sum(a, start, count, acc):
            i = cuda.grid(1)
            if i < count:
                cuda.atomic.add(acc, 0, np.uint64(a[start + i]))

        byte_sum[(n + 255) // 256, 256](arena, off, n, out)
        assert int(out.copy_to_host()[0]) == int(tiny.file.bytes_view(name).sum(dtype=np.uint64))
    finally:
        src.close()


def test_vram_taken_by_someone_else_falls_back_to_host_mapped(tiny):
    import gc
    gc.collect()                 # arrays other test modules dropped: free them before measuring
    gpu.release_deferred()
    arena_bytes = layout.plan_arena(layout.spans_of(tiny, tiny.file.tensors)).nbytes
    # Take the VRAM in shrinking chunks until nothing more fits (numba clears its deferred frees
    # and retries before it reports an OOM; a second pass takes what that released), then hand
    # back chunks while the free VRAM stays below half the tiny model's arena, so the device copy
    # must fail however much memory was in use before.
    filler = []
    for size in (1 << 30, 64 << 20, 8 << 20, 1 << 20, 8 << 20, 1 << 20):
        while True:
            try:
                filler.append(gpu.device_bytes(size))
            except gpu.CudaCallError:
                gpu.release_deferred()
                break
    assert filler, "could not allocate any VRAM"
    filler.sort(key=lambda a: a.size, reverse=True)          # the smallest chunks are handed back
    while len(filler) > 1 and gpu.mem_info()[0] + filler[-1].size < arena_bytes // 2:
        filler.pop()
        gpu.release_deferred()
    free = gpu.mem_info()[0]
    assert free < arena_bytes, f"could not take the VRAM: {free} B free, arena {arena_bytes} B"
    lines = []
    try:
        src = sources.DeviceSource(tiny, **quiet(log=lines.append))
        try:
            assert src.regime == "host-mapped" and "OUT_OF_MEMORY" in lines[0], \
                f"free VRAM {free} B, arena {arena_bytes} B: {lines}"
            check_dense(src, tiny)
        finally:
            src.close()
    finally:
        del filler
        gpu.release_deferred()


def test_direct_model_reads_in_place(tiny):
    src = sources.DeviceSource(tiny, host_mapped=True, **quiet())
    try:
        assert src.regime == "host-mapped" and src.counters.h2d_load_bytes == 0
        check_experts(src, tiny, 0, [4])
    finally:
        src.close()


def test_page_cache_source_expert_cache_on_the_device(tiny):
    n_used = tiny.spec.n_used
    src = sources.PageCacheSource(tiny, expert_slots=2 * n_used, **quiet())
    stream = cuda.stream()
    try:
        check_dense(src, tiny)
        ids = list(range(n_used))
        check_experts(src, tiny, 0, ids, stream)
        c = src.counters
        per_expert = sum(layout.expert_geometry(tiny)[0].stride)
        assert (c.expert_misses, c.h2d_request_bytes) == (n_used, n_used * per_expert)
        check_experts(src, tiny, 0, ids, stream)
        assert c.expert_hits == n_used and c.h2d_request_bytes == n_used * per_expert
        check_experts(src, tiny, 1, ids, stream)
        check_experts(src, tiny, 2, ids, stream)
        assert c.expert_evictions == n_used
        check_experts(src, tiny, 0, ids, stream)
        assert diskio.residency(tiny.file.mm) == 1.0 and c.dropped_bytes == 0
    finally:
        src.close()


def test_two_page_cache_sources_share_the_registration(tiny):
    """Two page-cache sources over one model both get the registered mapping (not the staged
    fallback: the driver refuses a second registration of the same range), and closing the first
    leaves the second working."""
    lines = []
    first = sources.PageCacheSource(tiny, expert_slots=2 * tiny.spec.n_used, **quiet(log=lines.append))
    second = sources.PageCacheSource(tiny, expert_slots=2 * tiny.spec.n_used, **quiet(log=lines.append))
    try:
        assert not any("could not page-lock" in line for line in lines), lines
        assert first._host_base is not None and second._host_base == first._host_base
        first.close()
        check_experts(second, tiny, 0, list(range(tiny.spec.n_used)), cuda.stream())
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("direct", [True, False])
def test_stream_source_on_the_device(tiny, direct):
    n_used = tiny.spec.n_used
    src = sources.StreamSource(tiny, expert_slots=n_used + 3, direct_io=direct, drop_pages=True, chunk_mb=16, **quiet())
    try:
        check_dense(src, tiny)
        rng = np.random.default_rng(1)
        for _ in range(12):
            il = int(rng.integers(0, tiny.spec.n_layer))
            check_experts(src, tiny, il, rng.choice(tiny.spec.n_exp, n_used, replace=False).tolist())
        c = src.counters
        assert c.expert_misses > 0 and c.expert_evictions > 0 and c.disk_read_bytes > 0 and c.dropped_bytes > 0
    finally:
        src.close()


def test_load_weights_end_to_end(tiny):
    from ds4py.options import from_env
    lines = []
    src, decision = sources.load_weights(tiny, from_env({}), progress=False, log=lines.append)
    try:
        assert decision.regime == "device" and src.regime == "device"
        assert lines[0].startswith("ds4py: weights device: model")
        for il in range(tiny.spec.n_layer):
            src.fetch_experts(il, list(range(tiny.spec.n_used)))
        assert src.counters.h2d_request_bytes == 0
    finally:
        src.close()


def test_pinned_bytes_are_page_aligned_after_small_pinned_arrays():
    """O_DIRECT reads into pinned_bytes buffers need page alignment, which the driver does not give
    an allocation made after a small pinned one (the engine's read-back slots: session 18's
    stream-regime failure)."""
    small = [cuda.pinned_array(2, np.int32) for _ in range(3)]
    for n in (1, 8, 4096, 70_000, 3 * 1024 * 1024 + 5):
        buf = gpu.pinned_bytes(n)
        assert buf.nbytes == n and gpu.host_addr(buf) % diskio.DIRECT_ALIGN == 0
    assert all(s.shape == (2,) for s in small)
