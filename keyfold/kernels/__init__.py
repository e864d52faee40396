"""Piece kernels: each computes one partial State for (query rows, key span, tile mask).

- ``reference``: plain torch ops on the whole (Nq, Nk) score matrix, any dtype; the oracle.
- ``tiles``: the same math tile by tile in torch ops; runs any score modifier, on any device.
- ``cpu``: PyTorch's fused CPU flash kernel per piece, with block skipping.
- ``triton``: the project's own Triton kernel (GPU, or the CPU interpreter).
"""

import enum

__all__ = ["Backend"]


class Backend(enum.Enum):
    AUTO = "auto"            # CPU tensors: CPU; CUDA tensors: TRITON when importable
    REFERENCE = "reference"  # plain torch, materialises the scores; the test oracle
    CPU = "cpu"              # fused aten CPU kernel per piece; additive scores only, no dropout (else it raises)
    TILES = "tiles"          # tile-by-tile torch ops, any device
    TRITON = "triton"        # the project's Triton kernel
