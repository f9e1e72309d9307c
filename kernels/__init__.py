"""Numba CUDA kernels and their Numba CPU twins (installed as ds4py.kernels).

Quantized matmul kernels (issue 5):
  formats          GGML type ids, block geometry, row_bytes, IQ2_XXS grid / sign tables
  compat           the numpy>=2.5 shim for numba-cuda, cuda_available()
  cpu              Numba CPU kernels with ds4's numerics (quantizers, matvec, matmul, moe)
  cuda             Numba CUDA kernels, same numerics, graph-ready (arena + byte offset weights)
  cuda_intrinsics  dp4a and the other inline-PTX helpers (the only numba-extension code)
  bench            run_kernel_bench(): the GPU benchmark behind scripts/bench_kernels.py
  testdata         random valid GGUF blocks and float64 references (tests, benchmark)

Importing this package imports nothing heavy; `ds4py.kernels.cuda` needs numba-cuda.
"""
