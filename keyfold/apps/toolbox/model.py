"""One residual block and one model around every mixer, so only the mixer differs.

``Block``: pre-norm residual, ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` (width ``dim``,
FFN ``2 * dim``). :class:`SequenceModel` stacks ``depth`` blocks between an input map (token
embedding or a linear map of real features) and a linear readout, with a streaming ``step``.

A next-state predictor for control (``keyfold.apps.control``) is a ``SequenceModel`` whose input is
the concatenated ``(state, input)`` of each past step and whose output is the next state::

    model = SequenceModel("gru", d_in=n_x + n_u, d_out=n_x, width=32, depth=2)
    x_next = model(window)[:, -1]            # window: (B, W, n_x + n_u) -> (B, n_x)
    st = model.init_state(B)                 # or streaming, one step at a time:
    x_next, st = model.step(xu_t, st)        # xu_t: (B, n_x + n_u) -> (B, n_x)
"""

from __future__ import annotations

import torch
from torch import nn

from .mixers import Mixer, MixerKind, make_mixer, state_nbytes

__all__ = ["Block", "SequenceModel"]


class Block(nn.Module):
    """``x + mixer(norm1(x))``, then ``x + ffn(norm2(x))``; ``(B, N, dim) -> (B, N, dim)``."""

    def __init__(self, mixer: Mixer):
        super().__init__()
        dim = mixer.dim
        self.norm1, self.mixer = nn.LayerNorm(dim), mixer
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))

    def step(self, x_t, state):
        y, state = self.mixer.step(self.norm1(x_t), state)
        x_t = x_t + y
        return x_t + self.ffn(self.norm2(x_t)), state


class SequenceModel(nn.Module):
    """``depth`` blocks of one mixer kind between an input map and a linear readout.

    mixer: a :class:`MixerKind` or its name (``"attention"``, ``"gru"``, ...).
    vocab: token inputs ``(B, N)`` int64 through an embedding; else ``d_in`` real features
        ``(B, N, d_in)`` through a linear map.
    d_out: outputs per position; ``forward`` returns ``(B, N, d_out)`` float32.
    seq_len: longest sequence expected (the TCN sizes its receptive field to it).
    mixer_kw: passed to the mixer (``heads``, ``window``, ``state``, ...).

    >>> m = SequenceModel("lstm", d_in=3, d_out=2, width=16, depth=1)
    >>> m(torch.randn(4, 10, 3)).shape
    torch.Size([4, 10, 2])
    """

    def __init__(self, mixer: MixerKind | str, *, d_out: int, d_in: int | None = None,
                 vocab: int | None = None, width: int = 64, depth: int = 2,
                 seq_len: int | None = None, **mixer_kw):
        super().__init__()
        if (d_in is None) == (vocab is None):
            raise ValueError("SequenceModel: give exactly one of d_in (real features) or vocab (token ids)")
        if depth < 1 or width < 1 or d_out < 1:
            raise ValueError(f"SequenceModel: depth, width and d_out must be >= 1, got {depth}, {width}, {d_out}")
        self.kind = MixerKind.parse(mixer)
        self.vocab, self.d_in, self.d_out, self.width = vocab, d_in, d_out, width
        self.embed = nn.Embedding(vocab, width) if vocab is not None else nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            Block(make_mixer(self.kind, width, seq_len=seq_len, **mixer_kw)) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.readout = nn.Linear(width, d_out)

    def _embed(self, x, ndim):
        if self.vocab is not None:
            if x.dim() != ndim - 1 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"token model expects int64 ids shaped {'(B, N)' if ndim == 3 else '(B,)'}, "
                                 f"got {x.dtype} {tuple(x.shape)}")
        elif x.dim() != ndim or x.shape[-1] != self.d_in:
            raise ValueError(f"model expects real inputs shaped {'(B, N, d_in)' if ndim == 3 else '(B, d_in)'} "
                             f"with d_in={self.d_in}, got {tuple(x.shape)}")
        return self.embed(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._embed(x, 3)  # (B, N, width)
        for blk in self.blocks:
            h = blk(h)
        return self.readout(self.norm(h))  # (B, N, d_out)

    def init_state(self, batch: int) -> list:
        """Streaming state: one mixer state per block."""
        return [blk.mixer.init_state(batch) for blk in self.blocks]

    def step(self, x_t: torch.Tensor, state: list) -> tuple[torch.Tensor, list]:
        """One position: ``x_t`` ``(B,)`` ids or ``(B, d_in)`` -> ``((B, d_out), new state)``."""
        h = self._embed(x_t, 2)  # (B, width)
        new = []
        for blk, st in zip(self.blocks, state):
            h, st = blk.step(h, st)
            new.append(st)
        return self.readout(self.norm(h)), new

    def freeze_body(self) -> "SequenceModel":
        """Freeze every block at its current (random) weights: only the input map and the
        readout stay trainable (the random-initialisation probe)."""
        for p in self.blocks.parameters():
            p.requires_grad_(False)
        for p in self.norm.parameters():
            p.requires_grad_(False)
        return self

    def n_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @staticmethod
    def state_nbytes(state) -> int:
        """Bytes a streaming state keeps per batch (divide by B for one sequence)."""
        return state_nbytes(state)
