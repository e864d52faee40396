"""``keyfold.stream``: a causal model run one token at a time with constant memory and work.

The implementation lives in :mod:`keyfold.verify.stream` beside the certifier, because a stream's
layers are the same :class:`keyfold.verify.certify.BlockWeights` the certifier bounds; this module
gives it the short name. Docs: ``docs/verify.md`` section 3.

>>> import torch
>>> from keyfold.stream import Stream, default_model
>>> s = Stream(default_model(E=16, heads=2, F_=32, n_layers=1), window=8, sinks=2)
>>> s.step(torch.randn(1, 16)).shape
torch.Size([1, 16])
"""

from .verify.stream import LatencyReport, Stream, default_model, full_forward, measure_latency, stream

__all__ = ["Stream", "stream", "full_forward", "measure_latency", "LatencyReport", "default_model"]
