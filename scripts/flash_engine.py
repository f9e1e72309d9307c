"""What the device scripts share: the flash preset engine, device-resident, and the corpus's tokens.

    from flash_engine import open_flash          (scripts run as `python3 scripts/NAME.py`)
    engine, ids = open_flash("/tmp/flash.gguf", n_ctx)
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
