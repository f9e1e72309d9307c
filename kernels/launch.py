"""Kernel launches without numba-cuda's per-call argument marshalling.

numba-cuda prepares every argument of every launch in Python: measured on the H200
(scripts/prefill_host_profile.py), 31 us for a kernel of one array argument, 58 us for 4 and
125 us for 12. A 512-token prefill chunk is ~1,850 eager launches, and the host took as long to
enqueue them (340-620 ms, varying with the garbage collector) as the GPU took to run them: prefill
was host-bound. Slicing a device array costs about as much again (numba recomputes its extent).

`install()` replaces `kernel[grid, block, stream, shmem]` on every numba CUDA dispatcher with a
memo: keyed by the dispatcher, the launch configuration and the identity of each argument (the
value of each scalar), it remembers the compiled kernel and its marshalled arguments after the
first launch through numba, and relaunches through cuda.core directly. Each entry holds weak
references to the objects whose ids are in its key (the dispatcher too: kernel caches get
cleared) and is dropped when one of them dies, before its id can be reused: nothing is kept
alive, no stale pointer or kernel is launched. Host arrays (numba copies them to the device on
every call), objects that are not numba device arrays, launch-config-sensitive and debug kernels
always take numba's own path. `view(array, key, make)` memoizes the views the hot paths pass, so
that their launches hit the memo too.
"""

import weakref

import numpy as np

_MAX_ENTRIES = 1 << 15       # a prefill chunk of the flash model makes ~1,900 distinct launches
_SCALARS = (int, float, bool, np.generic)
_SLOW = object()             # a key numba's path must always take
_launches: dict = {}
_views: dict = {}
_installed = False
_original: dict = {}
stats = {"hits": 0, "misses": 0, "slow": 0}


def _by_value(c) -> bool:
    """Whether a launch-configuration item goes into a key by value (grid and block dimensions,
    shared bytes, stream 0) rather than by identity (a stream object, weakly held by the entry)."""
    return c is None or isinstance(c, (int, tuple))


def _forget(memo, key):
    """A weakref callback: drop memo[key] (its object died)."""
    return lambda _ref: memo.pop(key, None)


def view(array, key, make):
    """make(array), computed once per (array, key) while array lives."""
    k = (id(array), key)
    hit = _views.get(k)
    if hit is None:
        if len(_views) >= _MAX_ENTRIES:
            _views.clear()
        try:
            ref = weakref.ref(array, _forget(_views, k))
        except TypeError:              # not weak-referenceable: no memo
            return make(array)
        hit = _views[k] = (ref, make(array))
    return hit[1]


def clear() -> None:
    _launches.clear()
    _views.clear()


class _Entry:
    __slots__ = ("refs", "stream", "config", "kernel", "kernelargs")


class _FastConfigured:
    """What `dispatcher[grid, block, ...]` returns once install() has run."""
    __slots__ = ("dispatcher", "config")

    def __init__(self, dispatcher, config):
        self.dispatcher = dispatcher
        self.config = config

    def __call__(self, *args):
        key = [id(self.dispatcher)]
        for c in self.config:
            key.append(c if _by_value(c) else id(c))
        for a in args:
            if isinstance(a, _SCALARS):
                key.append((type(a), a))
            elif isinstance(a, _DeviceNDArray):
                key.append(id(a))
            else:
                stats["slow"] += 1
                return self.dispatcher.configure(*self.config)(*args)
        key = tuple(key)
        entry = _launches.get(key)
        if entry is None:
            stats["misses"] += 1
            configured = self.dispatcher.configure(*self.config)
            configured(*args)                         # numba's own path: compiles, launches
            if len(_launches) >= _MAX_ENTRIES:
                _launches.clear()
            _launches[key] = _entry(key, self.dispatcher, self.config, configured, args)
            return None
        if entry is _SLOW:
            stats["slow"] += 1
            return self.dispatcher.configure(*self.config)(*args)
        stats["hits"] += 1
        _core_launch(entry.stream, entry.config, entry.kernel, *entry.kernelargs)
        return None


def _entry(key, dispatcher, config, configured, args):
    """The compiled kernel and marshalled arguments of a launch numba just made, or _SLOW where a
    relaunch could differ from numba's (auto-transferred arrays, debug or config-sensitive kernels,
    an overload numba reached by converting an argument, objects without weak references) or where
    numba-cuda's internals are not the ones this reads (another version)."""
    try:
        return _make_entry(key, dispatcher, config, configured, args)
    except (AttributeError, TypeError, KeyError):
        return _SLOW


def _make_entry(key, dispatcher, config, configured, args):
    if getattr(dispatcher, "_launch_config_sensitive", True) or configured.pre_launch_callbacks:
        return _SLOW
    if dispatcher.specialized:
        kernel = next(iter(dispatcher.overloads.values()))
    else:
        kernel = dispatcher.overloads.get(tuple(dispatcher.typeof_pyval(a) for a in args))
    if kernel is None or kernel.debug or getattr(kernel, "launch_config_sensitive", False):
        return _SLOW
    retr, kernelargs = [], []
    for ty, value in zip(kernel.argument_types, args):
        kernel._prepare_args(ty, value, configured.stream, retr, kernelargs)
    if retr:
        return _SLOW
    held = [dispatcher] + [a for a in args if isinstance(a, _DeviceNDArray)]   # (kernel caches are cleared)
    held += [c for c in config if not _by_value(c)]
    entry = _Entry()
    entry.refs = [weakref.ref(obj, _forget(_launches, key)) for obj in held]   # TypeError: _SLOW
    entry.stream = configured.stream
    entry.config = _launch_config(configured, kernel)
    entry.kernel = kernel._codelibrary.get_cufunc().kernel
    entry.kernelargs = kernelargs
    return entry


def _launch_config(configured, kernel):
    if _CORE_GE_1_0:
        return _LaunchConfig(grid=configured.griddim, block=configured.blockdim,
                             shmem_size=configured.sharedmem, is_cooperative=kernel.cooperative)
    return _LaunchConfig(grid=configured.griddim, block=configured.blockdim,
                         shmem_size=configured.sharedmem, cooperative_launch=kernel.cooperative)


def install() -> bool:
    """Patch numba-cuda's dispatcher (once). False, and numba's path unchanged, under the CUDA
    simulator or where numba-cuda's internals are not the ones this was written against."""
    global _installed, _core_launch, _LaunchConfig, _CORE_GE_1_0, _DeviceNDArray
    if _installed:
        return True
    from numba import cuda
    if getattr(cuda.config, "ENABLE_CUDASIM", False):
        return False
    try:
        from cuda.core import LaunchConfig, launch
        from numba.cuda import dispatcher as disp
        from numba.cuda._compat import CUDA_CORE_GE_1_0
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        assert hasattr(disp.CUDADispatcher, "configure") and hasattr(disp._Kernel, "_prepare_args")
    except (ImportError, AttributeError, AssertionError):
        return False
    _core_launch, _LaunchConfig, _CORE_GE_1_0, _DeviceNDArray = launch, LaunchConfig, CUDA_CORE_GE_1_0, DeviceNDArray

    def getitem(self, config):
        if len(config) not in (2, 3, 4):
            raise ValueError("must specify at least the griddim and blockdim")
        return _FastConfigured(self, config)

    _original["getitem"] = disp.CUDADispatcher.__getitem__
    disp.CUDADispatcher.__getitem__ = getitem
    _installed = True
    return True


def uninstall() -> None:
    """numba's own launch path again (for A/B timing in one process)."""
    global _installed
    if _installed:
        from numba.cuda import dispatcher as disp
        disp.CUDADispatcher.__getitem__ = _original.pop("getitem")
        clear()
        _installed = False
