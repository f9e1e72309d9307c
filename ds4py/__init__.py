"""ds4py: a Numba inference engine for DeepSeek-V4-Flash GGUF files."""

__version__ = "0.1.0"
