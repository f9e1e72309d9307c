"""GGUF v3 files: read one through a single read-only mmap, write one as a stream.

The reader parses the header, the metadata and the tensor infos, and nothing else: tensor data is
never copied at open. Each tensor is a name, a GGML type, a shape (`ne`, innermost first, as GGUF
stores it), an absolute file offset and a byte size, plus a zero-copy numpy view into the mapping.

Offsets are checked against the file bounds only: tensors may share, overlap or reorder their data
(aliasing, ds4-model.md §12.2), so a tensor's size is always computed from its type and shape, never
from the gap to the next offset.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ds4py.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR_FORMATS = {
    UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
    FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    UINT8: np.uint8, INT8: np.int8, UINT16: np.uint16, INT16: np.int16, UINT32: np.uint32,
    INT32: np.int32, FLOAT32: np.float32, BOOL: np.bool_, UINT64: np.uint64, INT64: np.int64,
    FLOAT64: np.float64,
}
VALUE_TYPE_NAMES = {
    UINT8: "u8", INT8: "i8", UINT16: "u16", INT16: "i16", UINT32: "u32", INT32: "i32",
    FLOAT32: "f32", BOOL: "bool", STRING: "str", ARRAY: "array", UINT64: "u64", INT64: "i64",
    FLOAT64: "f64",
}

# GGML tensor types: id -> (name, elements per block, bytes per block). The types ds4 uses come
# first; the rest let `inspect` describe foreign files instead of failing on them.
GGML_F32, GGML_F16, GGML_Q8_0, GGML_Q2_K, GGML_Q4_K, GGML_IQ2_XXS, GGML_I32 = 0, 1, 8, 10, 12, 16, 26
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
}
GGML_TYPE_IDS = {name: type_id for type_id, (name, _, _) in GGML_TYPES.items()}

_U64_MAX = (1 << 64) - 1


def ggml_type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type{ggml_type}"


def tensor_nbytes(ggml_type: int, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor: ceil(n_elements / block) * block_bytes, in Python integers (no overflow).

    Raises ValueError for an unknown type or a row that is not a whole number of blocks."""
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"unknown GGML type {ggml_type}")
    _, block_elems, block_bytes = GGML_TYPES[ggml_type]
    if ne and ne[0] % block_elems:
        raise ValueError(f"row length {ne[0]} is not a multiple of the {ggml_type_name(ggml_type)} block ({block_elems})")
    n_elements = 1
    for n in ne:
        n_elements *= int(n)
    return -(-n_elements // block_elems) * block_bytes


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    ne: tuple[int, ...]          # GGUF dimension list, innermost (contiguous) first
    offset: int                  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes of one innermost row (one output row of a matrix)."""
        return tensor_nbytes(self.ggml_type, self.ne[:1])

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.offset + self.nbytes


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(
                f"{self.path}: truncated GGUF header (needs byte {self.pos + n:,}, file has "
                f"{len(self.buf):,}); re-download or rebuild the file")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")


def _read_value(cur: _Cursor, value_type: int):
    if value_type in _SCALAR_FORMATS:
        return cur.scalar(_SCALAR_FORMATS[value_type])
    if value_type == STRING:
        return cur.string()
    if value_type == ARRAY:
        item_type = cur.scalar("<I")
        count = cur.scalar("<Q")
        min_item = 8 if item_type in (STRING, ARRAY) else np.dtype(_ARRAY_DTYPES.get(item_type, np.uint8)).itemsize
        if count * min_item > len(cur.buf) - cur.pos:
            raise ModelFileError(f"{cur.path}: metadata array of {count:,} items runs past the end of the file; the file is truncated or corrupt")
        if item_type in _ARRAY_DTYPES:
            dtype = np.dtype(_ARRAY_DTYPES[item_type]).newbyteorder("<")
            return item_type, np.frombuffer(cur.take(count * dtype.itemsize), dtype=dtype).copy()
        if item_type == STRING:
            return item_type, [cur.string() for _ in range(count)]
        if item_type == ARRAY:
            return item_type, [_read_value(cur, ARRAY) for _ in range(count)]
        raise ModelFileError(f"{cur.path}: unknown GGUF array item type {item_type}; the file is corrupt")
    raise ModelFileError(f"{cur.path}: unknown GGUF metadata type {value_type}; the file is corrupt")


class GGUFFile:
    """A GGUF file opened read-only through one mmap.

    `metadata[key]` is the Python value (arrays as numpy arrays or lists of str), `value_types[key]`
    the GGUF type (and `array_types[key]` the item type of an array). `tensors[name]` is a TensorInfo.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise ModelFileError(f"{self.path}: is a directory; pass the path of a .gguf file")
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open model file ({e.strerror}); check the path and permissions") from None
        self.file_size = os.fstat(self._fd).st_size
        if self.file_size < 24:
            os.close(self._fd)
            raise ModelFileError(f"{self.path}: not a GGUF file ({self.file_size} bytes); pass a .gguf model")
        self.mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except ModelFileError:
            self.close()
            raise

    def _parse(self) -> None:
        cur = _Cursor(self.mm, self.path)
        magic = bytes(cur.take(4))
        if magic != GGUF_MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (magic {magic!r}); pass a .gguf model")
        self.version = cur.scalar("<I")
        if self.version != GGUF_VERSION:
            raise ModelFileError(
                f"{self.path}: GGUF version {self.version} is not supported (ds4 reads v3 only); "
                f"convert the file with a current gguf tool")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelFileError(f"{self.path}: implausible GGUF header ({n_tensors} tensors, {n_kv} keys); the file is corrupt")
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, int] = {}
        self.array_types: dict[str, int] = {}
        for _ in range(n_kv):
            key = cur.string()
            value_type = cur.scalar("<I")
            value = _read_value(cur, value_type)
            if value_type == ARRAY:
                self.array_types[key], value = value
            self.metadata[key], self.value_types[key] = value, value_type
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= 8:
                raise ModelFileError(f"{self.path}: tensor {name!r} has {n_dims} dimensions; the file is corrupt")
            ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise ModelFileError(f"{self.path}: general.alignment = {alignment!r} is invalid")
        self.alignment = alignment
        self.data_offset = align_up(cur.pos, alignment)
        self.tensors: dict[str, TensorInfo] = {}
        self.unknown_types: dict[str, int] = {}
        for name, ne, ggml_type, rel_offset in infos:
            if name in self.tensors:
                raise ModelFileError(f"{self.path}: tensor {name!r} appears twice; the file is corrupt")
            try:
                nbytes = tensor_nbytes(ggml_type, ne)
            except ValueError as e:
                if ggml_type not in GGML_TYPES:
                    self.unknown_types[name] = ggml_type
                    continue
                raise ModelFileError(f"{self.path}: tensor {name!r}: {e}") from None
            offset = self.data_offset + rel_offset
            if offset > _U64_MAX or offset + nbytes > self.file_size:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} ends at byte {offset + nbytes:,} but the file has "
                    f"{self.file_size:,}; the file is truncated (re-download or rebuild it)")
            self.tensors[name] = TensorInfo(name, ggml_type, ne, offset, nbytes)

    # ---- data access --------------------------------------------------------------------------

    def bytes_view(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes."""
        info = self.tensors[name]
        return np.frombuffer(self.mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def rows(self, name: str) -> np.ndarray:
        """Zero-copy view shaped the way the engine indexes it.

        F32/F16/I32 tensors come out typed with numpy's row-major shape (ne reversed); quantized
        tensors come out as uint8 with one row of blocks per output row: (…, rows, row_bytes)."""
        info = self.tensors[name]
        raw = self.bytes_view(name)
        plain = {GGML_F32: np.float32, GGML_F16: np.float16, GGML_I32: np.int32}
        if info.ggml_type in plain:
            return raw.view(plain[info.ggml_type]).reshape(info.ne[::-1])
        return raw.reshape(tuple(info.ne[:0:-1]) + (info.row_bytes,))

    def close(self) -> None:
        if getattr(self, "mm", None) is not None:
            try:
                self.mm.close()
            except BufferError:
                pass  # numpy views still alive: the mapping goes when they do
            self.mm = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- writing ------------------------------------------------------------------------------------

def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(value_type: int, value, item_type: int | None = None) -> bytes:
    if value_type in _SCALAR_FORMATS:
        return struct.pack(_SCALAR_FORMATS[value_type], value)
    if value_type == STRING:
        return _pack_string(value)
    if value_type == ARRAY:
        head = struct.pack("<IQ", item_type, len(value))
        if item_type == STRING:
            return head + b"".join(_pack_string(s) for s in value)
        dtype = np.dtype(_ARRAY_DTYPES[item_type]).newbyteorder("<")
        return head + np.asarray(value, dtype=dtype).tobytes()
    raise ValueError(f"cannot write GGUF value type {value_type}")


@dataclass
class PlannedTensor:
    """One tensor info to write. Several tensors may name the same blob (aliasing)."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]
    blob: str


def write_gguf(path: str, metadata: list[tuple[str, int, object, int | None]],
               tensors: list[PlannedTensor], blob_sizes: dict[str, int], write_blob, progress=None) -> int:
    """Stream a GGUF v3 file to `path`.

    `metadata` is a list of (key, value_type, value, array_item_type). Each distinct blob is written
    once, in first-use order; `write_blob(blob_name, file)` must write exactly blob_sizes[blob]
    bytes (it can produce them chunk by chunk, so memory stays bounded whatever the file size).
    `progress(n_bytes)` is called after each blob. Returns the file size."""
    alignment = DEFAULT_ALIGNMENT
    for key, value_type, value, _ in metadata:
        if key == "general.alignment":
            alignment = value
    blob_offsets: dict[str, int] = {}
    cursor = 0
    for t in tensors:
        if t.blob not in blob_offsets:
            blob_offsets[t.blob] = cursor
            cursor = align_up(cursor + blob_sizes[t.blob], alignment)
    header = bytearray(struct.pack("<4sIQQ", GGUF_MAGIC, GGUF_VERSION, len(tensors), len(metadata)))
    for key, value_type, value, item_type in metadata:
        header += _pack_string(key) + struct.pack("<I", value_type) + _pack_value(value_type, value, item_type)
    for t in tensors:
        header += _pack_string(t.name) + struct.pack("<I", len(t.ne))
        header += struct.pack(f"<{len(t.ne)}Q", *t.ne)
        header += struct.pack("<IQ", t.ggml_type, blob_offsets[t.blob])
    header += b"\0" * (align_up(len(header), alignment) - len(header))
    tmp_path = path + ".part"
    with open(tmp_path, "wb") as f:
        f.write(header)
        for blob, rel_offset in sorted(blob_offsets.items(), key=lambda kv: kv[1]):
            assert f.tell() == len(header) + rel_offset
            start = f.tell()
            write_blob(blob, f)
            written = f.tell() - start
            if written != blob_sizes[blob]:
                raise RuntimeError(f"blob {blob} wrote {written} bytes, expected {blob_sizes[blob]}")
            f.write(b"\0" * (align_up(written, alignment) - written))
            if progress:
                progress(written)
        size = f.tell()
    os.replace(tmp_path, path)
    return size
