"""A numpy stand-in for ds4py.io.gpu: "device" memory is host memory, copies are memmove.

It has the functions the weight sources call, with the same int-pointer conventions, so CI runs
every source's bookkeeping (arena plans, staging ring, expert cache, fallbacks, counters) on a CPU.
It checks what a real driver would refuse: double registration, unregistering what is not
registered, copies from host memory that is neither pinned nor registered (a pageable source would
silently turn every async upload synchronous: the mudler/vllm.cpp#1897 problem).
"""

import ctypes

import numpy as np

from ds4py.io import diskio
from ds4py.io.gpu import CudaCallError  # noqa: F401  (the sources catch this type)


class FakeGpu:
    CudaCallError = CudaCallError

    def __init__(self, vram_bytes: int = 1 << 40):
        self.vram_free = vram_bytes
        self.pinned: dict[int, int] = {}        # address -> size (pinned_bytes and registrations)
        self.registered: set[int] = set()
        self.allocations: list[np.ndarray] = []
        self.h2d_bytes = 0
        self.copies_from_unpinned = 0
        self.rewrites: list[tuple[int, int, int]] = []     # (arena offset, rows, K) of rewrite_scales_last

    # ---- context, memory ------------------------------------------------------------------------
    def ensure_context(self):
        pass

    def device_bytes(self, nbytes):
        if nbytes > self.vram_free:
            raise CudaCallError(f"cuMemAlloc({nbytes})", "CUDA_ERROR_OUT_OF_MEMORY")
        self.vram_free -= nbytes
        arr = np.zeros(max(int(nbytes), 1), dtype=np.uint8)
        self.allocations.append(arr)
        return arr

    def device_ptr(self, arr):
        return int(arr.ctypes.data)

    def host_addr(self, arr):
        return int(arr.ctypes.data)

    def pinned_bytes(self, nbytes):
        buf = diskio.aligned_empty(int(nbytes))
        self.pinned[buf.ctypes.data] = int(nbytes)
        self.allocations.append(buf)        # never freed: a reused address would look pinned
        return buf

    def release_deferred(self):
        pass

    def wrap_device(self, ptr, nbytes, owner=None):
        return np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(int(ptr)))

    # ---- registration ---------------------------------------------------------------------------
    def _register(self, addr, nbytes):
        for a, n in self.pinned.items():
            if a < addr + nbytes and addr < a + n:
                raise CudaCallError("cuMemHostRegister", "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
        self.pinned[addr] = nbytes
        self.registered.add(addr)

    def register_host(self, addr, nbytes, read_only=True):
        self._register(addr, nbytes)
        return addr                              # UVA: the device pointer is the host address

    def pin_host(self, addr, nbytes):
        self._register(addr, nbytes)

    def unregister_host(self, addr):
        if addr not in self.registered:
            raise CudaCallError("cuMemHostUnregister", "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")
        self.registered.discard(addr)
        del self.pinned[addr]

    def call(self, name, *args):
        if name == "cuMemHostGetDevicePointer":
            return args[0]
        raise NotImplementedError(name)

    # ---- streams, events, copies ----------------------------------------------------------------
    class Stream:
        ptr = 1
        numba = None

        def synchronize(self):
            pass

        def close(self):
            pass

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

        def close(self):
            pass

    def _is_pinned(self, addr, nbytes):
        return any(a <= addr and addr + nbytes <= a + n for a, n in self.pinned.items())

    def rewrite_scales_last(self, arena, offset, n_rows, K, stream, back=False):
        from ds4py.kernels import formats
        nbytes = n_rows * formats.row_bytes(formats.Q8_0, K)
        rows = arena[offset:offset + nbytes].reshape(n_rows, -1)
        if back:
            arena[offset:offset + nbytes] = formats.from_scales_last(rows).reshape(-1)
        else:
            arena[offset:offset + nbytes] = formats.to_scales_last(rows).reshape(-1)
            self.rewrites.append((offset, n_rows, K))

    def copy_htod_async(self, dst_ptr, src_addr, nbytes, stream):
        if not self._is_pinned(src_addr, nbytes):
            self.copies_from_unpinned += 1
        ctypes.memmove(dst_ptr, src_addr, nbytes)
        self.h2d_bytes += nbytes


def resident_bytes(src, model, name):
    """The bytes a GPU source's arena holds for a dense tensor: the file's, rewritten scales-last
    where the source says so (src.scales_last)."""
    from ds4py.kernels import formats
    want = model.file.bytes_view(name)
    if name in src.scales_last:
        info = model.file.tensors[name]
        want = formats.to_scales_last(want.reshape(info.ne[1], -1)).reshape(-1)
    return want
