"""torch.compile: a small Llama-like train step, keyfold vs SDPA, eager and compiled.

Each of the four variants (keyfold / SDPA x eager / compiled) trains its own copy of one model
(same weights, same batch). Reported: compile time (the first compiled step minus an eager
step), graph breaks counted by ``torch._dynamo.explain``, and the median step time over
alternating repeats (:func:`keyfold.bench.harness.interleaved`). Writes ``compile[.quick].md``
and ``.json`` under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ..engine import attention
from ..masks import causal
from .harness import interleaved, machine, results_dir, write_json


@dataclass(frozen=True)
class Config:
    vocab: int = 512
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2   # GQA, as Llama
    n_layers: int = 2
    seq: int = 256
    batch: int = 4


class _Block(nn.Module):
    def __init__(self, c: Config, impl: str):
        super().__init__()
        self.c, self.impl = c, impl
        hd = c.d_model // c.n_heads
        self.qkv = nn.Linear(c.d_model, (c.n_heads + 2 * c.n_kv_heads) * hd, bias=False)
        self.o = nn.Linear(c.d_model, c.d_model, bias=False)
        self.up = nn.Linear(c.d_model, 2 * 4 * c.d_model, bias=False)  # SwiGLU
        self.down = nn.Linear(4 * c.d_model, c.d_model, bias=False)
        self.n1, self.n2 = nn.RMSNorm(c.d_model), nn.RMSNorm(c.d_model)

    def forward(self, x):
        c = self.c
        B, N, _ = x.shape
        hd = c.d_model // c.n_heads
        q, k, v = self.qkv(self.n1(x)).split([c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd], -1)
        q = q.view(B, N, c.n_heads, hd).transpose(1, 2)                 # (B, H, N, D)
        k = k.view(B, N, c.n_kv_heads, hd).transpose(1, 2)              # (B, Hkv, N, D)
        v = v.view(B, N, c.n_kv_heads, hd).transpose(1, 2)
        if self.impl == "keyfold":
            a = attention(q, k, v, mask=causal())
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, N, c.d_model))
        g, u = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class TinyLlama(nn.Module):
    def __init__(self, c: Config, impl: str):
        super().__init__()
        self.emb = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(_Block(c, impl) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.d_model)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.norm(x) @ self.emb.weight.t()


def _step_fn(model, ids, compiled: bool, backend: str):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fwd = torch.compile(model, fullgraph=True, backend=backend) if compiled else model

    def step():
        logits = fwd(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def run(c: Config, backend: str, repeats: int) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, c.vocab, (c.batch, c.seq + 1))
    base = TinyLlama(c, "sdpa")
    rows, steps = {}, {}
    for impl in ("keyfold", "sdpa"):
        model_e = TinyLlama(c, impl)
        model_e.load_state_dict(base.state_dict())
        model_c = TinyLlama(c, impl)
        model_c.load_state_dict(base.state_dict())
        breaks = torch._dynamo.explain(model_c)(ids[:, :-1]).graph_break_count
        torch._dynamo.reset()
        eager = _step_fn(model_e, ids, False, backend)
        comp = _step_fn(model_c, ids, True, backend)
        t0 = time.perf_counter()
        loss_e = eager()
        t_eager = time.perf_counter() - t0
        t0 = time.perf_counter()
        loss_c = comp()
        t_first = time.perf_counter() - t0
        rows[impl] = dict(graph_breaks=breaks, compile_s=round(max(0.0, t_first - t_eager), 2),
                          first_loss_eager=loss_e, first_loss_compiled=loss_c)
        steps[f"{impl} eager"], steps[f"{impl} compiled"] = eager, comp
    t = interleaved(steps, repeats=repeats, warmup=1)
    for name, sec in t.items():
        impl, mode = name.split()
        rows[impl][f"{mode}_step_ms"] = round(1e3 * sec, 2)
    return rows


def write(res: dict, cfg: dict, out: Path, stem: str, cmd: str) -> Path:
    write_json(out / f"{stem}.json", dict(config=cfg, results=res))
    sdpa_c = res["sdpa"]["compiled_step_ms"]
    lines = [f"# torch.compile: a small Llama-like train step (`{cmd}`)", "",
             f"Machine: {cfg['machine']}. Backend `{cfg['backend']}`, fullgraph=True. Model: {cfg['model']}.", "",
             "| attention | graph breaks | compile (s) | eager step (ms) | compiled step (ms) | compiled vs SDPA compiled |",
             "|---|---|---|---|---|---|"]
    for impl, r in res.items():
        lines.append(f"| {impl} | {r['graph_breaks']} | {r['compile_s']} | {r['eager_step_ms']} | "
                     f"{r['compiled_step_ms']} | {r['compiled_step_ms'] / sdpa_c:.2f}x |")
    lines += ["", "Compile time is the first compiled step minus one eager step; step times are medians of "
              "alternating repeats (the first loss of all four agrees: "
              + ", ".join(f"{k} {v['first_loss_eager']:.4f}/{v['first_loss_compiled']:.4f}" for k, v in res.items())
              + ")."]
    path = out / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold bench compile", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and the aot_eager backend (< 1 minute)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor; aot_eager with --quick)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="results folder (default: the repository's benchmarks/results)")
    args = p.parse_args(argv)
    c = Config(seq=128, batch=2) if args.quick else Config()
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    repeats = args.repeats or (5 if args.quick else 20)
    res = run(c, backend, repeats)
    cfg = dict(machine=machine(), backend=backend, model=str(asdict(c)), repeats=repeats, torch=torch.__version__)
    cmd = "python -m keyfold bench compile" + (" --quick" if args.quick else "") + \
        (f" --backend {args.backend}" if args.backend else "")
    stem = "compile.quick" if args.quick else "compile"
    if args.backend:  # a backend chosen by hand gets its own file (the quick aot_eager one stays)
        stem += f".{backend}"
    print(write(res, cfg, results_dir(args.out), stem, cmd))
    assert all(math.isfinite(r["first_loss_compiled"]) for r in res.values())
    return 0
