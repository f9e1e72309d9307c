"""Weight sources: where the engine's weight bytes come from, with counters.

The engine asks a source for tensors by name and never learns where the bytes live. Every source
counts what it moves, so `--stats` and the tests can prove e.g. that a device-resident first request
uploads 0 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ds4py.io.spec import Model


@dataclass
class Counters:
    disk_read_bytes: int = 0          # bytes read from the file by us (pread / O_DIRECT)
    h2d_load_bytes: int = 0           # host->device bytes uploaded while loading
    h2d_request_bytes: int = 0        # host->device bytes uploaded while serving requests
    expert_hits: int = 0
    expert_misses: int = 0
    expert_evictions: int = 0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class HostSource:
    """The CPU path: tensors are zero-copy views of the file mapping, read in place."""

    regime = "cpu"

    def __init__(self, model: Model):
        self.model = model
        self.counters = Counters()

    def host(self, name: str) -> np.ndarray:
        """The tensor as GGUFFile.rows() lays it out (typed for F32/F16/I32, uint8 rows otherwise)."""
        return self.model.file.rows(name)

    def has(self, name: str) -> bool:
        return name in self.model.file.tensors

    def close(self) -> None:
        pass
