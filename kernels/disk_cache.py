"""numba-cuda's disk cache for every ds4py CUDA kernel, keyed by the kernels' sources too.

numba-cuda keys a cached kernel by its signature, the target, its bytecode, a pickle of its
closure's cells, and guards the entries of one file with that file's mtime and size. Two things
are missing for ds4py's kernels:

* the device functions a kernel calls through module globals (the intrinsics of cuda_intrinsics,
  helpers of another file): none of the above changes when one of them does, so every kernel
  calling it would load stale code. The key here also holds a digest of all kernels/*.py sources.
* the jit options: `max_registers` and `launch_bounds` are not in numba's key, so two builds of
  one kernel with two caps (kbench sweeps them) would load each other's code. The key here holds
  them.

The closure pickle is why kernels/cuda_intrinsics.py imports `numba.core.types`, not `numba.types`
(a redirect module that pickles by value in some import orders: keys then depended on what a
process had imported first). DS4PY_CACHE_KEY_LOG=1 prints each key's parts (hashed) on stderr.

A GPU `ds4py run` compiled ~41 s of kernels in every process without the cache, 3.2 s of loading
with it (H200, tiny model). Entries of an older digest stay on disk until the file defining the
kernel changes (numba then rewrites its index); `find kernels -name "*.nb[ic]" -delete` clears them.
"""

from __future__ import annotations

import hashlib
import os
import sys

from numba import cuda

from .cuda_intrinsics import SIMULATOR
from .digest import SOURCES_DIGEST


_KEY_LOG = bool(os.environ.get("DS4PY_CACHE_KEY_LOG"))    # diagnostics: each key's parts

if not SIMULATOR:
    from numba.cuda.dispatcher import CUDACache

    class KernelCache(CUDACache):
        """numba-cuda's cache with the kernels' source digest and the jit options in the key."""

        def __init__(self, py_func, options: dict):
            self.options = tuple(sorted(options.items()))
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            key = super()._index_key(sig, codegen) + (
                ("ds4py kernels", SOURCES_DIGEST), ("options", repr(self.options)))
            if _KEY_LOG:
                parts = " ".join(hashlib.sha256(repr(p).encode()).hexdigest()[:8] for p in key)
                print(f"[cache-key] {self._py_func.__qualname__} {parts}", file=sys.stderr, flush=True)
            return key


def cached_jit(max_registers: int = 0, **options):
    """A kernel decorator: cuda.jit(max_registers= when > 0, **options) through the cache above.
    The simulator compiles nothing: there it is plain cuda.jit."""
    if SIMULATOR:
        return cuda.jit(**options) if options else cuda.jit
    if max_registers:
        options = dict(options, max_registers=max_registers)

    def jit(fn):
        dispatcher = cuda.jit(**options)(fn) if options else cuda.jit(fn)
        dispatcher._cache = KernelCache(dispatcher.py_func, options)
        return dispatcher

    return jit
