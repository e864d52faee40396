"""Context-parallel attention on 4 processes of one CPU (gloo), or on GPUs (NCCL).

    torchrun --nproc_per_node 4 examples/ring_attention_torchrun.py
    torchrun --nproc_per_node 4 examples/ring_attention_torchrun.py --layout striped --mask window

Every rank builds the same full sequence (seeded), keeps its shard, runs ``ring_attention``
forward and backward with each strategy, and checks its shard of the output and gradients
against single-process ``keyfold.attention`` on the whole sequence. Rank 0 prints the errors and
the time of each strategy next to the single-process time measured in the same run (on one CPU
the ranks share the cores, so expect no speed-up here: this shows the plumbing and the accuracy).
Then it decodes one token against a KV cache split across the ranks with ``tree_decode``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import keyfold
from keyfold.distributed import Layout, Strategy, ring_attention, shard, tree_decode


def _mask(name: str, N: int):
    if name == "causal":
        return keyfold.causal()
    if name == "window":
        return keyfold.causal() & keyfold.window(N // 16)
    if name == "documents":  # four packed documents of uneven length
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([N // 8, N // 2, N // 4, N - N // 8 - N // 2 - N // 4]))
        return keyfold.documents(ids) & keyfold.causal()
    return None


def _timed(fn, repeat):
    fn()  # warm-up (plans are cached after this)
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return out, (time.perf_counter() - t0) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", choices=[x.value for x in Layout], default="zigzag")
    p.add_argument("--mask", choices=["causal", "window", "documents", "none"], default="causal")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes ring_<device>_<layout>_<mask>.md/.json/.png here")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    layout, N = Layout(a.layout), a.tokens
    mask = _mask(a.mask, N)

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, N, a.head_dim, generator=g).to(device)
                     for h in (a.heads, a.kv_heads, a.kv_heads, a.heads))
    ql, kl, vl, dl = (shard(t, layout=layout) for t in (q, k, v, dout))

    def fwd_bwd(fn, *xs):
        xs = [x.detach().requires_grad_(True) for x in xs]
        out = fn(*xs)
        out.backward(dl if out.shape[2] != N else dout)
        return [out.detach()] + [x.grad for x in xs]

    # the peer, in this run: single-process attention on the whole sequence, timed on rank 0
    # with every core while the other ranks wait
    single = lambda: fwd_bwd(lambda a_, b_, c_: keyfold.attention(a_, b_, c_, mask=mask), q, k, v)  # noqa: E731
    want = [shard(t, layout=layout) for t in single()]
    t_full = 0.0
    if rank == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        _, t_full = _timed(single, a.repeat)
        torch.set_num_threads(threads)
    dist.barrier()
    if rank == 0:
        print(f"{P} ranks ({'NCCL' if cuda else 'gloo'}), N={N}, H={a.heads}/{a.kv_heads}, d={a.head_dim}, "
              f"{layout.name}, mask {a.mask}: forward + backward")
        print(f"  single process, whole sequence, all cores: {t_full * 1e3:8.1f} ms")
    rows = []
    for strategy in Strategy:
        if strategy is Strategy.ALL_TO_ALL and a.heads % P:
            continue
        dist.barrier()
        got, t = _timed(lambda: fwd_bwd(lambda a_, b_, c_: ring_attention(
            a_, b_, c_, mask=mask, layout=layout, strategy=strategy), ql, kl, vl), a.repeat)
        err = torch.tensor([float((x - y).abs().max()) for x, y in zip(got, want)], device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        t_max = torch.tensor([t], device=device)
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        t = float(t_max)
        if rank == 0:
            names = ("out", "dq", "dk", "dv")
            rows.append({"strategy": strategy.name, "seconds": t, "ratio": t / t_full,
                         "max_abs_error": dict(zip(names, err.tolist()))})
            print(f"  {strategy.name:<10}: {t * 1e3:8.1f} ms ({t / t_full:.2f}x single process)  max |error| "
                  + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, err.tolist())))

    # decoding: rank r holds cache positions [r*n, (r+1)*n); one new query token
    n = N // P
    q1 = torch.randn(1, a.heads, 1, a.head_dim, generator=g).to(device)
    out = tree_decode(q1, k[:, :, rank * n:(rank + 1) * n], v[:, :, rank * n:(rank + 1) * n])
    ref = keyfold.attention(q1, k, v)
    if rank == 0:
        print(f"  tree_decode of one token over {P} cache shards: max |error| {float((out - ref).abs().max()):.1e}")
    if rank == 0 and a.out is not None:
        _write(a, P, "cuda" if cuda else "cpu", t_full, rows, float((out - ref).abs().max()))
    dist.destroy_process_group()


def _write(a, P, device, t_full, rows, decode_err):
    """Markdown + JSON + PNG of this run (ratios against the single process measured in it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"ring_{device}_{a.layout}_{a.mask}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    setup = (f"{P} ranks ({device}), N={a.tokens}, H={a.heads}/{a.kv_heads}, d={a.head_dim}, layout {a.layout}, "
             f"mask {a.mask}, forward + backward, {a.repeat} repeats; load average {load:.1f} on "
             f"{os.cpu_count()} cores")
    lines = [f"# ring attention, {setup}", "",
             f"Single process on the whole sequence (same run, rank 0, all cores): {t_full * 1e3:.1f} ms", "",
             "| strategy | ms (slowest rank) | x single process | max abs error out / dq / dk / dv |", "|---|---|---|---|"]
    for r in rows:
        e = r["max_abs_error"]
        lines.append(f"| {r['strategy']} | {r['seconds'] * 1e3:.1f} | {r['ratio']:.2f} | "
                     f"{e['out']:.1e} / {e['dq']:.1e} / {e['dk']:.1e} / {e['dv']:.1e} |")
    lines += ["", f"tree_decode, one token over {P} cache shards: max abs error {decode_err:.1e}", "",
              f"Command: `torchrun --nproc_per_node {P} examples/ring_attention_torchrun.py --tokens {a.tokens} "
              f"--layout {a.layout} --mask {a.mask} --repeat {a.repeat} --out {a.out}`"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"setup": setup, "single_process_s": t_full, "rows": rows,
                                                     "tree_decode_error": decode_err}, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["strategy"] for r in rows], [r["ratio"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("time / single process (same run)")
    ax.set_title(setup[:70] + "...", fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)
    print(f"  wrote {stem}.md, .json, .png")


if __name__ == "__main__":
    main()
