"""Faults in the communication wall, on real gloo groups of 2 ranks with short timeouts.

- a rank killed in the middle of a ring step: every other rank raises within the timeout;
- ranks whose masks differ only in a tensor's content (same repr): every rank raises and names it;
- ``check_shards=False`` with mismatched shards or one rank's invalid input: every rank raises
  :class:`ShardError` (gloo used to abort the whole process on the mismatched transfer).
"""

from __future__ import annotations

import functools
import os
import queue as queue_mod
import time

import pytest
import torch
import torch.multiprocessing as mp

import keyfold
from keyfold.distributed import ShardError, Strategy, ring_attention
from tests.distributed.test_distributed import _entry, _free_port, rank_context


def launch(worker, P, *args, pg_timeout=3, deadline=45):
    """Like test_distributed.launch, but a rank whose process died is reported as ("died", exitcode)
    as soon as every other rank has reported, instead of waiting out the deadline."""
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, P, port, pg_timeout, worker, args, results), daemon=True)
             for r in range(P)]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + deadline
    while len(got) < P and time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=0.2)
            got[rank] = (status, value)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead and all(r in got or r in dead for r in range(P)):
                time.sleep(0.3)                    # a result may still be in flight
                continue_reading = True
                while continue_reading:
                    try:
                        rank, status, value = results.get(timeout=0.2)
                        got[rank] = (status, value)
                    except queue_mod.Empty:
                        continue_reading = False
                for r in dead:
                    got.setdefault(r, ("died", procs[r].exitcode))
    for p in procs:
        p.join(timeout=1)
        if p.is_alive():
            p.kill()  # only the processes this function started
    for r in range(P):
        got.setdefault(r, ("hang", None))
    return got


# ----------------------------------------------------------- a rank dies in the middle of a ring step


def _worker_dies_mid_ring(rank, P, where):
    import keyfold.distributed.ring as ring

    calls = []
    name = "accumulate" if where == "forward" else "piece_grads"
    real = getattr(ring, name)

    def dying(*a, **kw):
        calls.append(1)
        if rank == 1 and len(calls) == 2:          # step 1: its transfer is posted, the shard half-computed
            os._exit(17)
        return real(*a, **kw)
    setattr(ring, name, dying)
    q = torch.randn(1, 2, 32, 8, requires_grad=True)
    t0 = time.monotonic()
    try:
        out = ring_attention(q, q, q, mask=keyfold.causal())
        out.sum().backward()
        return ("finished", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - t0)


@pytest.mark.slow  # ~20 s of spawned ranks; `make test` (CI) runs it, `make test-fast` skips it
def test_a_rank_killed_mid_ring_step_ends_the_others_within_the_timeout():
    for where in ("forward",):          # "backward" (piece_grads) ends the same way; one spawn keeps it quick
        t0 = time.monotonic()
        got = launch(_worker_dies_mid_ring, 2, where, pg_timeout=3, deadline=90)
        assert got[1] == ("died", 17), (where, got[1])
        status, value = got[0]
        assert status == "ok" and value[0] == "DistributedError", (where, got[0])
        assert "rank 0" in value[1] and "ring" in value[1], value[1]
        assert value[2] < 3 * 3, f"{where}: rank 0 waited {value[2]:.1f}s with a 3 s group timeout"
        assert time.monotonic() - t0 < 80   # not hanging to the deadline (spawns are slow on busy cores)


# ------------------------------------------- masks compared by content; check_shards=False raises


def _worker_disagreements(rank, P):
    seen = {}
    N = 32
    q = torch.randn(1, 2, N // P, 8)
    ids = torch.tensor([0] * 10 + [1] * 22) if rank == 0 else torch.tensor([0] * 12 + [1] * 20)
    mask = keyfold.documents(ids) & keyfold.causal()
    seen["repr"] = repr(mask)
    try:
        ring_attention(q, q, q, mask=mask)
        seen["documents"] = "passed"
    except ShardError as e:
        seen["documents"] = str(e)
    try:   # the same ids on both ranks: no error
        ring_attention(q, q, q, mask=keyfold.documents(torch.tensor([0] * 10 + [1] * 22)) & keyfold.causal())
        seen["same"] = "passed"
    except ShardError as e:
        seen["same"] = str(e)
    t0 = time.monotonic()
    try:   # shapes differ, nothing else checked: used to abort the process inside gloo
        x = torch.randn(1, 2, 16 if rank == 0 else 8, 8)
        ring_attention(x, x, x, check_shards=False)
        seen["unchecked_shapes"] = "passed"
    except ShardError as e:
        seen["unchecked_shapes"] = (str(e), time.monotonic() - t0)
    t0 = time.monotonic()
    try:   # one rank's own input is invalid: the other rank must not wait for the timeout
        ring_attention(q.to(torch.int32) if rank == 1 else q, q, q, check_shards=False)
        seen["unchecked_invalid"] = "passed"
    except ShardError as e:
        seen["unchecked_invalid"] = (str(e), time.monotonic() - t0)
    t0 = time.monotonic()
    try:   # another strategy on one rank: they posted different collectives and waited out the timeout
        ring_attention(q, q, q, check_shards=False, strategy=Strategy.ALL_GATHER if rank == 1 else Strategy.RING)
        seen["unchecked_strategy"] = "passed"
    except ShardError as e:
        seen["unchecked_strategy"] = (str(e), time.monotonic() - t0)
    out = ring_attention(q, q, q, mask=keyfold.causal(), check_shards=False)     # and it still works
    seen["after"] = bool(torch.isfinite(out).all())
    return seen


def test_rank_disagreements_raise_on_every_rank():
    got = launch(_worker_disagreements, 2, pg_timeout=3, deadline=60)
    assert all(s == "ok" for s, _ in got.values()), got
    res = [got[r][1] for r in range(2)]
    assert res[0]["repr"] == res[1]["repr"]                      # the printed forms cannot tell them apart
    for r, seen in enumerate(res):
        assert seen["documents"] != "passed" and "disagree" in seen["documents"] and "mask" in seen["documents"]
        assert "rank 1: mask documents" in seen["documents"], seen["documents"]
        assert seen["same"] == "passed"
        msg, waited = seen["unchecked_shapes"]
        assert "shapes disagree" in msg and "rank 1" in msg and waited < 3, seen
        msg, waited = seen["unchecked_invalid"]
        assert "int32" in msg if r == 1 else "rank(s) [1]" in msg, msg
        assert waited < 3, f"rank {r} waited {waited:.1f}s for the other rank's error"
        msg, waited = seen["unchecked_strategy"]
        assert "schedule" in msg and waited < 3, seen
        assert seen["after"]


def test_fingerprint_tells_content_apart_and_is_stable():
    from keyfold.distributed.comm import fingerprint
    a = keyfold.documents(torch.tensor([0, 0, 1, 1])) & keyfold.causal()
    b = keyfold.documents(torch.tensor([0, 1, 1, 1])) & keyfold.causal()
    assert repr(a) == repr(b) and fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(keyfold.documents(torch.tensor([0, 0, 1, 1])) & keyfold.causal())
    assert fingerprint(keyfold.alibi(torch.ones(4))) != fingerprint(keyfold.alibi(torch.full((4,), 2.0)))
    assert fingerprint(keyfold.window(3)) != fingerprint(keyfold.window(4))
    t1, t2 = torch.tensor([1, 2]), torch.tensor([1, 3])
    assert fingerprint(lambda b, h, q, k: t1[0] > q) != fingerprint(lambda b, h, q, k: t2[1] > q)


def _window_fn(a):
    return lambda b, h, qi, ki: (qi - ki).abs() <= a


def test_fingerprint_sees_every_callable_of_a_combined_mask_and_the_globals_it_reads():
    """Two ranks whose masks differed only in the second callable of ``f & g`` agreed: the digest's
    walk remembered objects by id, and the first callable's freed list of closure values lent its id
    to the second's, which was then skipped as a cycle (review, 2026-12-06: each rank would have run
    its own mask, silently). A function mask is also told apart by the globals it reads (W = 2 on one
    rank, 30 on another), now that its repr's address no longer refuses every function mask."""
    from keyfold.distributed.comm import Described, fingerprint
    from keyfold.masks import as_mask
    a = as_mask(_window_fn(1)) & as_mask(_window_fn(2))
    b = as_mask(_window_fn(1)) & as_mask(_window_fn(3))
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(as_mask(_window_fn(1)) & as_mask(_window_fn(2)))
    src = "def band(b, h, qi, ki):\n    return (qi - ki).abs() <= W\n"
    g1, g2, g3 = {"W": 2}, {"W": 30}, {"W": 2}
    for g in (g1, g2, g3):
        exec(src, g)  # noqa: S102 - the same function on two ranks, each with its own module globals
    assert Described(g1["band"]) != Described(g2["band"])
    assert Described(g1["band"]) == Described(g3["band"])
    # what a global holds besides plain values is left out: a sentinel object (its repr shows an
    # address, different on every rank; equal masks were refused) or a model (hashed every call)
    s1, s2 = {"W": 2, "S": object()}, {"W": 2, "S": object()}
    for g in (s1, s2):
        exec("def band(b, h, qi, ki):\n    return (qi - ki).abs() <= W if S is not None else qi >= ki\n", g)  # noqa: S102
    assert Described(s1["band"]) == Described(s2["band"])
    # a partial's arguments and the globals a callable object's __call__ reads are content too
    assert fingerprint(functools.partial(_band_of, 3)) != fingerprint(functools.partial(_band_of, 4))
    global _CALL_W
    _CALL_W, first = 3, fingerprint(_CallBand())
    _CALL_W = 30
    assert fingerprint(_CallBand()) != first


def _band_of(w, b, h, qi, ki):
    return (qi - ki).abs() <= w


_CALL_W = 3


class _CallBand:
    def __call__(self, b, h, qi, ki):
        return (qi - ki).abs() <= _CALL_W


def _worker_backward_it_cannot_run(rank, P):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=g).requires_grad_(True) for _ in range(3))
    table = torch.zeros(2, requires_grad=True)
    said = []
    for strategy in (Strategy.RING, Strategy.ALL_GATHER):
        for kw in (dict(backend=keyfold.Backend.REFERENCE),
                   dict(score=lambda s, b, h, qi, ki: s + table[h])):
            try:
                ring_attention(q, k, v, mask=keyfold.causal(), strategy=strategy, **kw).sum().backward()
                said.append("no error")
            except ShardError as e:
                said.append(str(e))
    # the group is still whole: a plain call runs on every rank
    out = ring_attention(q, k, v, mask=keyfold.causal())
    out.sum().backward()
    return said, bool(torch.isfinite(q.grad).all())


def test_what_the_ring_backward_cannot_run_is_refused_before_the_forward():
    """Backend.REFERENCE, or a score whose tensors train, over RING or ALL_GATHER: the forward ran,
    the backward raised (with advice for attend_backward, a function the user never called), and the
    ring left transfers posted, so the next collective timed out (a review, 2026-12-07). Now each is
    refused on every rank before a byte is sent, naming what to use, and the group stays usable."""
    for status, (said, finite) in ((s, v) for s, v in launch(_worker_backward_it_cannot_run, 2, pg_timeout=20,
                                                             deadline=90).values()):
        assert status == "ok"
        assert len(said) == 4 and finite
        assert all("Strategy.ALL_TO_ALL" in m for m in said), said
        assert "piece backward" in said[0] and "require grad" in said[1]
