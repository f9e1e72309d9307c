"""File I/O policy for weight sources: aligned O_DIRECT reads, page-cache residency and dropping.

Everything here is plain Linux + numpy (no CUDA), so CI tests it directly.

- `FileReader`: positional reads of a file range into a caller-owned, page-aligned buffer, through
  an O_DIRECT descriptor when the filesystem accepts one (aligned offsets, lengths and buffers),
  else through the ordinary buffered descriptor. A refused O_DIRECT open or read (EINVAL,
  EOPNOTSUPP, ...) switches the reader to buffered reads for good and says so once.
- `resident_bytes` / `residency`: how much of a mapping is in the page cache, via mincore(2).
- `drop_pages`: give pages back: madvise(MADV_DONTNEED) on the mapping, then
  posix_fadvise(POSIX_FADV_DONTNEED) on the file. glibc's posix_madvise(POSIX_MADV_DONTNEED) is a
  no-op, so it is never used.
- `populate`: fault a range into the page cache now (MADV_POPULATE_READ, Linux >= 5.14), with a
  page-touching fallback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from dataclasses import dataclass

import numpy as np

PAGE = mmap.PAGESIZE
DIRECT_ALIGN = 4096              # O_DIRECT alignment: logical block size; 4096 is safe on every disk
DROP_GRANULE = 2 << 20           # the page cache holds large folios (up to 2 MiB): drop whole ones
MADV_POPULATE_READ = 22          # linux/mman.h; Python 3.12's mmap module does not export it

# errnos with which a filesystem refuses O_DIRECT (ext4: EINVAL for misalignment, tmpfs: EINVAL at
# open; others ENOTSUP/EOPNOTSUPP; EFAULT for a buffer the kernel cannot pin)
_DIRECT_REFUSALS = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EFAULT}


def align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def aligned_empty(nbytes: int) -> np.ndarray:
    """A page-aligned, writable uint8 buffer from an anonymous mapping (O_DIRECT-ready)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def buffer_address(buf) -> int:
    """Address of the first byte of a numpy array or a (read-only) mmap."""
    if isinstance(buf, np.ndarray):
        return buf.ctypes.data
    view = np.frombuffer(buf, dtype=np.uint8)
    try:
        return view.ctypes.data
    finally:
        del view                 # release the export so the mmap can still be closed


@dataclass
class ReadStats:
    direct_bytes: int = 0        # bytes transferred through the O_DIRECT descriptor (aligned lengths)
    buffered_bytes: int = 0      # bytes transferred through the buffered descriptor


class FileReader:
    """pread of byte ranges into aligned buffers, O_DIRECT when allowed, buffered otherwise.

    `read_into(buf, offset, nbytes)` returns the view of `buf` holding exactly the requested bytes.
    For O_DIRECT the read starts at `offset` rounded down to DIRECT_ALIGN, so `buf` must be
    page-aligned and at least `span_bytes(offset, nbytes)` long; the data then starts at
    `offset % DIRECT_ALIGN` inside `buf`. Thread-safe: pread has no shared file position.
    """

    def __init__(self, path: str, direct: bool = True, log=None):
        self.path = path
        self.log = log or _stderr_line
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()     # reads come from several threads
        self.direct_fd = None
        self.use_direct = False
        self.fallback_reason = None   # why O_DIRECT is not used (None while it is, or never asked)
        if direct:
            self._open_direct()

    # ---- O_DIRECT management -------------------------------------------------------------------

    def _open_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            self._give_up_direct("this platform has no O_DIRECT")
            return
        try:
            self.direct_fd = os.open(self.path, os.O_RDONLY | flag)
            self.use_direct = True
        except OSError as e:
            if e.errno in _DIRECT_REFUSALS:
                self._give_up_direct(f"the filesystem refused O_DIRECT at open ({errno.errorcode.get(e.errno, e.errno)})")
            else:
                raise

    def _give_up_direct(self, reason: str) -> None:
        # several reader threads may hit the refusal at once: say it once; the descriptor stays
        # open until close() so a thread still inside a read on it never sees it vanish
        with self._stats_lock:
            self.use_direct = False
            first = self.fallback_reason is None
            if first:
                self.fallback_reason = reason
        if first:
            self.log(f"ds4py: {self.path}: {reason}; reading with buffered I/O instead")

    @property
    def direct(self) -> bool:
        return self.use_direct

    # ---- reads ------------------------------------------------------------------------------------

    @staticmethod
    def span_bytes(offset: int, nbytes: int) -> int:
        """Buffer bytes an O_DIRECT read of [offset, offset + nbytes) needs."""
        return align_up(offset + nbytes, DIRECT_ALIGN) - align_down(offset, DIRECT_ALIGN)

    def read_into(self, buf: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
        """Read [offset, offset + nbytes) into the page-aligned `buf`; return the view holding it."""
        base = align_down(offset, DIRECT_ALIGN)
        self.read_at(buf, base, offset, nbytes)
        return buf[offset - base:offset - base + nbytes]

    def read_at(self, buf: np.ndarray, base: int, offset: int, nbytes: int) -> None:
        """Read [offset, offset + nbytes) so that file byte x lands at buf[x - base].

        `base` is DIRECT_ALIGN-aligned and <= offset. With O_DIRECT the read is widened to aligned
        edges, so buf[align_down(offset) - base : align_up(offset + nbytes) - base] is written."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size or base > offset or base % DIRECT_ALIGN:
            raise ValueError(f"read [{offset}, {offset + nbytes}) base {base} invalid for {self.path} ({self.size} bytes)")
        if nbytes == 0:
            return
        if self.use_direct:
            try:
                self._read_direct(buf, base, offset, nbytes)
                return
            except OSError as e:
                if e.errno not in _DIRECT_REFUSALS:
                    raise
                self._give_up_direct(f"the filesystem refused an O_DIRECT read ({errno.errorcode.get(e.errno, e.errno)})")
        self._pread_fully(self.fd, buf[offset - base:offset - base + nbytes], offset, nbytes)
        with self._stats_lock:
            self.stats.buffered_bytes += nbytes

    def _read_direct(self, buf: np.ndarray, base: int, offset: int, nbytes: int) -> None:
        start = align_down(offset, DIRECT_ALIGN)
        length = align_up(offset + nbytes, DIRECT_ALIGN) - start
        dest = buf[start - base:start - base + length]
        if dest.nbytes < length or buffer_address(dest) % DIRECT_ALIGN:
            raise ValueError("O_DIRECT needs a page-aligned buffer with room for the aligned span")
        # the tail past EOF comes back short; only the requested bytes must arrive
        self._pread_fully(self.direct_fd, dest, start, offset + nbytes - start)
        with self._stats_lock:
            self.stats.direct_bytes += length

    def _pread_fully(self, fd: int, dest: np.ndarray, offset: int, need: int) -> None:
        done = 0
        view = memoryview(dest).cast("B")
        while done < need:
            n = self._pread(fd, view[done:], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"{self.path}: unexpected end of file at byte {offset + done}")
            done += n

    @staticmethod
    def _pread(fd: int, view: memoryview, offset: int) -> int:
        # one seam for tests (simulate EINVAL); os.preadv releases the GIL, so threads overlap
        return os.preadv(fd, [view], offset)

    # ---- page cache -----------------------------------------------------------------------------------

    def drop(self, offset: int, nbytes: int, mm=None, granule: int = DROP_GRANULE) -> None:
        drop_pages(self.fd, offset, nbytes, mm, granule)

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def direct_io_support(path: str) -> tuple[bool, str]:
    """(True, "") if an aligned O_DIRECT read of `path` works, else (False, why)."""
    with FileReader(path, direct=True, log=lambda _m: None) as r:
        if r.direct and r.size:
            buf = aligned_empty(DIRECT_ALIGN)
            r.read_into(buf, 0, min(r.size, DIRECT_ALIGN))
        return r.direct, r.fallback_reason or ""


def filesystem_of(path: str) -> str:
    """Filesystem type of the mount holding `path` (from /proc/mounts), or "unknown"."""
    try:
        real = os.path.realpath(path)
        best, fstype = "", "unknown"
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mount = parts[1].replace("\\040", " ")
                    inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                    if inside and len(mount) >= len(best):
                        best, fstype = mount, parts[2]
        return fstype
    except OSError:
        return "unknown"


# ---- page-cache residency and control -------------------------------------------------------------

_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        _libc.mincore.restype = ctypes.c_int
    return _libc.mincore


def resident_pages(mm, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
    """One bool per page of mapping `mm` over [offset, offset + nbytes): is it in the page cache?"""
    size = len(mm)
    nbytes = size - offset if nbytes is None else nbytes
    start = align_down(offset, PAGE)
    length = align_up(offset + nbytes, PAGE) - start
    if length <= 0:
        return np.zeros(0, dtype=bool)
    vec = np.zeros(length // PAGE, dtype=np.uint8)
    if _mincore()(buffer_address(mm) + start, length, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return (vec & 1).astype(bool)


def resident_bytes(mm, offset: int = 0, nbytes: int | None = None) -> int:
    pages = resident_pages(mm, offset, nbytes)
    return min(int(pages.sum()) * PAGE, len(mm) - offset if nbytes is None else nbytes)


def residency(mm, offset: int = 0, nbytes: int | None = None) -> float:
    """Share (0..1) of the range that is in the page cache."""
    pages = resident_pages(mm, offset, nbytes)
    return float(pages.mean()) if pages.size else 1.0


def drop_pages(fd: int | None, offset: int, nbytes: int, mm=None, granule: int = PAGE) -> None:
    """Ask the kernel to forget a file range: unmap it from `mm` (if given), then drop clean pages.

    The range is widened to `granule`: fadvise only drops folios wholly inside the range and not
    mapped anywhere, and the page cache keeps files in folios of up to 2 MiB, so a 16 KiB drop
    inside a 64 KiB folio does nothing. Pages mapped by another process, dirty pages and
    page-locked (registered) pages stay."""
    if nbytes <= 0:
        return
    start = align_down(offset, granule)
    length = align_up(offset + nbytes, granule) - start
    if mm is not None:
        length_in_map = min(length, len(mm) - start)
        if length_in_map > 0:
            mm.madvise(mmap.MADV_DONTNEED, start, length_in_map)
    if fd is not None:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)


def populate(mm, offset: int = 0, nbytes: int | None = None, step: int = 256 << 20, progress=None) -> None:
    """Fault [offset, offset + nbytes) of `mm` into the page cache now, `step` bytes at a time.

    MADV_POPULATE_READ reads synchronously (WILLNEED is only a hint, far too lazy for a warm-up);
    kernels before 5.14 refuse it with EINVAL, and then one byte per page is touched instead."""
    nbytes = len(mm) - offset if nbytes is None else nbytes
    pos, end = align_down(offset, PAGE), offset + nbytes
    use_madvise = True
    while pos < end:
        n = min(step, end - pos)
        if use_madvise:
            try:
                mm.madvise(MADV_POPULATE_READ, pos, n)
            except OSError:
                use_madvise = False
        if not use_madvise:
            view = np.frombuffer(mm, dtype=np.uint8, count=n, offset=pos)
            int(view[::PAGE].sum())
            del view
        if progress:
            progress(n)
        pos += n
