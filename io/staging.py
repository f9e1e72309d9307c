"""The staging ring: file ranges -> pinned buffers (reader threads) -> device arena (one stream).

    chunk i:  [readers: pread pieces into slot i % n]  ->  [main: async upload, record event i % n]

With n slots, n - 1 chunks are being read while one uploads. Before chunk j reuses a slot, the main
thread waits on that slot's event, which belongs to the upload issued one iteration earlier (so it
has normally finished already). A chunk is split into pieces read by several threads: one buffered
pread from the page cache runs at ~6 GB/s, several together approach memory bandwidth; O_DIRECT
reads of a cold file run at the disk's rate whatever the thread count.

The uploader is an interface so CI runs the same loop into a numpy array:
    upload(slot, data: np.ndarray, dest: int)   queue a copy of `data` to arena offset `dest`
    wait(slot)                                  block until slot's last upload has completed
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ds4py.io.diskio import DIRECT_ALIGN, FileReader, align_down, align_up
from ds4py.io.layout import ArenaPlan


@dataclass(frozen=True)
class Chunk:
    file_offset: int
    nbytes: int
    dest: int                    # arena offset


def plan_chunks(plan: ArenaPlan, chunk_bytes: int) -> list[Chunk]:
    """Split every interval into chunks of at most chunk_bytes whose interior edges are aligned."""
    out = []
    for iv in plan.intervals:
        pos = iv.file_start
        while pos < iv.file_end:
            end = min(align_down(pos + chunk_bytes, DIRECT_ALIGN), iv.file_end)
            if end <= pos:
                end = min(pos + chunk_bytes, iv.file_end)
            out.append(Chunk(pos, end - pos, iv.arena_start + pos - iv.file_start))
            pos = end
    return out


def slot_bytes_for(chunk_bytes: int) -> int:
    """Staging buffer size that holds any chunk plus O_DIRECT's rounding at both ends."""
    return align_up(chunk_bytes, DIRECT_ALIGN) + 2 * DIRECT_ALIGN


def _pieces(chunk: Chunk, n_pieces: int) -> list[tuple[int, int]]:
    """(file offset, nbytes) pieces of a chunk; interior edges 4096-aligned so O_DIRECT reads of
    neighbouring pieces never overlap inside the staging buffer."""
    size = max(align_up(math.ceil(chunk.nbytes / max(n_pieces, 1)), DIRECT_ALIGN), DIRECT_ALIGN)
    out, pos, end = [], chunk.file_offset, chunk.file_offset + chunk.nbytes
    while pos < end:
        stop = min(align_down(pos, DIRECT_ALIGN) + size, end)
        if stop <= pos:
            stop = end
        out.append((pos, stop - pos))
        pos = stop
    return out


class NumpyUploader:
    """The CPU twin of the device uploader: copies synchronously into a numpy arena."""

    def __init__(self, arena: np.ndarray):
        self.arena = arena
        self.uploads = 0

    def upload(self, slot: int, data: np.ndarray, dest: int) -> None:
        self.arena[dest:dest + data.nbytes] = data
        self.uploads += 1

    def wait(self, slot: int) -> None:
        pass


def pump(reader: FileReader, chunks: list[Chunk], buffers: list[np.ndarray], uploader, pool: ThreadPoolExecutor,
         threads: int, progress=None, after_chunk=None) -> int:
    """Move every chunk from the file into the arena through the ring of `buffers`. Returns bytes moved.

    progress(nbytes) is called as each chunk is handed to the uploader; after_chunk(chunk) after
    its read completed (e.g. to drop its file pages)."""
    n_slots = len(buffers)
    ahead = max(1, n_slots - 1)
    pieces_per_chunk = max(1, math.ceil(threads / ahead))
    inflight: dict[int, list] = {}

    def schedule(i: int) -> None:
        c, buf = chunks[i], buffers[i % n_slots]
        base = align_down(c.file_offset, DIRECT_ALIGN)
        if c.nbytes + (c.file_offset - base) + DIRECT_ALIGN > buf.nbytes:
            raise ValueError("chunk larger than its staging buffer")
        inflight[i] = [pool.submit(reader.read_at, buf, base, off, n) for off, n in _pieces(c, pieces_per_chunk)]

    moved = 0
    try:
        for i in range(min(ahead, len(chunks))):
            schedule(i)
        for i, c in enumerate(chunks):
            for f in inflight.pop(i):
                f.result()
            buf = buffers[i % n_slots]
            skip = c.file_offset - align_down(c.file_offset, DIRECT_ALIGN)
            uploader.upload(i % n_slots, buf[skip:skip + c.nbytes], c.dest)
            moved += c.nbytes
            if after_chunk:
                after_chunk(c)
            if progress:
                progress(c.nbytes)
            j = i + ahead
            if j < len(chunks):
                uploader.wait(j % n_slots)
                schedule(j)
    finally:
        for futures in inflight.values():      # an error: let running reads finish before buffers go
            for f in futures:
                f.cancel()
            for f in futures:
                try:
                    f.result()
                except Exception:
                    pass
        for slot in range(n_slots):
            uploader.wait(slot)
    return moved
