"""Synthetic sequence tasks, laid out as the papers that introduced them define them.

Each task is two steps: *sampling* the random choices (numpy ``Generator``, seeded) and a
deterministic *layout* function that turns one example's choices into tokens. The layouts are
public so tests can check them on hand-made choices.

Every generator returns a :class:`TokenTask`: ``inputs`` ``(B, N)`` int64 and ``targets``
``(B, N)`` int64, where ``targets[b, t]`` is the token the model must emit after reading
``inputs[b, :t+1]`` and :data:`IGNORE` (-100, as ``F.cross_entropy``'s ``ignore_index``) marks
positions that are not scored.

- :func:`mqar`: multi-query associative recall (Arora et al. 2023, *Zoology*, section 3 and the
  ``multiquery_ar`` generator): key-value pairs first, keys from the lower half of the vocabulary
  and values from the upper half; the keys reappear later as queries at gaps drawn from a power
  law, and the model must answer each with its value.
- :func:`selective_copying`: Gu & Dao 2023 (*Mamba*, section 3.1 and appendix E.1): data tokens
  scattered at random positions among noise tokens; after them, marker tokens ask for the data
  tokens in order.
- :func:`induction_heads`: Olsson et al. 2022, in the synthetic form of Fu et al. 2023 (*H3*,
  section 3.1): a trigger token followed by an answer token somewhere in random text; the trigger
  appears again at the end and the model must emit the answer.
- :func:`needle`: in-context associative recall as Zhong & Andreas 2024 (*Algorithmic
  capabilities of random transformers*, "needle in a haystack") set it up: ``P`` marker-value
  pairs, then one marker again; the model must emit its value (one scored position).
- :func:`repeated_tokens`: induction as Olsson et al. 2022 measure it: a random token sequence
  repeated once; on the repeat every next token follows from finding the current token's earlier
  occurrence and copying its successor (``M - 1`` scored positions per example instead of one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IGNORE", "TokenTask", "mqar", "mqar_layout", "selective_copying", "selective_copying_layout",
           "induction_heads", "induction_layout", "needle", "needle_layout", "repeated_tokens", "repeated_layout", "accuracy"]

IGNORE = -100


@dataclass(frozen=True)
class TokenTask:
    """A batch of token sequences. inputs, targets: ``(B, N)`` int64; vocab: token count."""

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab: int

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, idx) -> "TokenTask":
        return TokenTask(self.inputs[idx], self.targets[idx], self.vocab)


def _positive(name: str, value) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _stack(rows, vocab) -> TokenTask:
    inputs = torch.as_tensor(np.stack([r[0] for r in rows]), dtype=torch.int64)
    targets = torch.as_tensor(np.stack([r[1] for r in rows]), dtype=torch.int64)
    return TokenTask(inputs, targets, vocab)


# ------------------------------------------------------------------------------ MQAR


def mqar_layout(keys, values, gaps, seq_len: int, filler=None):
    """One MQAR example from its choices (Zoology's layout).

    keys, values: ``(P,)`` ints; gaps: ``(P,)`` distinct ints in ``[0, (seq_len - 2P) // 2)``:
    key ``i`` is queried at position ``2P + 2 * gaps[i]``. filler: ``(seq_len,)`` tokens for the
    positions that are neither pairs nor queries (Zoology's ``random_non_queries``), else 0.
    Returns ``(inputs, targets)``, each ``(seq_len,)`` int64.

    >>> mqar_layout([1, 2], [5, 6], [1, 0], seq_len=8)
    (array([1, 5, 2, 6, 2, 0, 1, 0]), array([-100, -100, -100, -100,    6, -100,    5, -100]))
    """
    keys, values, gaps = (np.asarray(a, dtype=np.int64) for a in (keys, values, gaps))
    ctx = 2 * len(keys)
    inputs = np.zeros(seq_len, dtype=np.int64)
    inputs[0:ctx:2], inputs[1:ctx:2] = keys, values
    query_at = ctx + 2 * gaps
    inputs[query_at] = keys
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    targets[query_at] = values  # after reading the query key, emit its value
    if filler is not None:
        free = np.ones(seq_len, dtype=bool)
        free[:ctx] = False
        free[query_at] = False
        inputs[free] = np.asarray(filler, dtype=np.int64)[free]
    return inputs, targets


def mqar(num_examples: int, seq_len: int, *, vocab: int = 256, num_kv_pairs: int = 8,
         power_a: float = 0.01, random_non_queries: bool = True, seed: int = 0) -> TokenTask:
    """Multi-query associative recall (Zoology's ``multiquery_ar``).

    Keys are ``num_kv_pairs`` distinct tokens from ``[1, vocab // 2)``, values distinct tokens from
    ``[vocab // 2, vocab)``; the pairs fill the first ``2 * num_kv_pairs`` positions. Each key is
    queried once, at ``2P + 2 g`` with gap ``g`` drawn without replacement from
    ``p(g) ∝ (g + 1) ** (power_a - 1)`` over ``[0, (seq_len - 2P) // 2)`` (small gaps likely).
    Targets: the value at each query position.

    >>> t = mqar(2, 32, vocab=64, num_kv_pairs=4)
    >>> t.inputs.shape, int((t.targets != IGNORE).sum())
    (torch.Size([2, 32]), 8)
    """
    for name, v in (("num_examples", num_examples), ("seq_len", seq_len), ("vocab", vocab),
                    ("num_kv_pairs", num_kv_pairs)):
        _positive(name, v)
    P = num_kv_pairs
    if vocab // 2 - 1 < P:
        raise ValueError(f"mqar: vocab={vocab} gives {vocab // 2 - 1} key tokens for num_kv_pairs={P}; "
                         f"raise vocab to at least {2 * P + 2}")
    space = (seq_len - 2 * P) // 2
    if space < P:
        raise ValueError(f"mqar: seq_len={seq_len} has room for {max(space, 0)} queries after the "
                         f"{P} pairs; use seq_len >= {4 * P}")
    if not power_a > 0:
        raise ValueError(f"mqar: power_a must be > 0, got {power_a}")
    rng = np.random.default_rng(seed)
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    p = p / p.sum()
    rows = []
    for _ in range(num_examples):
        keys = rng.choice(np.arange(1, vocab // 2), size=P, replace=False)
        values = rng.choice(np.arange(vocab // 2, vocab), size=P, replace=False)
        gaps = rng.choice(space, size=P, replace=False, p=p)
        filler = rng.integers(0, vocab, size=seq_len) if random_non_queries else None
        rows.append(mqar_layout(keys, values, gaps, seq_len, filler))
    return _stack(rows, vocab)


# ------------------------------------------------------------------ selective copying

NOISE, MARKER, FIRST_DATA = 0, 1, 2  # selective copying's token layout


def selective_copying_layout(tokens, positions, context: int):
    """One selective-copying example from its choices (Mamba's layout).

    tokens: ``(K,)`` data tokens (``>= 2``); positions: ``(K,)`` increasing positions in
    ``[0, context)`` where they sit among noise tokens (0). Then ``K`` marker tokens (1) follow;
    at marker ``i`` the target is ``tokens[i]``. Returns ``(inputs, targets)``, ``(context + K,)``.

    >>> selective_copying_layout([5, 7], [1, 3], context=4)
    (array([0, 5, 0, 7, 1, 1]), array([-100, -100, -100, -100,    5,    7]))
    """
    tokens, positions = np.asarray(tokens, dtype=np.int64), np.asarray(positions, dtype=np.int64)
    K = len(tokens)
    inputs = np.full(context + K, NOISE, dtype=np.int64)
    inputs[positions] = tokens
    inputs[context:] = MARKER
    targets = np.full(context + K, IGNORE, dtype=np.int64)
    targets[context:] = tokens  # reading marker i, emit data token i
    return inputs, targets


def selective_copying(num_examples: int, seq_len: int, *, num_tokens: int = 16, num_data: int = 16,
                      seed: int = 0) -> TokenTask:
    """Selective copying (Mamba, appendix E.1): ``num_tokens`` data tokens out of ``num_data``
    kinds (ids ``2 .. 2 + num_data - 1``) at random positions of a ``seq_len - num_tokens`` context
    of noise (0), then ``num_tokens`` markers (1); reading marker ``i`` the model must emit data
    token ``i`` (the data tokens in order).
    Vocabulary: ``num_data + 2``.
    """
    for name, v in (("num_examples", num_examples), ("seq_len", seq_len), ("num_tokens", num_tokens),
                    ("num_data", num_data)):
        _positive(name, v)
    context = seq_len - num_tokens
    if context < num_tokens:
        raise ValueError(f"selective_copying: seq_len={seq_len} leaves a context of {context} for "
                         f"{num_tokens} tokens; use seq_len >= {2 * num_tokens}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_examples):
        tokens = rng.integers(FIRST_DATA, FIRST_DATA + num_data, size=num_tokens)
        positions = np.sort(rng.choice(context, size=num_tokens, replace=False))
        rows.append(selective_copying_layout(tokens, positions, context))
    return _stack(rows, num_data + 2)


# ------------------------------------------------------------------- induction heads

TRIGGER = 0  # induction heads' special token


def induction_layout(background, trigger_at: int):
    """One induction-heads example from its choices (H3's layout).

    background: ``(N,)`` tokens ``>= 1`` (random text); the trigger token (0) is written at
    ``trigger_at`` (``<= N - 3``) and at the last position ``N - 1``; the answer is the token
    after the first trigger, scored at the last position. Returns ``(inputs, targets)``.

    >>> induction_layout([3, 4, 5, 6, 7, 8], trigger_at=1)
    (array([3, 0, 5, 6, 7, 0]), array([-100, -100, -100, -100, -100,    5]))
    """
    inputs = np.array(background, dtype=np.int64)
    N = len(inputs)
    inputs[trigger_at] = TRIGGER
    inputs[N - 1] = TRIGGER
    targets = np.full(N, IGNORE, dtype=np.int64)
    targets[N - 1] = inputs[trigger_at + 1]
    return inputs, targets


def induction_heads(num_examples: int, seq_len: int, *, vocab: int = 32, seed: int = 0) -> TokenTask:
    """Induction heads (H3, section 3.1): random tokens from ``[1, vocab)``, a trigger (0) at a
    uniform position in ``[0, seq_len - 3]``, the trigger again at the end; the target at the
    end is the token that followed the first trigger."""
    for name, v in (("num_examples", num_examples), ("seq_len", seq_len), ("vocab", vocab)):
        _positive(name, v)
    if seq_len < 4 or vocab < 3:
        raise ValueError(f"induction_heads needs seq_len >= 4 and vocab >= 3, got {seq_len}, {vocab}")
    rng = np.random.default_rng(seed)
    rows = [induction_layout(rng.integers(1, vocab, size=seq_len), int(rng.integers(0, seq_len - 2)))
            for _ in range(num_examples)]
    return _stack(rows, vocab)


def needle_layout(markers, values, query: int):
    """One needle-in-a-haystack example: ``m_1 v_1 m_2 v_2 ... m_P v_P m_query``; the target at
    the last position is ``v_query``. Returns ``(inputs, targets)``, ``(2P + 1,)`` each.

    >>> needle_layout([3, 4], [9, 8], query=1)
    (array([3, 9, 4, 8, 4]), array([-100, -100, -100, -100,    8]))
    """
    markers, values = np.asarray(markers, dtype=np.int64), np.asarray(values, dtype=np.int64)
    P = len(markers)
    inputs = np.empty(2 * P + 1, dtype=np.int64)
    inputs[0:2 * P:2], inputs[1:2 * P:2], inputs[-1] = markers, values, markers[query]
    targets = np.full(2 * P + 1, IGNORE, dtype=np.int64)
    targets[-1] = values[query]
    return inputs, targets


def needle(num_examples: int, num_pairs: int, *, vocab: int = 64, seed: int = 0) -> TokenTask:
    """Needle in a haystack (Zhong & Andreas 2024): ``num_pairs`` distinct markers from
    ``[0, vocab // 2)`` each followed by a value from ``[vocab // 2, vocab)`` (values may repeat),
    then one of the markers, uniformly; target: its value. Sequence length ``2 * num_pairs + 1``."""
    for name, v in (("num_examples", num_examples), ("num_pairs", num_pairs), ("vocab", vocab)):
        _positive(name, v)
    if vocab // 2 < num_pairs:
        raise ValueError(f"needle: vocab={vocab} gives {vocab // 2} markers for num_pairs={num_pairs}; "
                         f"raise vocab to at least {2 * num_pairs}")
    rng = np.random.default_rng(seed)
    rows = [needle_layout(rng.choice(vocab // 2, size=num_pairs, replace=False),
                          rng.integers(vocab // 2, vocab, size=num_pairs), int(rng.integers(num_pairs)))
            for _ in range(num_examples)]
    return _stack(rows, vocab)


def repeated_layout(tokens):
    """One repeated-tokens example: ``tokens`` ``(M,)`` then ``tokens`` again, ``(2M,)``.

    Scored: repeat positions ``M .. 2M - 2``, each asking for the next token of the repeat (the
    successor of the current token's first occurrence). The first copy, and the jump to the
    repeat at ``M - 1``, are not predictable and not scored.

    >>> repeated_layout([4, 2, 7])
    (array([4, 2, 7, 4, 2, 7]), array([-100, -100, -100,    2,    7, -100]))
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    M = len(tokens)
    inputs = np.concatenate([tokens, tokens])
    targets = np.full(2 * M, IGNORE, dtype=np.int64)
    targets[M:2 * M - 1] = tokens[1:]
    return inputs, targets


def repeated_tokens(num_examples: int, seq_len: int, *, vocab: int = 64, vary: bool = False,
                    seed: int = 0) -> TokenTask:
    """Induction on repeated random tokens (Olsson et al. 2022): ``seq_len // 2`` distinct tokens
    drawn from ``[0, vocab)`` (distinct, as with a language model's large vocabulary, so every
    lookup is unambiguous), then the same tokens again; ``seq_len`` must be even and
    ``vocab >= seq_len // 2``.

    ``vary=True``: each example repeats ``M`` tokens, ``M`` uniform in ``[seq_len // 4,
    seq_len // 2]``, after ``seq_len - 2M`` unscored random tokens, all ``seq_len - M`` distinct
    (``vocab >= seq_len - seq_len // 4``). With one fixed ``M`` the answer always sits ``M - 1``
    positions back, so a model can solve the task by that fixed offset instead of by looking the
    token up, and fails at any other length for that reason alone; varying ``M`` rules the
    shortcut out (the bench trains and tests induction this way).
    """
    for name, v in (("num_examples", num_examples), ("seq_len", seq_len), ("vocab", vocab)):
        _positive(name, v)
    M = seq_len // 2
    if seq_len % 2 or M < 2:
        raise ValueError(f"repeated_tokens: seq_len must be even and >= 4, got {seq_len}")
    need = seq_len - max(2, seq_len // 4) if vary else M
    if vocab < need:
        raise ValueError(f"repeated_tokens: vocab={vocab} cannot give {need} distinct tokens; use vocab >= {need}")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_examples):
        m = int(rng.integers(max(2, seq_len // 4), M + 1)) if vary else M
        toks = rng.choice(vocab, size=seq_len - m, replace=False)
        x, y = repeated_layout(toks[seq_len - 2 * m:])
        prefix = toks[:seq_len - 2 * m]
        rows.append((np.concatenate([prefix, x]), np.concatenate([np.full(len(prefix), IGNORE), y])))
    return _stack(rows, vocab)


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of scored positions (targets != IGNORE) where ``argmax(logits)`` is the target.

    logits ``(B, N, V)``; targets ``(B, N)``.
    """
    scored = targets != IGNORE
    if not bool(scored.any()):
        raise ValueError("accuracy: no scored position (all targets are IGNORE)")
    return float((logits.argmax(-1)[scored] == targets[scored]).float().mean())
