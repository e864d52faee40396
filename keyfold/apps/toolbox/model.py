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

from .mixers import CHECK_MAX_LEN, MixerKind, MixerSpec, check_mixer, make_mixer, mixer_name, state_nbytes

__all__ = ["Block", "SequenceModel"]


class Block(nn.Module):
    """``x + mixer(norm1(x))``, then ``x + ffn(norm2(x))``; ``(B, N, dim) -> (B, N, dim)``.

    mixer: any :class:`~keyfold.apps.toolbox.mixers.MixerProtocol` module; dim: its width
    (read from ``mixer.dim`` when not given)."""

    def __init__(self, mixer: nn.Module, dim: int | None = None):
        super().__init__()
        dim = mixer.dim if dim is None else dim
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
    """``depth`` blocks of one mixer between an input map and a linear readout.

    mixer: a :class:`MixerKind` or its name (``"attention"``, ``"gru"``, ...), or your own mixer
        class / factory ``f(width, **mixer_kw)`` returning an ``nn.Module`` that implements
        :class:`~keyfold.apps.toolbox.mixers.MixerProtocol`; such a mixer is held to the
        streaming-equals-full-sequence and causality checks (:func:`check_mixer`) when the model
        is built (``check=False`` skips that).
    vocab: token inputs ``(B, N)`` int64 ids in ``[0, vocab)`` through an embedding; else
        ``d_in`` real features ``(B, N, d_in)`` through a linear map.
    d_out: outputs per position; ``forward`` returns ``(B, N, d_out)`` in the parameters' dtype.
    seq_len: longest sequence expected (the TCN sizes its receptive field to it).
    mixer_kw: passed to the mixer (``heads``, ``window``, ``state``, ...).

    Bad input raises naming the argument: an empty batch or sequence, ids outside
    ``[0, vocab)``, a float tensor where ids go (or ids where features go), a dtype other than
    the parameters', a ``step`` whose batch differs from its state's.

    >>> m = SequenceModel("lstm", d_in=3, d_out=2, width=16, depth=1)
    >>> m(torch.randn(4, 10, 3)).shape
    torch.Size([4, 10, 2])
    """

    def __init__(self, mixer: MixerSpec, *, d_out: int, d_in: int | None = None,
                 vocab: int | None = None, width: int = 64, depth: int = 2,
                 seq_len: int | None = None, check: bool = True, **mixer_kw):
        super().__init__()
        if (d_in is None) == (vocab is None):
            raise ValueError("SequenceModel: give exactly one of d_in (real features) or vocab (token ids)")
        for name, v in (("depth", depth), ("width", width), ("d_out", d_out), ("d_in", d_in), ("vocab", vocab)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"SequenceModel: {name} must be a positive int, got {v!r}")
        self.name = mixer_name(mixer)  # raises for what is neither a name nor a factory
        builtin = isinstance(mixer, (MixerKind, str))
        self.kind = MixerKind.parse(mixer) if builtin else None
        self.vocab, self.d_in, self.d_out, self.width = vocab, d_in, d_out, width
        self.embed = nn.Embedding(vocab, width) if vocab is not None else nn.Linear(d_in, width)
        mixers = [make_mixer(mixer, width, seq_len=seq_len, **mixer_kw) for _ in range(depth)]
        if not builtin and check:
            # a float64 copy, at the model's length (a mixer reading a steps ahead passes below a + 1);
            # the built-ins are held to this by the tests
            check_mixer(mixers[0], width, **({"seq_len": min(seq_len, CHECK_MAX_LEN)} if seq_len else {}))
        self.blocks = nn.ModuleList(Block(m, width) for m in mixers)
        self.norm = nn.LayerNorm(width)
        self.readout = nn.Linear(width, d_out)

    def _embed(self, x, ndim):
        """Check ``x`` and map it to ``(B, [N,] width)``; ``ndim`` 3 for forward, 2 for step."""
        name = "x" if ndim == 3 else "x_t"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"SequenceModel: {name} must be a torch.Tensor, got {type(x).__name__}")
        if self.vocab is not None:
            want = "(B, N)" if ndim == 3 else "(B,)"
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"SequenceModel: {name} must hold int64 token ids shaped {want} (this model has "
                                f"vocab={self.vocab}), got dtype {x.dtype}")
            if x.dim() != ndim - 1:
                raise ValueError(f"SequenceModel: {name} must be token ids shaped {want}, got {tuple(x.shape)}")
        else:
            want = "(B, N, d_in)" if ndim == 3 else "(B, d_in)"
            if x.dim() != ndim or x.shape[-1] != self.d_in:
                raise ValueError(f"SequenceModel: {name} must be real inputs shaped {want} with "
                                 f"d_in={self.d_in}, got {tuple(x.shape)}")
            dtype = self.readout.weight.dtype
            if x.dtype != dtype:
                raise TypeError(f"SequenceModel: {name} has dtype {x.dtype} but the model's parameters are {dtype}; "
                                f"cast it ({name}.to({dtype})) or the model (model.to({x.dtype}))")
        if x.shape[0] == 0:
            raise ValueError(f"SequenceModel: {name} has an empty batch (shape {tuple(x.shape)})")
        if ndim == 3 and x.shape[1] == 0:
            raise ValueError(f"SequenceModel: {name} is an empty sequence (N=0, shape {tuple(x.shape)}); "
                             f"pass at least one position")
        if self.vocab is not None:
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= self.vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"SequenceModel: {name} holds token id {bad}, outside [0, vocab={self.vocab}); "
                                 f"build the model with a larger vocab or remap the ids")
        return self.embed(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._embed(x, 3)  # (B, N, width)
        for blk in self.blocks:
            h = blk(h)
        return self.readout(self.norm(h))  # (B, N, d_out)

    def init_state(self, batch: int) -> dict:
        """Streaming state for ``batch`` sequences: ``{"batch": batch, "blocks": [one mixer state
        per block]}``."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"SequenceModel.init_state: batch must be a positive int, got {batch!r}")
        return {"batch": batch, "blocks": [blk.mixer.init_state(batch) for blk in self.blocks]}

    def step(self, x_t: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One position: ``x_t`` ``(B,)`` ids or ``(B, d_in)`` -> ``((B, d_out), new state)``."""
        if not isinstance(state, dict) or "blocks" not in state or len(state["blocks"]) != len(self.blocks):
            raise TypeError("SequenceModel.step: state must be what init_state(batch) (or the previous step) "
                            "returned for this model")
        h = self._embed(x_t, 2)  # (B, width)
        if h.shape[0] != state["batch"]:
            raise ValueError(f"SequenceModel.step: x_t has batch {h.shape[0]} but state was made by "
                             f"init_state({state['batch']}); start a state per batch size")
        new = []
        for blk, st in zip(self.blocks, state["blocks"]):
            h, st = blk.step(h, st)
            new.append(st)
        return self.readout(self.norm(h)), {"batch": state["batch"], "blocks": new}

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
