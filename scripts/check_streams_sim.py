"""Find launches on different streams of the decode step that touch the same buffer with no
fork/join ordering them (a missing join), without a GPU.

Runs one decode step of the tiny model in Numba's CUDA simulator (quantized matvecs on the host,
as scripts/check_engine_sim.py) with stand-in side streams and events that keep vector clocks: an
event records its stream's clock, a wait merges it into the waiting stream's. Every launch logs
its stream, its clock and the byte ranges of its array arguments (views resolved to their base
buffers; the weights are left out: nobody writes them). Two launches on different streams whose
ranges overlap and whose clocks do not order them are printed with the buffers they share; the
simulator cannot tell reads from writes, so a pair that only reads (two kernels reading x) is
harmless: the kernels' docstrings say which argument is written.

    NUMBA_ENABLE_CUDASIM=1 python scripts/check_streams_sim.py [--pf]
"""

import inspect
import sys
import tempfile
from collections import defaultdict

import numpy as np

import check_engine_sim as sim               # sets the simulator's block sizes, host matvecs
from ds4py import synth
from ds4py.io.spec import open_model

fc, ops = sim.fc, sim.ops


class Clocks:
    def __init__(self):
        self.vc = defaultdict(dict)           # stream label -> {label: count}

    def tick(self, label):
        self.vc[label][label] = self.vc[label].get(label, 0) + 1
        return dict(self.vc[label])

    def merge(self, label, other):
        mine = self.vc[label]
        for k, v in other.items():
            mine[k] = max(mine.get(k, 0), v)


CLOCKS = Clocks()
LAUNCHES = []                                  # (label, clock, name, [(start, end, arg)])


class FakeStream:
    def __init__(self, label):
        self.label = label

    def synchronize(self):
        pass


class FakeEvent:
    def __init__(self):
        self.snapshot = {}

    def record(self, stream):
        self.snapshot = dict(CLOCKS.vc[label_of(stream)])

    def wait(self, stream):
        CLOCKS.merge(label_of(stream), self.snapshot)


def label_of(stream):
    return getattr(stream, "label", "main")


def ranges(args, skip):
    out = []
    for i, a in enumerate(args):
        ary = getattr(a, "_ary", None)
        if ary is None:
            continue
        base = ary
        while isinstance(base.base, np.ndarray):
            base = base.base
        if id(base) in skip:
            continue
        lo = ary.__array_interface__["data"][0]
        span = sum((n - 1) * abs(st) for n, st in zip(ary.shape, ary.strides)) + ary.itemsize if ary.size else 0
        out.append((lo, lo + span, i))
    return out


def log(name, stream, args, skip):
    label = label_of(stream)
    LAUNCHES.append((label, CLOCKS.tick(label), name, ranges(args, skip)))


def wrap_kernels(skip):
    for name in dir(ops):
        k = getattr(ops, name)
        if type(k).__name__ != "FakeCUDAKernel" or getattr(k, "_device", False):
            continue                           # device functions are called, not launched

        class Proxy:
            def __init__(self, kernel, kname):
                self.kernel, self.kname = kernel, kname

            def __getitem__(self, config):
                configured = self.kernel[config]
                stream = config[2] if isinstance(config, tuple) and len(config) > 2 else None

                def run(*args):
                    log(self.kname, stream, args, skip)
                    return configured(*args)
                return run

            def __getattr__(self, attr):
                return getattr(self.kernel, attr)
        setattr(ops, name, Proxy(k, name))


class HostQuant:
    """sim.HostQuantKernels with every call logged on the stream it was given."""

    def __init__(self, skip):
        self.skip = skip

    def __getattr__(self, name):
        f = getattr(sim.HostQuantKernels, name)
        if not callable(f) or isinstance(f, type):
            return f
        sig = inspect.signature(f)

        def run(*args, **kw):
            bound = sig.bind(*args, **kw)
            stream = bound.arguments.get("stream")
            log("qk." + name, stream, list(bound.arguments.values()), self.skip)
            return f(*args, **kw)
        return run if "stream" in sig.parameters else f


def main(with_pf):
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/tiny.gguf"
        synth.build_model(path, "tiny", "none", seed=7)
        model = open_model(path)
        fc.qk = sim.HostQuantKernels
        source = sim.FileArenaSource(model)
        engine = fc.CudaEngine(model, source, 64)
        names = ("side", "aux", "hc") + (("pf",) if with_pf else ())
        engine.side_streams = {n: FakeStream(n) for n in names}
        engine._events = {n: (FakeEvent(), FakeEvent()) for n in names}
        weights = [engine.arena, engine.w16, engine.w32, engine.i32]
        skip = set()
        for w in weights:
            base = w._ary
            while isinstance(base.base, np.ndarray):
                base = base.base
            skip.add(id(base))
        buffers = {}
        for bname, a in engine.scratch.tok.items():
            buffers[bname] = a
        for bname, (a, _) in engine.scratch.flat.items():
            buffers[bname] = a
        for il, layer in enumerate(engine.layers):
            for k in ("raw", "comp", "kv_state", "score_state", "icomp", "ikv_state", "iscore_state"):
                if getattr(layer, k) is not None:
                    buffers[f"L{il}.{k}"] = getattr(layer, k)

        def name_of(lo, hi):
            hits = []
            for bname, a in buffers.items():
                base = a._ary.__array_interface__["data"][0]
                if lo < base + a._ary.nbytes and base < hi:
                    hits.append(bname)
            return ",".join(hits) or f"0x{lo:x}"

        wrap_kernels(skip)
        fc.qk = HostQuant(skip)
        engine.decode(4321)
        print(f"{len(LAUNCHES)} launches on {sorted({l[0] for l in LAUNCHES})}")

        def before(a, b):
            return all(b.get(k, 0) >= v for k, v in a.items())

        found = 0
        for i, (la, ca, na, ra) in enumerate(LAUNCHES):
            for j in range(i + 1, len(LAUNCHES)):
                lb, cb, nb, rb = LAUNCHES[j]
                if la == lb or before(ca, cb) or before(cb, ca):
                    continue
                shared = {name_of(max(a0, b0), min(a1, b1)) for a0, a1, _ in ra for b0, b1, _ in rb
                          if a0 < b1 and b0 < a1}
                if shared:
                    found += 1
                    print(f"unordered: #{i} {na} [{la}]  <->  #{j} {nb} [{lb}]  share {sorted(shared)}")
        print(f"{found} unordered pairs sharing a buffer")


if __name__ == "__main__":
    main("--pf" in sys.argv)
