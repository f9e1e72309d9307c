"""A digest of the kernels' sources: the kernel caches' entries and the compile manifests are
valid for one version of kernels/*.py (disk_cache.py keys the CUDA kernels by it, precompile.py
marks a model shape compiled for it). Imports nothing heavy: a CPU-only run reads it too."""

import hashlib
from pathlib import Path


def sources_digest(folder: Path) -> str:
    """sha256 over the names and bytes of folder's *.py files, in name order."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


SOURCES_DIGEST = sources_digest(Path(__file__).resolve().parent)
