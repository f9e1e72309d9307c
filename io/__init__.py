"""GGUF mapping, model spec, the three weight sources and the regime detector (installed as ds4py.io)."""
