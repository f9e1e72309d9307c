"""The few CUDA calls the weight sources make, imported lazily (CI has no GPU and no numba-cuda).

numba.cuda owns the context, device arrays and pinned buffers; cuda.bindings.driver does what numba
does not expose: host registration with READ_ONLY, async copies from raw host addresses (the
registered file mapping), non-blocking streams and events usable from any thread. Both talk to the
same primary context. Everything takes and returns plain ints for device pointers and host
addresses.
"""

from __future__ import annotations

import threading

import numpy as np

from .diskio import DIRECT_ALIGN

# driver API constants (cuda.h); plain ints so no enum lookups differ between binding versions
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
CU_STREAM_NON_BLOCKING = 0x01
CU_EVENT_DISABLE_TIMING = 0x02

_cuda = None
_driver = None


class CudaCallError(RuntimeError):
    def __init__(self, call: str, code: str):
        super().__init__(f"{call} failed: {code}")
        self.call, self.code = call, code

    @property
    def out_of_memory(self) -> bool:
        return "OUT_OF_MEMORY" in self.code


def cuda_module():
    """numba.cuda, with the NumPy >= 2.5 shim applied before anything compiles."""
    global _cuda
    if _cuda is None:
        try:
            import ds4py.kernels.compat  # noqa: F401  (applies the shim on import)
        except ImportError:              # a tree without kernels/: the same two lines
            if not hasattr(np, "row_stack"):
                np.row_stack = np.vstack
        from numba import cuda
        _cuda = cuda
    return _cuda


def driver():
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as d
        except ImportError:            # cuda-python < 12.6 layout
            from cuda import cuda as d
        _driver = d
    return _driver


def available() -> bool:
    try:
        return bool(cuda_module().is_available())
    except Exception:
        return False


def call(name: str, *args):
    """Call a cuda.bindings driver function; raise CudaCallError unless it returns CUDA_SUCCESS."""
    result = getattr(driver(), name)(*args)
    err, values = result[0], result[1:]
    if int(err) != 0:
        raise CudaCallError(name, getattr(err, "name", str(err)))
    return values[0] if len(values) == 1 else (values or None)


def ensure_context() -> None:
    """Make numba's primary context current on this thread (driver calls need one)."""
    cuda_module().current_context()


def device_ptr(array) -> int:
    return int(array.__cuda_array_interface__["data"][0])


def host_addr(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def mem_info() -> tuple[int, int]:
    free, total = cuda_module().current_context().get_memory_info()
    return int(free), int(total)


def release_deferred() -> None:
    """Free device memory numba is holding in its deferred-deallocation queue, now."""
    cuda_module().current_context().deallocations.clear()


def device_bytes(nbytes: int):
    """A 1-D uint8 device array; raises CudaCallError(out_of_memory) when the VRAM is not there."""
    cuda = cuda_module()
    try:
        return cuda.device_array(max(int(nbytes), 1), dtype=np.uint8)
    except Exception as e:              # numba's CudaAPIError; its text names the CUresult
        text = str(e)
        if "OUT_OF_MEMORY" in text or "out of memory" in text.lower():
            raise CudaCallError(f"cuMemAlloc({nbytes})", "CUDA_ERROR_OUT_OF_MEMORY") from None
        raise


def pinned_bytes(nbytes: int) -> np.ndarray:
    """Page-aligned, page-locked host memory (an O_DIRECT target and an async-copy source). The
    driver may put a small pinned allocation inside a page it already uses (after the engine's
    8-byte read-back slots, the stream source's staging started 8 bytes past a page and O_DIRECT
    refused it: H200, session 18), so the buffer is cut at the first DIRECT_ALIGN boundary of one
    DIRECT_ALIGN bytes larger."""
    nbytes = max(int(nbytes), 1)
    whole = cuda_module().pinned_array(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    start = -whole.ctypes.data % DIRECT_ALIGN
    return whole[start:start + nbytes]          # a view: it keeps `whole` alive


def rewrite_scales_last(arena, offset: int, n_rows: int, K: int, stream, back: bool = False) -> None:
    """Rewrite Q8_0 rows in VRAM into the scales-last layout (kernels/formats.py), or back into the
    file's (back), on `stream`."""
    from ds4py.kernels import cuda as qk
    qk.q8_0_relayout(arena, offset, n_rows, K, to_repacked=not back, stream=stream.numba)


def wrap_device(ptr: int, nbytes: int, owner=None):
    """A numba device array over memory numba did not allocate (e.g. a registered host range)."""
    desc = {"shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False), "version": 3,
            "strides": None}
    return cuda_module().from_cuda_array_interface(desc, owner=owner, sync=False)


class Stream:
    """A non-blocking driver stream; `.numba` is the same stream for kernel launches."""

    def __init__(self):
        ensure_context()
        self.handle = call("cuStreamCreate", CU_STREAM_NON_BLOCKING)
        self.numba = cuda_module().external_stream(int(self.handle))

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        call("cuStreamSynchronize", self.handle)

    def close(self) -> None:
        if self.handle is not None:
            call("cuStreamSynchronize", self.handle)
            call("cuStreamDestroy", self.handle)
            self.handle = None


def stream_ptr(stream) -> int:
    """Raw CUstream of a Stream, a numba stream, or an int (0 = the legacy default stream)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if isinstance(stream, Stream):
        return stream.ptr
    if hasattr(stream, "__cuda_stream__"):          # cuda.core streams and newer numba streams
        return int(stream.__cuda_stream__()[1])
    handle = getattr(stream, "handle", stream)
    value = getattr(handle, "value", None)      # ctypes c_void_p in older numba
    if value is not None or type(handle).__name__ == "c_void_p":
        return int(value or 0)
    return int(handle)


class Event:
    def __init__(self):
        ensure_context()
        self.handle = call("cuEventCreate", CU_EVENT_DISABLE_TIMING)
        self.recorded = False

    def record(self, stream) -> None:
        call("cuEventRecord", self.handle, stream_ptr(stream))
        self.recorded = True

    def synchronize(self) -> None:
        if self.recorded:
            call("cuEventSynchronize", self.handle)

    def close(self) -> None:
        if self.handle is not None:
            call("cuEventDestroy", self.handle)
            self.handle = None


def copy_htod_async(dst_ptr: int, src_addr: int, nbytes: int, stream) -> None:
    """Asynchronous when src is page-locked (pinned buffer or registered mapping)."""
    if nbytes:
        call("cuMemcpyHtoDAsync", dst_ptr, src_addr, nbytes, stream_ptr(stream))


def copy_dtoh(dst: np.ndarray, src_ptr: int) -> np.ndarray:
    """Synchronous device->host copy into a numpy array (tests, debugging)."""
    if dst.nbytes:
        call("cuMemcpyDtoH", host_addr(dst), src_ptr, dst.nbytes)
    return dst


def read_only_register_supported() -> bool:
    d = driver()
    attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
    dev = call("cuCtxGetDevice")
    return bool(call("cuDeviceGetAttribute", attr, dev))


# Host registrations are shared within the process: the driver refuses to register a range that
# overlaps one already registered (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), and two sources over
# one model (or a source and the windowed loader) page-lock the same file mapping. A request inside
# a range this process holds counts as one more user of it; the last user's release unregisters it.
class _Registration:
    __slots__ = ("start", "nbytes", "users")

    def __init__(self, start: int, nbytes: int):
        self.start, self.nbytes, self.users = start, nbytes, 0


_registrations: list[_Registration] = []
_handed_out: dict[int, list[_Registration]] = {}     # address passed to register -> its registrations
_registration_lock = threading.Lock()


def _acquire_host(addr: int, nbytes: int) -> None:
    with _registration_lock:
        reg = next((r for r in _registrations if r.start <= addr and addr + nbytes <= r.start + r.nbytes), None)
        if reg is None:
            ensure_context()
            call("cuMemHostRegister", addr, nbytes, CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY)
            reg = _Registration(addr, nbytes)
            _registrations.append(reg)
        reg.users += 1
        _handed_out.setdefault(addr, []).append(reg)


def register_host(addr: int, nbytes: int) -> int:
    """Page-lock [addr, addr + nbytes) read-only and map it for the device (or share a registration
    that covers it); returns the device pointer."""
    _acquire_host(addr, nbytes)
    return int(call("cuMemHostGetDevicePointer", addr, 0))


def pin_host(addr: int, nbytes: int) -> None:
    """Page-lock [addr, addr + nbytes) for DMA (read-only: the file mapping is PROT_READ)."""
    _acquire_host(addr, nbytes)


def unregister_host(addr: int) -> None:
    """Release a register_host / pin_host of addr; the range is unlocked when its last user goes."""
    with _registration_lock:
        held = _handed_out.get(addr)
        if not held:
            call("cuMemHostUnregister", addr)          # not registered here: the driver says why
            return
        reg = held.pop()
        if not held:
            del _handed_out[addr]
        reg.users -= 1
        if reg.users:
            return
        _registrations.remove(reg)
        call("cuMemHostUnregister", reg.start)
