"""GGUF tensor types used by DeepSeek-V4-Flash files: ids, block geometry and the IQ2_XXS tables.

Block layouts (all little endian, ggml's):
  Q8_0     32 weights,  34 B: f16 d, int8 qs[32]                          w = d*q
  Q2_K    256 weights,  84 B: u8 scales[16], u8 qs[64], f16 d, f16 dmin   w = d*sc*q - dmin*m
  Q4_K    256 weights, 144 B: f16 d, f16 dmin, u8 scales[12], u8 qs[128]  w = d*sc*q - dmin*m
  IQ2_XXS 256 weights,  66 B: f16 d, u16 qs[32]                           w = d*(2s+1)/8 * +-grid
"""

import numpy as np

F32 = 0
F16 = 1
Q8_0 = 8
Q2_K = 10
Q4_K = 12
IQ2_XXS = 16
I32 = 26

TYPE_NAMES = {F32: "F32", F16: "F16", Q8_0: "Q8_0", Q2_K: "Q2_K", Q4_K: "Q4_K",
              IQ2_XXS: "IQ2_XXS", I32: "I32"}

# ggml_type -> (weights per block, bytes per block)
BLOCK_GEOMETRY = {
    F32: (1, 4),
    F16: (1, 2),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q4_K: (256, 144),
    IQ2_XXS: (256, 66),
    I32: (1, 4),
}

QK8_0 = 32   # Q8_0 block (weights and activations)
QK_K = 256   # super-block of the K-quants, IQ2_XXS and the Q8_K activation


def block_size(ggml_type: int) -> int:
    return BLOCK_GEOMETRY[ggml_type][0]


def block_bytes(ggml_type: int) -> int:
    return BLOCK_GEOMETRY[ggml_type][1]


def row_bytes(ggml_type: int, n: int) -> int:
    """Bytes of one row of n weights (n must be a whole number of blocks)."""
    weights, nbytes = BLOCK_GEOMETRY[ggml_type]
    if n % weights:
        raise ValueError(f"{TYPE_NAMES.get(ggml_type, ggml_type)} row of {n} is not a whole number "
                         f"of {weights}-weight blocks")
    return n // weights * nbytes


def activation_kind(ggml_type: int) -> str:
    """How ds4 prepares the activation for a weight type: 'q8_0', 'q8_k' or 'f32' (none)."""
    if ggml_type == Q8_0:
        return "q8_0"
    if ggml_type in (IQ2_XXS, Q2_K, Q4_K):
        return "q8_k"
    if ggml_type in (F16, F32):
        return "f32"
    raise ValueError(f"no matmul for ggml type {ggml_type}")


# --- the scales-last row layout ------------------------------------------------------------
#
# A Q8_0 row in the file is nb blocks of [f16 scale][32 quants]: 34-byte blocks, so a GPU lane
# reads its quants as 2-byte pieces. In VRAM the GPU sources may rewrite a row in place as
# [32 nb quants][nb f16 scales] (the same bytes, the same row size): a lane's 8 quant bytes are
# then one aligned 8-byte load (the decode matvec: 2 loads per step instead of 5; H200 kbench:
# the 35 MB projections 58-61 -> 62-68 % of the copy bandwidth). The kernels take the layout per
# launch (`scales_last=`); the CPU engine and host-mapped weights keep the file's layout.

SCALES_LAST_ALIGN = 16       # the prefill kernel stages rows with 16-byte copies


def scales_last_ok(ggml_type: int, K: int, offset: int) -> bool:
    """Whether a tensor of rows of K values at a (VRAM) byte offset may be kept scales-last: Q8_0,
    whole steps of 8 blocks (every kernel's step) and rows on 16-byte boundaries."""
    return ggml_type == Q8_0 and K % 256 == 0 and offset % SCALES_LAST_ALIGN == 0


def to_scales_last(rows: np.ndarray) -> np.ndarray:
    """Q8_0 rows (uint8[n_rows, row_bytes], the file's layout) in the scales-last layout."""
    n_rows, nbytes = rows.shape
    blocks = rows.reshape(n_rows, nbytes // BLOCK_GEOMETRY[Q8_0][1], BLOCK_GEOMETRY[Q8_0][1])
    return np.concatenate([blocks[:, :, 2:].reshape(n_rows, -1), blocks[:, :, :2].reshape(n_rows, -1)], axis=1)


def from_scales_last(rows: np.ndarray) -> np.ndarray:
    """to_scales_last undone: scales-last Q8_0 rows back in the file's layout."""
    n_rows, nbytes = rows.shape
    nb = nbytes // BLOCK_GEOMETRY[Q8_0][1]
    quants = rows[:, :32 * nb].reshape(n_rows, nb, 32)
    scales = rows[:, 32 * nb:].reshape(n_rows, nb, 2)
    return np.concatenate([scales, quants], axis=2).reshape(n_rows, -1)


# --- IQ2_XXS tables -------------------------------------------------------------------------

GRID_LEVELS = (0x08, 0x19, 0x2B)   # the three magnitudes a grid byte can take


def _ksigns() -> np.ndarray:
    """ksigns[i] = i with bit 7 set when popcount(i) is odd (an even number of minus signs)."""
    i = np.arange(128, dtype=np.uint8)
    parity = np.unpackbits(i[:, None], axis=1).sum(axis=1) & 1
    return (i | (parity.astype(np.uint8) << 7)).astype(np.uint8)


def _iq2xxs_grid() -> np.ndarray:
    """The 256-entry grid as uint64 (8 magnitude bytes each, byte j = weight j of the group).

    gguf-py stores the grid compactly: 256 entries as hex text, each entry 16 bits = eight 2-bit
    codes (lowest bits first) into GRID_LEVELS, the 16-bit value written little endian. We decode
    that data here with our own code; tests compare the result with gguf-py's own expansion.
    """
    from gguf.quants import IQ2_XXS as _gguf_iq2xxs

    packed = bytes.fromhex(_gguf_iq2xxs.grid_hex.decode("ascii"))
    codes16 = np.frombuffer(packed, dtype="<u2").astype(np.uint32)
    assert codes16.shape == (256,)
    shifts = np.arange(0, 16, 2, dtype=np.uint32)
    codes = (codes16[:, None] >> shifts[None, :]) & 3                   # (256, 8)
    magnitudes = np.asarray(GRID_LEVELS, dtype=np.uint8)[codes]          # (256, 8) bytes
    return np.ascontiguousarray(magnitudes).view("<u8").reshape(256).astype(np.uint64)


KSIGNS_IQ2XS = _ksigns()                         # uint8[128]
IQ2XXS_GRID = _iq2xxs_grid()                     # uint64[256]
IQ2XXS_GRID_BYTES = IQ2XXS_GRID.view(np.uint8).reshape(256, 8)   # uint8[256, 8]
# The grid as pairs of uint32 (low 4 bytes, high 4 bytes), the form the CUDA kernels load.
IQ2XXS_GRID_U32 = IQ2XXS_GRID.view(np.uint32).reshape(256, 2).copy()


def _nibble_masks() -> np.ndarray:
    """mask[n] has byte j = 0xFF where bit j of the nibble n is set (4 signs -> 4 byte masks)."""
    n = np.arange(16, dtype=np.uint32)
    out = np.zeros(16, dtype=np.uint32)
    for j in range(4):
        out |= ((n >> j) & 1) * np.uint32(0xFF << (8 * j))
    return out


NIBBLE_BYTE_MASKS = _nibble_masks()              # uint32[16]
