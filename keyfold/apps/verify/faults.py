"""``python -m keyfold verify faults``: a seeded fuzz count per module (inputs tried, errors raised,
wrong answers), written to ``benchmarks/results/faults.{json,md}`` for the README's reliability section.

Each module gets random inputs, valid and invalid, and an independent check of every answer:

- ``keyfold`` (attention / attend): the Hypothesis campaign of :mod:`.fuzz` (error bound against
  float64, empty rows exactly 0, malformed arguments a clear error);
- ``keyfold.caches``: random walks of append / reset / reorder / fork / free (and appends with a
  wrong device, an unknown id, too many tokens) where old requests held NaN; every decode of a
  clean sequence against a fresh cache holding only its tokens, every refused call must leave the
  cache unchanged; ``cascade`` with NaN padding past random suffix lengths;
- ``keyfold.distributed``: what every rank computes for every shard, merged (the ring's
  arithmetic without the transport), against attention on the whole sequence in float64, over
  layouts, masks and rank counts (invalid lengths must raise); mask fingerprints of different content;
- ``keyfold.apps.control``: closed loops with adversarial and faulty controllers, disturbances up to
  5x the filter's assumed bound, filter on and off; every summary number recounted from the logged
  trajectory, and a violation with the assumption held is a wrong answer;
- ``keyfold.apps.verify``: certified bounds (both methods) on random layers with score gains up to
  1000 and random masks, against sampled inputs; a non-finite bound is a wrong answer.

An *error raised* is an expected, clear exception for an invalid input (or an input outside what
the module covers); an exception on a valid input or any disagreement with the check is a *wrong
answer*, recorded with its case.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["Tally", "run_all", "main"]


@dataclass
class Tally:
    module: str
    inputs: int = 0
    errors: int = 0          # clear errors for invalid inputs
    wrong: int = 0           # wrong answers, unexpected exceptions, refusals that changed state
    seconds: float = 0.0
    what: str = ""
    cases: list = field(default_factory=list)   # the first wrong cases

    def bad(self, desc: str):
        self.wrong += 1
        if len(self.cases) < 10:
            self.cases.append(desc[:400])


# --------------------------------------------------------------------------------- core


def fuzz_core(n: int, seed: int) -> Tally:
    from .fuzz import Outcome, run_fuzz
    t = Tally("keyfold (attention, attend)", what="Hypothesis campaign of keyfold.apps.verify.fuzz")
    rep = run_fuzz(n, seed=seed)
    t.inputs, t.errors = rep.cases, rep.by_outcome.get(Outcome.CLEAR_ERROR.value, 0)
    t.wrong = rep.by_outcome.get(Outcome.FAILURE.value, 0)
    t.cases = [" | ".join(map(str, f)) for f in rep.failures[:10]]
    return t


# ------------------------------------------------------------------------------- caches


def _fresh(q, k, v):
    from keyfold.caches import KVCache, decode
    c = KVCache(batch=1, heads=k.shape[1], head_dim=k.shape[-1], capacity=max(k.shape[2], 1))
    if k.shape[2]:
        c.append(k, v)
    return decode(q, c)


def fuzz_caches(n: int, seed: int) -> Tally:
    from keyfold.caches import CacheFullError, KVCache, PagedKVCache, cascade, decode
    from keyfold.engine import attention
    t = Tally("keyfold.caches", what="random walks (paged and contiguous, NaN in old requests), cascade padding")
    rnd, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    H, D = 2, 8
    clear = (KeyError, ValueError, TypeError, CacheFullError)

    def kv(b, m, bad=False):
        k, v = torch.randn(b, H, m, D, generator=gen), torch.randn(b, H, m, D, generator=gen)
        if bad:
            v[..., 0] = float("nan")
        return k, v

    def refused(call, snapshot, desc):
        before = snapshot()
        try:
            call()
        except clear:
            t.errors += 1
            if not _same(before, snapshot()):
                t.bad(f"{desc}: refused but changed the cache")
            return
        t.bad(f"{desc}: accepted")

    pool = PagedKVCache(num_pages=10, page_size=4, heads=H, head_dim=D)
    seqs: dict = {}
    snap = lambda: (pool.stats(), {s: pool.block_table(s) for s in pool.sequences},  # noqa: E731
                    pool.k_pages.clone(), pool.v_pages.clone())
    for step in range(n // 2):
        t.inputs += 1
        op = rnd.choice(["new", "append", "append", "fork", "free", "decode", "bad"])
        live = pool.sequences
        try:
            if op == "new" or not live:
                s = pool.new_sequence()
                seqs[s] = (torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), rnd.random() < 0.3)
            elif op == "append":
                s = rnd.choice(live)
                k0, v0, bad = seqs[s]
                k, v = kv(1, rnd.randint(1, 6), bad)
                try:
                    pool.append(k, v, s)
                    seqs[s] = (torch.cat([k0, k], 2), torch.cat([v0, v], 2), bad)
                except CacheFullError:
                    t.errors += 1
            elif op == "fork":
                s = rnd.choice(live)
                seqs[pool.fork(s)] = seqs[s]
            elif op == "free":
                s = rnd.choice(live)
                pool.free(s)
                del seqs[s]
            elif op == "bad":
                s = rnd.choice(live)
                k, v = kv(1, 3)
                how = rnd.choice(["meta", "unknown", "heads"])
                args = {"meta": (k.to("meta"), v, s), "unknown": (k, v, 10_000),
                        "heads": (torch.randn(1, H + 1, 3, D), torch.randn(1, H + 1, 3, D), s)}[how]
                refused(lambda: pool.append(*args), snap, f"paged step {step} append {how}")
            else:
                clean = [s for s in live if not seqs[s][2] and seqs[s][0].shape[2]]
                if clean:
                    q = torch.randn(len(clean), H, 1, D, generator=gen)
                    out = decode(q, pool, seq_ids=clean)
                    for i, s in enumerate(clean):
                        if not torch.allclose(out[i:i + 1], _fresh(q[i:i + 1], *seqs[s][:2]), atol=1e-5, rtol=1e-5):
                            t.bad(f"paged step {step}: seq {s} differs from a fresh cache")
        except Exception as e:  # noqa: BLE001
            t.bad(f"paged step {step} {op}: {type(e).__name__}: {e}")
    B, C = 4, 16
    cache = KVCache(batch=B, heads=H, head_dim=D, capacity=C)
    rows = [(torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), False)] * B
    csnap = lambda: (cache.lengths, cache.k.clone(), cache.v.clone())  # noqa: E731
    for step in range(n // 2 - n // 10):
        t.inputs += 1
        op = rnd.choice(["append", "append", "reset", "reorder", "decode", "bad"])
        try:
            if op == "append":
                ids = sorted(rnd.sample(range(B), rnd.randint(1, B)))
                m = rnd.randint(1, 4)
                lens = [min(rnd.randint(0, m), C - rows[s][0].shape[2]) for s in ids]
                k, v = kv(len(ids), m)
                for i, s in enumerate(ids):
                    if rows[s][2] or rnd.random() < 0.15:
                        v[i, :, :, 0] = float("nan")
                cache.append(k, v, seq_ids=ids, lengths=lens)
                for i, (s, mm) in enumerate(zip(ids, lens)):
                    bad = rows[s][2] or bool(mm and not torch.isfinite(v[i, :, :mm]).all())
                    rows[s] = (torch.cat([rows[s][0], k[i:i + 1, :, :mm]], 2),
                               torch.cat([rows[s][1], v[i:i + 1, :, :mm]], 2), bad)
            elif op == "reset":
                ids = sorted(rnd.sample(range(B), rnd.randint(1, B)))
                cache.reset(ids)
                for s in ids:
                    rows[s] = (torch.zeros(1, H, 0, D), torch.zeros(1, H, 0, D), False)
            elif op == "reorder":
                idx = [rnd.randrange(B) for _ in range(B)]
                cache.reorder(idx)
                rows = [rows[i] for i in idx]
            elif op == "bad":
                k, v = kv(1, 2)
                how = rnd.choice(["meta", "unknown", "full", "reorder"])
                call = {"meta": lambda: cache.append(k.to("meta"), v, seq_ids=[0]),
                        "unknown": lambda: cache.append(k, v, seq_ids=[B]),
                        "full": lambda: cache.append(torch.randn(1, H, C + 1, D), torch.randn(1, H, C + 1, D),
                                                     seq_ids=[0]),
                        "reorder": lambda: cache.reorder([0] * (B - 1))}[how]
                refused(call, csnap, f"contiguous step {step} {how}")
            elif min(r[0].shape[2] for r in rows):
                q = torch.randn(B, H, 1, D, generator=gen)
                out = decode(q, cache)
                for s in range(B):
                    if not rows[s][2] and not torch.allclose(out[s:s + 1], _fresh(q[s:s + 1], *rows[s][:2]),
                                                             atol=1e-5, rtol=1e-5):
                        t.bad(f"contiguous step {step}: row {s} differs from a fresh cache")
        except Exception as e:  # noqa: BLE001
            t.bad(f"contiguous step {step} {op}: {type(e).__name__}: {e}")
    for case in range(n // 10):
        t.inputs += 1
        R, P, S = rnd.randint(1, 4), rnd.randint(0, 9), rnd.randint(1, 6)
        lens = [rnd.randint(0, S) for _ in range(R)]
        if any(P + x < 1 for x in lens):
            lens = [max(x, 1) for x in lens]
        q = torch.randn(R, H, 1, D, generator=gen)
        pk, pv = torch.randn(1, H, P, D, generator=gen), torch.randn(1, H, P, D, generator=gen)
        sk, sv = torch.full((R, H, S, D), float("nan")), torch.full((R, H, S, D), float("nan"))
        for r, x in enumerate(lens):
            sk[r, :, :x], sv[r, :, :x] = torch.randn(H, x, D, generator=gen), torch.randn(H, x, D, generator=gen)
        try:
            out = cascade(q, pk, pv, sk, sv, suffix_lengths=lens)
            for r, x in enumerate(lens):
                want = attention(q[r:r + 1], torch.cat([pk, sk[r:r + 1, :, :x]], 2), torch.cat([pv, sv[r:r + 1, :, :x]], 2))
                if not torch.allclose(out[r:r + 1], want, atol=1e-5, rtol=1e-5):
                    t.bad(f"cascade case {case}: R={R} P={P} lens={lens} row {r}")
        except Exception as e:  # noqa: BLE001
            t.bad(f"cascade case {case}: {type(e).__name__}: {e}")
    return t


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.uint8),
                                                        b.contiguous().view(torch.uint8)))   # NaN == NaN here
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


# --------------------------------------------------------------------------- distributed


def fuzz_distributed(n: int, seed: int) -> Tally:
    import keyfold
    from keyfold.distributed import Layout, shard_of, unshard_of
    from keyfold.distributed.comm import fingerprint
    from keyfold.distributed.layout import check_length
    from keyfold.distributed.pieces import Job, accumulate
    from keyfold.state import empty_state
    t = Tally("keyfold.distributed", what="every rank x every shard merged vs whole-sequence attention (float64); "
                                          "invalid lengths; mask fingerprints")
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    for case in range(n):
        t.inputs += 1
        P, layout = rnd.choice([1, 2, 3, 4]), rnd.choice(list(Layout))
        N = rnd.randint(1, 24)
        try:
            check_length(N, P, layout)
        except ValueError:
            t.errors += 1
            continue
        ids = torch.tensor(sorted(rnd.randrange(3) for _ in range(N)))
        mask = rnd.choice([None, keyfold.causal(), keyfold.causal() & keyfold.window(rnd.randint(0, 5)),
                           keyfold.documents(ids) & keyfold.causal(), keyfold.documents(ids)])
        H = 4
        q, k, v = (torch.randn(1, h, N, 8, dtype=torch.float64) for h in (H, 2, 2))
        try:
            ref = keyfold.attend(q, k, v, mask=mask, backend=keyfold.Backend.REFERENCE)
            outs = []
            for r in range(P):
                job = Job(keyfold.as_mask(mask), None, None, keyfold.Backend.AUTO, layout, N, P, r)
                acc = empty_state(1, H, N // P, 8, dtype=torch.float64)
                for src in range(P):
                    accumulate(acc, shard_of(q, P, r, layout), shard_of(k, P, src, layout),
                               shard_of(v, P, src, layout), job, src)
                outs.append(acc.out)
            err = float((unshard_of(outs, layout) - ref.out).abs().max()) if N else 0.0
            if not err < 1e-12:
                t.bad(f"case {case}: N={N} P={P} {layout.name} mask={mask!r}: error {err:.2e}")
            if mask is not None and "documents" in repr(mask) and N > 1:
                other = ids.clone()
                other[rnd.randrange(N)] += 1
                twin = keyfold.documents(other) & keyfold.causal() if "causal" in repr(mask) else keyfold.documents(other)
                t.inputs += 1
                if fingerprint(twin) == fingerprint(mask):
                    t.bad(f"case {case}: two different documents masks share a fingerprint")
        except Exception as e:  # noqa: BLE001
            t.bad(f"case {case}: N={N} P={P} {layout}: {type(e).__name__}: {e}")
    return t


# ------------------------------------------------------------------------------- control


def recount(res, plant, w_assumed) -> dict:
    """The safety numbers of a closed-loop summary, from the logged trajectory alone."""
    from keyfold.apps.control import Source
    X, U = res.states, res.inputs
    finite = np.isfinite(X).all(1)
    outside = ~finite | (np.where(finite[:, None], X, 0.0) @ plant.state_limits.H.T > plant.state_limits.h).any(1)
    W = X[1:] - X[:-1] @ plant.A.T - U @ plant.B.T
    wf = np.isfinite(W).all(1)
    exceeded = ~outside[:-1] & ((np.abs(np.where(wf[:, None], W, 0.0)) > w_assumed).any(1) | ~wf)
    cert = {Source.PROPOSAL, Source.CORRECTED, Source.FALLBACK, Source.DEADLINE, Source.FAULT}
    certified = np.array([res.filter_on and s in cert for s in res.sources], bool)
    return {"violations": int(outside.sum()), "assumption_exceeded": int(exceeded.sum()),
            "certified_invalidated": int((exceeded & certified).sum()),
            "violations_after_certified": int((certified & outside[1:]).sum()),
            "interventions": sum(s is Source.CORRECTED for s in res.sources),
            "uncertified": sum(s is Source.UNCERTIFIED for s in res.sources), "steps": len(U)}


class _Chaos:
    """A controller wrapper that raises or returns garbage on random steps."""

    def __init__(self, inner, rate: float, seed: int):
        self.inner, self.rate, self.rnd = inner, rate, random.Random(seed)
        self.window, self.horizon = inner.window, inner.horizon

    def reset(self, seed):
        self.inner.reset(seed)

    def propose(self, x_hist, u_hist, reference):
        good = self.inner.propose(x_hist, u_hist, reference)
        if self.rnd.random() >= self.rate:
            return good
        how = self.rnd.choice(["raise", "nan", "shape", "out"])
        if how == "raise":
            raise RuntimeError("chaos")
        return {"nan": good * np.nan, "shape": np.zeros((2, 5)), "out": good + 1e3}[how]


def fuzz_control(n: int, seed: int) -> Tally:
    from keyfold.apps.control import (Disturbance, FakeClock, FilterConfigError, LoopConfig, RandomBangBang,
                                      SafetyFilter, WorstActionController, make_plant, run_loop)
    t = Tally("keyfold.apps.control", what="closed loops: adversarial/faulty controllers, disturbance 0.5-5x the "
                                            "filter's bound, filter on/off; summary vs recount")
    rnd = random.Random(seed)
    for case in range(n):
        t.inputs += 1
        name = rnd.choice(["msd", "pendulum"])
        base = make_plant(name)
        scale = rnd.choice([0.5, 1.0, 1.0, 2.0, 5.0])
        plant = make_plant(name, noise=base.noise * scale)
        on = rnd.random() < 0.7
        adv = (WorstActionController(plant.A, plant.B, plant.state_limits, plant.input_limits)
               if rnd.random() < 0.5 else RandomBangBang(plant.input_limits, seed=case))
        ctrl = _Chaos(adv, rnd.choice([0.0, 0.1, 0.3]), case)
        try:
            sf = SafetyFilter.from_plant(plant, w_bar=base.disturbance_bound()) if on else None
        except FilterConfigError:
            t.errors += 1
            continue
        try:
            res = run_loop(plant, ctrl, np.zeros(62), LoopConfig(steps=60, filter_on=on, seed=case,
                                                                  disturbance=rnd.choice(list(Disturbance))),
                           sf, FakeClock())
            s, r = res.summary(), recount(res, plant, res.w_bar)
            diff = {k: (s[k], v) for k, v in r.items() if s[k] != v}
            w_assumed = base.disturbance_bound() if on else plant.disturbance_bound()
            if diff or not np.array_equal(res.w_bar, w_assumed):
                t.bad(f"case {case}: {name} x{scale} filter={on}: summary != recount {diff}")
            if on and r["assumption_exceeded"] == 0 and r["violations"]:
                t.bad(f"case {case}: {name}: a violation with the filter's assumption held")
            if r["violations_after_certified"] and not res.warnings():
                t.bad(f"case {case}: certified steps broken with no warning")
        except Exception as e:  # noqa: BLE001
            t.bad(f"case {case}: {type(e).__name__}: {e} {traceback.format_exc(limit=-1)[-200:]}")
    return t


# -------------------------------------------------------------------------------- verify


def fuzz_verify(n: int, seed: int) -> Tally:
    import keyfold
    from . import certify as C
    t = Tally("keyfold.apps.verify", what="certified bounds (IBP and linear) of attention layers (gains 0.1-1000) "
                                           "and whole blocks (pre- and post-LN), random masks, vs 64 sampled "
                                           "inputs; every input is valid, so a refusal is a wrong answer")
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for case in range(n):
        N, H = rnd.randint(1, 6), rnd.choice([1, 2])
        E = H * rnd.choice([2, 4])
        gain = 10 ** rnd.uniform(-1, 3)
        mask = rnd.choice([None, keyfold.causal(), keyfold.causal() & keyfold.window(1), keyfold.window(0, 1)])
        block = case % 3 == 2  # (the block certifier too: LayerNorms and the feed-forward, both orders)
        if block:
            w = C.BlockWeights.random(E, H, 2 * E, seed=case, norm_first=bool(rnd.getrandbits(1)))
            forward, certify = C.block_forward, C.certify_block
        else:
            w = C.AttentionWeights.random(E, H, seed=case, gain=gain)
            forward, certify = C.attention_forward, C.certify_attention
        x = torch.randn(N, E, generator=g, dtype=torch.float64) * rnd.choice([0.1, 1.0, 10.0])
        eps = rnd.choice([0.0, 1e-3, 0.1, 1.0])
        ys = forward(C.sample_box(x - eps, x + eps, 64, generator=g), w, mask)
        for method in C.Method:
            t.inputs += 1
            try:
                b = certify(x, w, eps=eps, mask=mask, method=method)
            except ValueError as e:  # every input here is valid: a refusal hides a failure (a certifier that
                # refused every layer scored 0 wrong answers; a review, 2026-12-08)
                t.bad(f"case {case} {method.value}: refused a valid input: {e!s:.200}")
                continue
            except Exception as e:  # noqa: BLE001
                t.bad(f"case {case} {method.value}: {type(e).__name__}: {e}")
                continue
            if not (torch.isfinite(b.lo).all() and torch.isfinite(b.hi).all()):
                t.bad(f"case {case} {method.value}: non-finite bound (gain {gain:.3g}, mask {mask!r})")
            elif not all(b.contains(y) for y in ys):
                t.bad(f"case {case} {method.value}: a sampled output outside the bound (gain {gain:.3g})")
    return t


# ----------------------------------------------------------------------------------- CLI

PRESETS = {"quick": dict(core=100, caches=400, distributed=100, control=20, verify=40),
           "full": dict(core=600, caches=3000, distributed=600, control=120, verify=300)}
_RUNNERS = {"core": fuzz_core, "caches": fuzz_caches, "distributed": fuzz_distributed, "control": fuzz_control,
            "verify": fuzz_verify}


def run_all(counts: dict, seed: int = 0, progress: bool = True) -> list[Tally]:
    torch.set_num_threads(1)
    out = []
    for key, n in counts.items():
        t0 = time.perf_counter()
        tally = _RUNNERS[key](n, seed)
        tally.seconds = time.perf_counter() - t0
        if progress:
            print(f"{tally.module}: {tally.inputs} inputs, {tally.errors} errors raised, {tally.wrong} wrong answers "
                  f"({tally.seconds:.0f} s)", flush=True)
        out.append(tally)
    return out


def markdown(tallies: list[Tally], command: str) -> str:
    lines = ["# Fuzz count per module", "", f"Command: `{command}` · torch {torch.__version__} · "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "| module | inputs tried | errors raised (clear, for invalid input) | wrong answers | what is checked |",
             "|---|---|---|---|---|"]
    for t in tallies:
        lines.append(f"| {t.module} | {t.inputs} | {t.errors} | {t.wrong} | {t.what} |")
    bad = [c for t in tallies for c in t.cases]
    if bad:
        lines += ["", "Wrong answers:", ""] + [f"- {c}" for c in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m keyfold verify faults", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer inputs per module (about a minute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modules", help=f"comma list from {','.join(_RUNNERS)}")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    preset = "quick" if args.quick else "full"
    counts = PRESETS[preset]
    if args.modules:
        counts = {k: counts[k] for k in args.modules.split(",")}
    tallies = run_all(counts, args.seed)
    command = "python -m keyfold verify faults " + " ".join(argv or [])
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    name = "faults-quick" if args.quick else "faults"
    (folder / f"{name}.json").write_text(json.dumps({"preset": preset, "seed": args.seed,
                                                     "tallies": [asdict(t) for t in tallies]}, indent=1))
    (folder / f"{name}.md").write_text(markdown(tallies, command.strip()))
    print(markdown(tallies, command.strip()))
    return 1 if any(t.wrong for t in tallies) else 0
