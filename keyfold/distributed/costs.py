"""A cost model for context parallelism: FLOPs, bytes sent per rank, and whether compute hides
communication, for ring, all-gather and all-to-all (Ulysses) attention.

``python -m keyfold costs`` prints the Ring Attention paper's condition for its devices and a
table of predicted forward time (``--train``: forward + backward) from 1 to 1024 devices for a
1M-token sequence. The model, per
rank, with ``c = N / P`` tokens, ``f = 1/2`` for causal (1 otherwise), ``e`` bytes per element:

- attention FLOPs: ``4 * B * H * N^2 * d * f`` (QK^T and PV, 2 FLOPs per multiply-add);
- RING: P steps of ``4 * B * H * c^2 * d * f`` FLOPs; each of the first P-1 overlaps sending one
  K/V shard, ``2 * B * Hkv * c * d * e`` bytes. Time ``t_c + (P-1) * max(t_c, t_m)``. Compute hides
  communication when ``t_c >= t_m``, i.e. (without latency)

      c >= (Hkv * e) / (2 * H * f) * F / W        (F: achieved FLOP/s, W: link bytes/s)

  which with the paper's assumptions (Hkv = H, 2-byte elements, no mask, peak FLOP/s) is the
  paper's ``c >= F / W``. With ZIGZAG (or STRIPED) every causal step does exactly half a block,
  so f = 1/2 holds per step, not only on average.
- ALL_GATHER: the same bytes (a ring all-gather sends P-1 shards), in G head groups so gathering
  group g+1 overlaps computing group g: ``t_m/G + (G-1) * max(t_c, t_m)/G + t_c/G``.
- ALL_TO_ALL: four all-to-alls (q, k, v in, out back), each sending (P-1)/P of the local tensor,
  not overlapped: ``t_m + t_c``. Needs H divisible by P (P <= H).
- backward (``train=True``): 2.5x the forward FLOPs (FlashAttention-2's count); the ring sends each
  K/V shard again plus its float32 dK/dV (P sends, the last one not overlapped); the all-gather
  re-gathers and reduce-scatters float32 dK/dV; the all-to-all moves as many bytes as forward.

Links: P <= ``per_node`` devices talk over the intra-node link, more over the inter-node one
(a ring or an all-to-all over several nodes is as fast as its slowest hop). The numbers used for
each profile are in :data:`PROFILES`; this is a model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Link", "Profile", "Workload", "Estimate", "PROFILES", "PAPER_DEVICES",
           "attention_flops", "min_block", "estimate", "table", "main"]


@dataclass(frozen=True)
class Link:
    """One direction of a device's link: sustained bytes/s and per-message latency (s)."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Profile:
    """A device and its links."""

    name: str
    flops: float          # peak dense 16-bit FLOP/s per device (datasheet, no sparsity)
    mfu: float            # fraction of the peak an attention kernel achieves
    intra: Link           # within a node
    inter: Link           # across nodes
    per_node: int = 8     # devices per node

    def link(self, P: int) -> Link:
        return self.intra if P <= self.per_node else self.inter


@dataclass(frozen=True)
class Workload:
    """One attention call: the whole sequence, before sharding."""

    tokens: int = 1 << 20
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    elem_bytes: int = 2       # bf16
    causal: bool = True

    @property
    def f(self) -> float:
        return 0.5 if self.causal else 1.0


@dataclass(frozen=True)
class Estimate:
    strategy: str
    P: int
    tokens_per_rank: float
    flops_per_rank: float
    bytes_per_rank: float     # sent by each rank
    compute_s: float          # all of this rank's attention compute
    comm_s: float             # all of this rank's communication, if nothing overlapped
    step_s: float             # predicted time of the call (forward, or forward + backward)
    hidden: bool              # whether compute hides communication
    note: str = ""


_NVLINK4 = Link("NVLink 4 (900 GB/s bidirectional)", 450e9, 5e-6)
_IB400 = Link("InfiniBand NDR 400 Gb/s", 50e9, 10e-6)

PROFILES: dict[str, Profile] = {
    # H100 / H200 SXM: 989 TFLOP/s dense bf16 (datasheet), NVLink 4 within 8 GPUs, one 400 Gb/s NIC per GPU.
    "h100-sxm": Profile("H100 SXM", 989e12, 0.5, _NVLINK4, _IB400),
    "h200-sxm": Profile("H200 SXM", 989e12, 0.5, _NVLINK4, _IB400),
    # A100 SXM: 312 TFLOP/s bf16, NVLink 3 (600 GB/s bidirectional), HDR 200 Gb/s.
    "a100-sxm": Profile("A100 SXM", 312e12, 0.5, Link("NVLink 3 (600 GB/s bidirectional)", 300e9, 5e-6),
                        Link("InfiniBand HDR 200 Gb/s", 25e9, 10e-6)),
}

# The Ring Attention paper's Table 1 (Liu et al., 2023): FLOP/s and interconnect bytes/s.
PAPER_DEVICES: dict[str, tuple[float, float]] = {
    "A100 NVLink": (312e12, 300e9),
    "A100 InfiniBand": (312e12, 12.5e9),
    "TPU v3": (123e12, 112e9),
    "TPU v4": (275e12, 268e9),
    "TPU v5e": (197e12, 186e9),
}


def attention_flops(w: Workload) -> float:
    """Forward FLOPs of attention over the whole sequence: ``4 * B * H * N^2 * d * f``."""
    return 4.0 * w.batch * w.heads * w.tokens ** 2 * w.head_dim * w.f


def min_block(flops: float, bandwidth: float, w: Workload | None = None, mfu: float = 1.0) -> float:
    """Smallest tokens per rank for which a ring step's compute hides its transfer (no latency).

    ``c >= (Hkv * e) / (2 * H * f) * (mfu * F) / W``; with ``w=None`` the paper's assumptions
    (Hkv = H, e = 2, f = 1, mfu = 1) reduce it to ``F / W``.

    >>> min_block(312e12, 300e9)
    1040.0
    """
    if w is None:
        return flops / bandwidth
    return (w.kv_heads * w.elem_bytes) / (2.0 * w.heads * w.f) * (mfu * flops) / bandwidth


def _check(w: Workload, P: int):
    if P < 1:
        raise ValueError(f"P must be >= 1 device, got {P}")
    for name in ("tokens", "heads", "kv_heads", "head_dim", "batch", "elem_bytes"):
        if getattr(w, name) < 1:
            raise ValueError(f"Workload.{name} must be >= 1, got {getattr(w, name)}")
    if w.heads % w.kv_heads:
        raise ValueError(f"heads ({w.heads}) must be a multiple of kv_heads ({w.kv_heads})")


STRATEGIES = ("ring", "all_gather", "all_to_all")
BACKWARD_FLOPS = 2.5   # FlashAttention-2's count: backward = 2.5x forward (5 matmuls against 2)
GRAD_BYTES = 4         # dK/dV travel and are reduced in float32


def estimate(strategy: str, w: Workload, P: int, prof: Profile, groups: int = 4, train: bool = False) -> Estimate:
    """Predicted cost of one attention call on ``P`` devices: forward, or forward + backward.

    strategy: ``"ring"``, ``"all_gather"`` or ``"all_to_all"`` (the values of
    :class:`keyfold.distributed.Strategy`). groups: head groups of the all-gather variant.
    train: add the backward pass (2.5x the forward FLOPs; ring and all-gather also move dK/dV in
    float32; all-to-all moves dout in and dq, dk, dv back, as many bytes as the forward).
    """
    _check(w, P)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'ring', 'all_gather' or 'all_to_all', got {strategy!r}")
    fwd = _estimate(strategy, w, P, prof, groups, backward=False)
    if not train:
        return fwd
    bwd = _estimate(strategy, w, P, prof, groups, backward=True)
    return Estimate(strategy, P, fwd.tokens_per_rank, fwd.flops_per_rank + bwd.flops_per_rank,
                    fwd.bytes_per_rank + bwd.bytes_per_rank, fwd.compute_s + bwd.compute_s,
                    fwd.comm_s + bwd.comm_s, fwd.step_s + bwd.step_s, fwd.hidden and bwd.hidden,
                    "forward + backward" + (f"; {fwd.note}" if fwd.note else ""))


def _estimate(strategy: str, w: Workload, P: int, prof: Profile, groups: int, backward: bool) -> Estimate:
    link = prof.link(P)
    F = prof.flops * prof.mfu
    c = w.tokens / P
    flops = attention_flops(w) / P * (BACKWARD_FLOPS if backward else 1.0)
    compute = flops / F
    shard = 2.0 * w.batch * w.kv_heads * c * w.head_dim * w.elem_bytes         # one K/V shard, bytes
    grads = 2.0 * w.batch * w.kv_heads * c * w.head_dim * GRAD_BYTES if backward else 0.0  # its dK/dV
    if P == 1:
        return Estimate(strategy, 1, c, flops, 0.0, compute, 0.0, compute, True, "one device: no communication")
    if strategy == "ring":
        tc = compute / P
        tm = link.latency + (shard + grads) / link.bandwidth    # K/V (and dK/dV) in flight together
        last = link.latency + grads / link.bandwidth if backward else 0.0  # the last dK/dV send home
        step = tc + (P - 1) * max(tc, tm) + last
        sent = (P - 1) * shard + P * grads
        return Estimate(strategy, P, c, flops, sent, compute, (P - 1) * tm + last, step, tc >= tm)
    if strategy == "all_gather":
        G = max(1, min(groups, w.kv_heads))
        rounds = 2 if backward else 1                          # backward: re-gather, reduce-scatter
        tm = (P - 1) * (rounds * link.latency + (shard + grads) / link.bandwidth)
        step = tm / G + (G - 1) * max(compute, tm) / G + compute / G
        return Estimate(strategy, P, c, flops, (P - 1) * (shard + grads), compute, tm, step, compute >= tm,
                        f"{G} head groups; holds all N keys/values of a group")
    if w.heads % P:
        return Estimate(strategy, P, c, flops, math.nan, compute, math.nan, math.nan, False,
                        f"needs heads ({w.heads}) divisible by P")
    kv = w.kv_heads if w.kv_heads % P == 0 else w.heads                       # too few kv heads: copies
    local = w.batch * c * w.head_dim * w.elem_bytes * (2 * w.heads + 2 * kv)  # q, k, v in; out back
    sent = local * (P - 1) / P
    tm = 4 * (P - 1) * link.latency + sent / link.bandwidth
    return Estimate(strategy, P, c, flops, sent, compute, tm, tm + compute, False, "not overlapped")


def table(w: Workload, prof: Profile, max_devices: int = 1024, groups: int = 4, train: bool = False) -> list[dict]:
    """Rows for P = 1, 2, 4, ..., max_devices: every strategy's estimate."""
    rows, P = [], 1
    while P <= max_devices:
        rows.append({"P": P, **{s: asdict(estimate(s, w, P, prof, groups, train)) for s in STRATEGIES}})
        P *= 2
    return rows


# ------------------------------------------------------------------------------- output


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:,.1f}"


def _gb(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x / 1e9:,.2f}"


def paper_markdown() -> str:
    lines = ["| device (Ring Attention paper, Table 1) | FLOP/s | link GB/s | min block c = F/W (tokens) |",
             "|---|---|---|---|"]
    for name, (F, W) in PAPER_DEVICES.items():
        lines.append(f"| {name} | {F / 1e12:.0f} T | {W / 1e9:g} | {min_block(F, W):,.0f} ({min_block(F, W) / 1024:.1f}K) |")
    return "\n".join(lines)


def table_markdown(rows: list[dict], w: Workload, prof: Profile, train: bool = False) -> str:
    head = [
        f"{'Forward + backward' if train else 'Forward'} attention, {w.tokens:,} tokens, B={w.batch}, H={w.heads}, Hkv={w.kv_heads}, d={w.head_dim}, "
        f"{w.elem_bytes}-byte elements, {'causal' if w.causal else 'no mask'}; {prof.name}: "
        f"{prof.flops / 1e12:.0f} TFLOP/s x {prof.mfu:g} achieved; {prof.intra.name} "
        f"{prof.intra.bandwidth / 1e9:g} GB/s per direction, {prof.intra.latency * 1e6:g} us within "
        f"{prof.per_node} devices; {prof.inter.name} {prof.inter.bandwidth / 1e9:g} GB/s, "
        f"{prof.inter.latency * 1e6:g} us across nodes.",
        "",
        f"Ring condition for this workload: c >= {min_block(prof.flops, prof.intra.bandwidth, w, prof.mfu):,.0f} "
        f"tokens per device on {prof.intra.name}, c >= {min_block(prof.flops, prof.inter.bandwidth, w, prof.mfu):,.0f} "
        f"on {prof.inter.name}.",
        "",
        "| devices | tokens/device | ring ms | ring hides comm | all-gather ms | all-gather hides | "
        "all-to-all ms | GB sent/device (ring) | GB sent/device (all-to-all) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ring, ag, a2a = r["ring"], r["all_gather"], r["all_to_all"]
        head.append(f"| {r['P']} | {ring['tokens_per_rank']:,.0f} | {_ms(ring['step_s'])} | "
                    f"{'yes' if ring['hidden'] else 'no'} | {_ms(ag['step_s'])} | {'yes' if ag['hidden'] else 'no'} | "
                    f"{_ms(a2a['step_s'])} | {_gb(ring['bytes_per_rank'])} | {_gb(a2a['bytes_per_rank'])} |")
    return "\n".join(head)


def _plot(rows, w, prof, path: Path, train: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = [r["P"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, label in (("ring", "ring"), ("all_gather", "all-gather"), ("all_to_all", "all-to-all (Ulysses)")):
        ax.plot(Ps, [r[s]["step_s"] for r in rows], marker="o", label=label)
    ax.plot(Ps, [r["ring"]["compute_s"] for r in rows], "k--", label="compute only")
    ax.axvline(prof.per_node + 0.5, color="grey", lw=0.8)
    ax.text(prof.per_node * 1.1, max(r["ring"]["step_s"] for r in rows) * 0.5, "intra-node | inter-node",
            fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices P")
    ax.set_ylabel(f"predicted {'forward + backward' if train else 'forward'} time (s)")
    ax.set_title(f"{w.tokens:,} tokens, H={w.heads}/{w.kv_heads}, d={w.head_dim} on {prof.name} (model)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold costs", description=__doc__.split("\n")[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="h200-sxm")
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--elem-bytes", type=int, default=2)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--mfu", type=float, default=None, help="achieved fraction of peak FLOP/s (default: profile's)")
    p.add_argument("--groups", type=int, default=4, help="head groups of the all-gather variant")
    p.add_argument("--max-devices", type=int, default=1024)
    p.add_argument("--train", action="store_true", help="forward + backward instead of forward only")
    p.add_argument("--out", type=Path, default=None, help="also write costs_<profile>.md/.json/.png here")
    a = p.parse_args(argv)
    w = Workload(a.tokens, a.heads, a.kv_heads, a.head_dim, a.batch, a.elem_bytes, not a.no_causal)
    prof = PROFILES[a.profile]
    if a.mfu is not None:
        prof = Profile(prof.name, prof.flops, a.mfu, prof.intra, prof.inter, prof.per_node)
    rows = table(w, prof, a.max_devices, a.groups, a.train)
    text = "## Ring Attention's condition\n\n" + paper_markdown() + "\n\n## Predicted step time\n\n" + \
        table_markdown(rows, w, prof, a.train)
    print(text)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = a.out / f"costs_{a.profile}{'_train' if a.train else ''}"
        stem.with_suffix(".md").write_text(text + "\n")
        stem.with_suffix(".json").write_text(json.dumps(
            {"workload": asdict(w), "profile": asdict(prof), "train": a.train, "rows": rows}, indent=1,
            default=str) + "\n")
        _plot(rows, w, prof, stem.with_suffix(".png"), a.train)
        print(f"\nwrote {stem}.md, .json, .png")
    return 0
