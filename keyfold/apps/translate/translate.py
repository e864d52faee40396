"""``python -m keyfold translate``: translate German with a checkpoint, or score it on the test split.

    python -m keyfold translate --checkpoint runs/cpu "ein Satz" "guten Morgen"
    python -m keyfold translate --checkpoint runs/cpu --test     # BLEU/chrF vs the two baselines

``--test`` writes benchmarks/results/translate.{md,json,png}: the model's sacrebleu BLEU and chrF
next to the copy and word-by-word baselines on the same split, the training curve, and the ratio
of each baseline's score to the model's (peers measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from . import baselines as _bl
from . import data as _data
from .data import EOS, PAD
from .transformer import ModelConfig, Transformer, beam_search, greedy

__all__ = ["load_checkpoint", "translate", "evaluate", "main"]

RESULTS = Path("benchmarks/results")


def load_checkpoint(run_dir: str | Path) -> tuple[Transformer, dict]:
    """The model of ``run_dir/checkpoint.json`` (eval mode) and the checkpoint's JSON."""
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    meta_path = run_dir / "checkpoint.json" if run_dir.is_dir() else run_dir
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} is missing: pass the run folder written by "
                                f"`python -m keyfold train translate` (e.g. runs/cpu)")
    meta = json.loads(meta_path.read_text())
    model = Transformer(ModelConfig(**meta["model_config"]))
    tensors = load_file(str(meta_path.parent / meta["weights"]))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    return model.eval(), meta


def translate(model: Transformer, tok: _data.Tokenizer, texts: list[str], *, beam: int = 4,
              alpha: float = 0.6, batch_size: int = 64, progress: bool = False) -> list[str]:
    """Translate German strings (batched by length; ``beam=1`` is greedy)."""
    from tqdm import tqdm

    ids = [seq[: model.cfg.max_len // 2 - 1] + [EOS] for seq in tok.encode(texts)]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str | None] = [None] * len(ids)
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, disable=not progress, unit="batch", desc=f"beam {beam}"):
        idx = order[s:s + batch_size]
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(ids[i]) for i in idx], batch_first=True,
                                              padding_value=PAD)
        hyp = greedy(model, src) if beam == 1 else beam_search(model, src, beam=beam, alpha=alpha)
        for i, text in zip(idx, tok.decode(hyp.tolist())):
            out[i] = text
    return out  # type: ignore[return-value]


def _training_summary(run_dir: Path) -> dict:
    log = run_dir / "log.jsonl"
    if not log.exists():
        return {}
    recs = [json.loads(ln) for ln in log.read_text().splitlines() if ln]
    return {"steps": recs[-1]["step"], "train_seconds": round(recs[-1]["time"], 1),
            "tokens": sum(r["tokens"] for r in recs),
            "final_valid_loss": next((r["valid_loss"] for r in reversed(recs) if "valid_loss" in r), None),
            "curve": [(r["step"], r["loss"]) for r in recs],
            "valid_curve": [(r["step"], r["valid_loss"]) for r in recs if "valid_loss" in r]}


def evaluate(model, tok, data_dir: Path, *, beam: int, limit: int | None = None) -> dict:
    """Model and both baselines on the test split (same examples, same references)."""
    test = _data.load_split(data_dir, "test")[:limit]
    train = _data.load_split(data_dir, "train")
    t = time.perf_counter()
    hyps = translate(model, tok, [ex.german for ex in test], beam=beam, progress=True)
    decode_s = time.perf_counter() - t
    systems = {"transformer": _bl.score(hyps, test),
               "copy source": _bl.score(_bl.copy_source(test), test),
               "word by word": _bl.score(_bl.WordByWord(train)(test), test)}
    samples = [{"de": ex.german, "model": h, "refs": list(ex.english[:3])} for ex, h in zip(test[:20], hyps[:20])]
    return {"systems": systems, "decode_seconds": round(decode_s, 1), "beam": beam, "samples": samples,
            "cache_check": cache_check(model, tok, [ex.german for ex in test[:64]])}


def cache_check(model, tok, texts: list[str], max_len: int = 24) -> dict:
    """Greedy decoding with the KV caches vs re-running the decoder over the prefix (same tokens?)."""
    ids = [seq[:30] + [EOS] for seq in tok.encode(texts)]
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in ids], batch_first=True, padding_value=PAD)
    t = time.perf_counter()
    cached = greedy(model, src, max_len=max_len)
    t_cached = time.perf_counter() - t
    t = time.perf_counter()
    full = greedy(model, src, max_len=max_len, use_cache=False)
    t_full = time.perf_counter() - t
    return {"phrases": len(texts), "steps": cached.shape[1], "cached_s": round(t_cached, 2),
            "recompute_s": round(t_full, 2), "identical": bool(torch.equal(cached, full))}


def _write_results(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "translate.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    sys_ = res["systems"]
    model = sys_["transformer"]
    lines = [f"# Transformer on German-English dictionary phrases (test split, {model['n']} phrases)", "",
             "Reproduce (data, training, this table):", "",
             "```sh", "python -m keyfold train translate --prepare",
             f"python -m keyfold train translate --config {res.get('config', {}).get('name', 'cpu')}",
             res["command"], "```", "",
             "| system | BLEU | chrF | BLEU / model | chrF / model |", "|---|---|---|---|---|"]
    for name, s in sys_.items():
        rb = s["bleu"] / model["bleu"] if model["bleu"] else float("nan")
        rc = s["chrf"] / model["chrf"] if model["chrf"] else float("nan")
        lines.append(f"| {name} | {s['bleu']:.2f} | {s['chrf']:.2f} | {rb:.2f} | {rc:.2f} |")
    tr = res.get("training", {})
    lines += ["", f"sacrebleu: BLEU `{model['bleu_signature']}`, chrF `{model['chrf_signature']}`",
              f"Decoding: beam {res['beam']}, {res['decode_seconds']} s for the split.",
              f"Training: {tr.get('steps')} steps, {tr.get('tokens')} tokens, {tr.get('train_seconds')} s, "
              f"final validation loss {tr.get('final_valid_loss'):.3f}; config {res.get('config')}.",
              f"KV-cache check (greedy, {res['cache_check']['phrases']} phrases, {res['cache_check']['steps']} steps): "
              f"cached {res['cache_check']['cached_s']} s, re-running the prefix {res['cache_check']['recompute_s']} s, "
              f"identical tokens: {res['cache_check']['identical']}.",
              "", "| German | model | references |", "|---|---|---|"]
    lines += [f"| {s['de']} | {s['model']} | {' / '.join(s['refs'])} |" for s in res["samples"]]
    (out / "translate.md").write_text("\n".join(lines) + "\n")

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if tr.get("curve"):
        steps, loss = zip(*tr["curve"])
        a.plot(steps, loss, lw=0.6, label="train (per batch)")
        if tr.get("valid_curve"):
            vs, vl = zip(*tr["valid_curve"])
            a.plot(vs, vl, "o-", label="validation")
        a.set_xlabel("step")
        a.set_ylabel("label-smoothed loss per token")
        a.legend()
        a.set_title("training")
    names = list(sys_)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [sys_[n]["bleu"] for n in names], 0.4, label="BLEU")
    b.bar([i + 0.2 for i in x], [sys_[n]["chrf"] for n in names], 0.4, label="chrF")
    b.set_xticks(list(x), names)
    b.set_title(f"test split, {model['n']} phrases")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "translate.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold translate", description=__doc__.split("\n\n")[0])
    p.add_argument("texts", nargs="*", help="German phrases to translate")
    p.add_argument("--checkpoint", type=Path, required=True, help="run folder (or its checkpoint.json)")
    p.add_argument("--data", type=Path, default=Path("data/deu-eng"), help="prepared data folder (tokenizer, splits)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent")
    p.add_argument("--test", action="store_true", help="score on the test split against the baselines")
    p.add_argument("--limit", type=int, default=None, help="only the first N test phrases")
    p.add_argument("--out", type=Path, default=RESULTS, help="where --test writes translate.{md,json,png}")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    if not args.texts and not args.test:
        p.error("give German phrases to translate, or --test")
    torch.set_num_threads(args.threads)
    model, meta = load_checkpoint(args.checkpoint)
    tok = _data.Tokenizer(args.data / "spm.model")
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the tokenizer in {args.data} has {tok.vocab_size} pieces but the checkpoint "
                         f"expects {model.cfg.vocab_size}; pass the --data folder it was trained with")
    for de, en in zip(args.texts, translate(model, tok, args.texts, beam=args.beam, alpha=args.alpha)):
        print(f"{de}\t{en}")
    if args.test:
        res = evaluate(model, tok, args.data, beam=args.beam, limit=args.limit)
        run_dir = args.checkpoint if args.checkpoint.is_dir() else args.checkpoint.parent
        res["training"] = _training_summary(run_dir)
        res["config"] = {"name": run_dir.name, **meta["train_config"]}
        res["command"] = "python -m keyfold translate " + " ".join(
            a for a in ["--checkpoint", str(args.checkpoint), "--test", f"--beam {args.beam}"]
            + ([f"--limit {args.limit}"] if args.limit else []))
        _write_results(res, args.out)
        for name, s in res["systems"].items():
            print(f"{name:>14}: BLEU {s['bleu']:6.2f}  chrF {s['chrf']:6.2f}")
        print(f"wrote {args.out}/translate.md, .json, .png")
    return 0

