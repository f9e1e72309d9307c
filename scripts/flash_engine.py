"""What the device scripts share: the flash preset engine, device-resident, the corpus's tokens,
and the kernel knobs the A/B scripts set.

    from flash_engine import open_flash          (scripts run as `python3 scripts/NAME.py`)
    engine, ids = open_flash("/tmp/flash.gguf", n_ctx)
    configs = knob_configs(["_F16_TILED=0", "_MMA_ST_MAGIC_C=0,_MMA_ST_CPASYNC=0"])
"""
import os


def open_flash(model_path: str, n_ctx: int, corpus_chars: int = 40_000):
    """Build the flash per-role file at model_path if it is missing, load it with the detector's
    choice (device-resident on the H200) and tokenize the first corpus_chars characters of
    .data/promessi_sposi.txt. Returns (engine, token ids)."""
    from ds4py import synth
    from ds4py.engine import open_engine
    from ds4py.io.spec import open_model
    from ds4py.options import WeightOptions
    from ds4py.tokenizer import Tokenizer

    if not os.path.exists(model_path):
        synth.build_model(model_path, "flash", "per-role", 0)
    model = open_model(model_path)
    engine = open_engine(model, WeightOptions(n_ctx=n_ctx), progress=False).engine
    tok = Tokenizer.from_gguf(model.file)
    ids = tok.encode(open(".data/promessi_sposi.txt", encoding="utf-8").read()[:corpus_chars])
    return engine, ids


def _knob_owner(name: str):
    """(owner, attribute) of a knob: NAME of ds4py.kernels.cuda, ops.NAME of kernels.cuda_ops,
    engine.NAME of the CudaEngine class (read when a graph is captured), or sources.NAME of
    ds4py.io.sources (sources.SCALES_LAST: apply_source_knobs puts the arena in that layout)."""
    from ds4py.forward_cuda import CudaEngine
    from ds4py.io import sources
    from ds4py.kernels import cuda as CK, cuda_ops as ops
    if name.startswith("engine."):
        return CudaEngine, name[7:]
    if name.startswith("sources."):
        return sources, name[8:]
    return (ops, name[4:]) if name.startswith("ops.") else (CK, name)


def knob_configs(texts):
    """[{}, {name: value, ...}, ...]: the defaults, then one configuration per "NAME=INT,..." text
    (each value converted to the type of the knob's current value, but for a bool knob's values
    other than 0 and 1; unknown names exit)."""
    configs = [{}]
    for text in texts:
        config = {}
        for item in text.split(","):
            name, value = item.split("=")
            module, attr = _knob_owner(name)
            if not hasattr(module, attr):
                raise SystemExit(f"{module.__name__} has no {attr}")
            config[name] = type(getattr(module, attr))(int(value))
        configs.append(config)
    return configs


def knob_defaults(configs):
    """The current value of every knob the configurations set."""
    return {name: getattr(*_knob_owner(name)) for config in configs for name in config}


def set_knobs(values, rebuild: bool = False) -> None:
    """Set the knobs. rebuild: also clear kernels/cuda.py's kernel caches, for knobs that a kernel
    builder reads but its cache key does not hold (the MoE decode shapes); every kernel is then
    compiled again at its next launch, so a timed region must not follow a rebuild directly."""
    from ds4py.kernels import cuda as CK
    for name, value in values.items():
        setattr(*_knob_owner(name), value)
    if rebuild:
        CK._KERNELS.clear()
        CK._ROWDOTS.clear()


def apply_source_knobs(engine) -> None:
    """What a source knob asks of the loaded source (sources.SCALES_LAST: the Q8_0 layout)."""
    from ds4py.io import sources
    engine.source.keep_scales_last(sources.SCALES_LAST)


def knob_label(config) -> str:
    return ",".join(f"{n}={v}" for n, v in config.items()) or "defaults"
