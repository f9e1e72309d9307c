import numpy as np
from numba import cuda
from ds4py.kernels import bench as B, cuda as CK, formats as F
rng = np.random.default_rng(0)
for rows, K, n in ((2048, 4096, 2048),):
    arena = B.Arena(rows * F.row_bytes(F.Q8_0, K) + 4096, seed=3)
    off = arena.place(F.Q8_0, rows, K)
    act = B._Act(F.Q8_0, n, K, rng)
    out = cuda.device_array((n, rows), np.float32)
    for staged in (False, True):
        for _ in range(2):
            CK.matmul_q8_0_mma(arena.buf, off, rows, K, n, act.xq, act.xd, out, staged=staged)
        cuda.synchronize()
