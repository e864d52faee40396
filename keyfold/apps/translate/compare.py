"""``python -m keyfold train compare``: the paper's Table 2 on our data, at one wall-clock budget.

Three encoder-decoders train for the same minutes on the same split, batches and recipe
(``--config``: Adam, warm-up, label smoothing, batch size):

- ``keyfold``: :class:`~keyfold.apps.translate.transformer.Transformer` (every attention a
  ``keyfold.attention`` call);
- ``torch``: ``torch.nn.Transformer`` with the same sizes (layers, d_model, heads, d_ff, dropout,
  pre-/post-LN) and the same shared, scaled, tied embedding and sinusoidal positions;
- ``gru``: a bidirectional GRU encoder and a GRU decoder with additive attention (Bahdanau et
  al., 2015), embedding and hidden width d_model, the same tied embedding.

Every ``--eval-minutes`` of training, each model greedily decodes the first ``--valid-phrases``
validation phrases (chrF); after the budget, the whole test split (BLEU, chrF). Writes
``compare.{md,json,png}`` into ``--out`` (default ``runs/compare``): the table (BLEU, chrF,
parameters, training minutes, steps, tokens/s) and validation chrF against training minutes.

    python -m keyfold train compare --minutes 10          # 3 x 10 minutes + decoding
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from . import baselines as _bl
from . import data as _data
from . import train as _train
from .data import PAD, source_ids
from .transformer import MODEL_CONFIGS, ModelConfig, Transformer, _Embedding, greedy

__all__ = ["TorchTransformer", "GRUAttention", "SYSTEMS", "greedy_recompute", "compare", "main"]


class TorchTransformer(nn.Module):
    """``torch.nn.Transformer`` with the sizes of a :class:`ModelConfig` and keyfold's embedding
    (shared, scaled by sqrt(d_model), sinusoidal positions, tied output); batch-first."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = _Embedding(cfg)
        self.core = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers,
                                   cfg.d_ff, cfg.dropout, batch_first=True, norm_first=cfg.norm_first)

    def encode(self, src):
        pad = src.eq(PAD)
        return self.core.encoder(self.embed(src), src_key_padding_mask=pad), pad

    def decode(self, tgt_in, memory, pad):
        T = tgt_in.shape[1]
        causal = torch.triu(torch.full((T, T), True, device=tgt_in.device), 1)
        h = self.core.decoder(self.embed(tgt_in), memory, tgt_mask=causal, memory_key_padding_mask=pad,
                              tgt_is_causal=True)
        return self.embed.logits(h)

    def forward(self, src, tgt_in):
        return self.decode(tgt_in, *self.encode(src))


class GRUAttention(nn.Module):
    """Bahdanau et al. (2015): a bidirectional GRU encoder, a GRU decoder whose input at each step is
    the previous token and the attention context of the previous state, additive attention
    ``v^T tanh(W s + U h_j)`` over the encoder states, logits from the tied embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        self.encoder = nn.GRU(d, d // 2, batch_first=True, bidirectional=True)
        self.init = nn.Linear(d, d)
        self.cell = nn.GRUCell(2 * d, d)
        self.W, self.U, self.v = nn.Linear(d, d, bias=False), nn.Linear(d, d), nn.Linear(d, 1, bias=False)
        self.out = nn.Linear(3 * d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def encode(self, src):
        pad = src.eq(PAD)
        lengths = (~pad).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.drop(self.embed(src)), lengths, batch_first=True,
                                                   enforce_sorted=False)
        h, _ = self.encoder(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=src.shape[1])  # (B, S, d)
        mean = (h * (~pad).unsqueeze(-1)).sum(1) / lengths.to(h.device).unsqueeze(-1)
        return h, self.U(h), pad, torch.tanh(self.init(mean))

    def _attend(self, s, keys, h, pad):
        e = self.v(torch.tanh(self.W(s).unsqueeze(1) + keys)).squeeze(-1)  # (B, S)
        e = e.masked_fill(pad, -math.inf)
        return (torch.softmax(e, -1).unsqueeze(-1) * h).sum(1)            # (B, d)

    def decode(self, tgt_in, h, keys, pad, s):
        outs = []
        for t in range(tgt_in.shape[1]):
            ctx = self._attend(s, keys, h, pad)
            y = self.drop(self.embed(tgt_in[:, t]))
            s = self.cell(torch.cat([y, ctx], -1), s)
            ctx = self._attend(s, keys, h, pad)
            outs.append(self.out(self.drop(torch.cat([s, ctx, y], -1))))
        return torch.stack(outs, 1) @ self.embed.weight.t()  # (B, T, V)

    def forward(self, src, tgt_in):
        return self.decode(tgt_in, *self.encode(src))


SYSTEMS = {"keyfold": Transformer, "torch": TorchTransformer, "gru": GRUAttention}


def greedy_recompute(model, src: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """Greedy decoding of any of :data:`SYSTEMS`, re-running the decoder over the prefix each step."""
    return greedy(model, src, max_len, use_cache=False)


def _keyfold_decode(model, src, max_len=None):
    from .transformer import greedy

    return greedy(model, src, max_len)


def decode_texts(model, tok, texts: list[str], batch_size: int = 128) -> list[str]:
    """Greedy translations of German strings (batched by length)."""
    model.eval()
    fn = _keyfold_decode if isinstance(model, Transformer) else greedy_recompute
    ids = source_ids(tok.encode(texts), model.cfg.max_len)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        src = nn.utils.rnn.pad_sequence([torch.tensor(ids[i]) for i in idx], batch_first=True, padding_value=PAD)
        for i, text in zip(idx, tok.decode(fn(model, src).tolist())):
            out[i] = text
    return out


def _chrf(hyps, examples) -> float:
    return _bl.score(hyps, examples)["chrf"]


#: How training time is counted: wall-clock seconds, or the process's CPU seconds.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def compare(cfg: _train.TrainConfig, model_cfg: ModelConfig, tok, train_pairs, valid, test, out: Path, *,
            minutes: float, eval_minutes: float, valid_phrases: int = 400, systems=tuple(SYSTEMS),
            progress: bool = True, clock: str = "wall") -> dict:
    """Train each system for ``minutes`` of training time (evaluations excluded) and score it.

    ``clock="wall"`` counts wall-clock seconds; ``clock="cpu"`` counts the process's CPU seconds
    (``time.process_time``), the same on a quiet machine and the fair budget on a shared one,
    where other jobs would otherwise take a different share from each system."""
    from tqdm import tqdm

    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: choose one of {sorted(CLOCKS)}")
    now = CLOCKS[clock]

    torch.set_num_threads(cfg.threads)
    valid = valid[:valid_phrases]
    results = {}
    for name in systems:
        run = out / name
        trainer = _train.Trainer(cfg, model_cfg, run, train_pairs, [], model_factory=SYSTEMS[name])
        params = sum(p.numel() for p in trainer.model.parameters())
        curve, trained, tokens, next_eval = [], 0.0, 0, eval_minutes * 60
        bar = tqdm(total=round(minutes * 60), desc=f"{name} ({params / 1e6:.1f} M parameters)", unit="s",
                   disable=not progress, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s "
                   "of training [{elapsed}<{remaining}]{postfix}")
        while trained < minutes * 60 and trainer.step < cfg.steps:
            t = now()
            loss, n = trainer.train_step()
            trained += now() - t
            tokens += n
            bar.n = min(round(trained), bar.total)
            bar.set_postfix(step=trainer.step, loss=f"{loss:.2f}", tok_s=f"{tokens / trained:,.0f}", refresh=True)
            if trained >= next_eval or trained >= minutes * 60:
                chrf = _chrf(decode_texts(trainer.model, tok, [ex.german for ex in valid]), valid)
                curve.append((round(trained / 60, 3), chrf))
                bar.write(f"{name}: {trained / 60:.1f} min, step {trainer.step}: validation chrF {chrf:.2f}")
                next_eval += eval_minutes * 60
        if not curve or curve[-1][0] != round(trained / 60, 3):  # the step cap ended training first
            chrf = _chrf(decode_texts(trainer.model, tok, [ex.german for ex in valid]), valid)
            curve.append((round(trained / 60, 3), chrf))
        bar.close()
        t = time.perf_counter()
        hyps = decode_texts(trainer.model, tok, [ex.german for ex in test])
        scores = _bl.score(hyps, test)
        results[name] = {"bleu": scores["bleu"], "chrf": scores["chrf"], "params": params,
                         "train_minutes": round(trained / 60, 2), "steps": trainer.step, "tokens": tokens,
                         "tokens_per_s": round(tokens / max(trained, 1e-9)), "valid_curve": curve,
                         "decode_seconds": round(time.perf_counter() - t, 1),
                         "empty": sum(not h.strip() for h in hyps), "samples": list(zip(
                             [ex.german for ex in test[:8]], hyps[:8]))}
        print(f"{name}: test BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} "
              f"({trainer.step} steps, {results[name]['tokens_per_s']:,} tokens/s)", flush=True)
    return {"systems": results, "signature": {"bleu": scores["bleu_signature"], "chrf": scores["chrf_signature"]},
            "minutes": minutes, "config": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(model_cfg),
            "n_test": len(test), "n_valid": len(valid), "threads": cfg.threads, "clock": clock,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def write_compare(res: dict, out: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    res = {**res, "command": command}
    tmp = out / "compare.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, ensure_ascii=False))
    os.replace(tmp, out / "compare.json")
    best = max(res["systems"], key=lambda n: res["systems"][n]["chrf"])
    mc = res["model_config"]
    lines = [f"# Table 2 on German-English dictionary phrases: {res['minutes']} minutes of training each "
             f"({res.get('clock', 'wall')} time)", "",
             f"`{command}`", "",
             f"Sizes: {mc['n_encoder_layers']}+{mc['n_decoder_layers']} layers, d_model {mc['d_model']}, "
             f"{mc['n_heads']} heads, d_ff {mc['d_ff']}, dropout {mc['dropout']}, "
             f"{'pre' if mc['norm_first'] else 'post'}-LN (GRU: width d_model); recipe `{res['config']['model']}`, "
             f"{res['threads']} thread(s); greedy decoding; test split {res['n_test']} phrases, "
             f"validation chrF on {res['n_valid']} phrases.", "",
             "| system | test BLEU | test chrF | parameters | training min | steps | tokens/s | empty |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in res["systems"].items():
        mark = "**" if name == best else ""
        lines.append(f"| {mark}{name}{mark} | {s['bleu']:.2f} | {s['chrf']:.2f} | {s['params'] / 1e6:.2f} M | "
                     f"{s['train_minutes']:.1f} | {s['steps']} | {s['tokens_per_s']:,} | {s['empty']} |")
    lines += ["", f"Highest test chrF at this budget: **{best}**.",
              f"sacrebleu: BLEU `{res['signature']['bleu']}`, chrF `{res['signature']['chrf']}`."]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, s in res["systems"].items():
        if s["valid_curve"]:
            x, y = zip(*s["valid_curve"])
            ax.plot(x, y, "o-", label=f"{name} ({s['params'] / 1e6:.1f} M)")
    ax.set_xlabel(f"training minutes ({res.get('clock', 'wall')} time)")
    ax.set_ylabel("validation chrF (greedy)")
    ax.set_title("Transformer (keyfold, torch.nn) vs GRU + additive attention")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold train compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu", choices=sorted(_train.TRAIN_CONFIGS), help="recipe and model sizes")
    p.add_argument("--data", type=Path, default=_train.DEFAULT_DATA, help="prepared data folder")
    p.add_argument("--minutes", type=float, default=10.0, help="training minutes per system")
    p.add_argument("--eval-minutes", type=float, default=None, help="minutes between validation points "
                   "(default minutes/5)")
    p.add_argument("--valid-phrases", type=int, default=400, help="validation phrases decoded per point")
    p.add_argument("--test-limit", type=int, default=None, help="only the first N test phrases")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {list(SYSTEMS)}")
    p.add_argument("--out", type=Path, default=_train.DEFAULT_RUNS / "compare", help="output folder")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the recipe's)")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="count training minutes in wall-clock time, or in the process's CPU time (fair on a "
                        "machine shared with other jobs)")
    args = p.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {bad}; choose from {list(SYSTEMS)}")
    if args.minutes <= 0:
        p.error("--minutes must be > 0")
    if not _data.is_prepared(args.data):
        _data.prepare(args.data)
    cfg = _train.TRAIN_CONFIGS[args.config]
    if args.threads is not None:
        cfg = dataclasses.replace(cfg, threads=args.threads)
    tok, train_pairs, _ = _train.load_data(args.data, cfg)
    valid = _data.load_split(args.data, "valid")
    if not valid:
        p.error(f"the validation split of {args.data} is empty: the curve needs validation phrases")
    test = _data.load_split(args.data, "test")[:args.test_limit]
    model_cfg = dataclasses.replace(MODEL_CONFIGS[cfg.model], vocab_size=tok.vocab_size)
    res = compare(cfg, model_cfg, tok, train_pairs, valid, test, args.out, minutes=args.minutes,
                  eval_minutes=args.eval_minutes or args.minutes / 5, valid_phrases=args.valid_phrases,
                  systems=systems, clock=args.clock)
    command = "python -m keyfold train compare " + " ".join(argv)
    write_compare(res, args.out, command.strip())
    print((args.out / "compare.md").read_text())
    return 0
