"""``python -m keyfold translate``: translate German with a checkpoint, or score it on the test split.

    python -m keyfold translate --checkpoint runs/cpu "ein Satz" "guten Morgen"
    python -m keyfold translate --checkpoint runs/cpu --test     # BLEU/chrF vs the two baselines

``--test`` writes into ``<checkpoint>/test/`` (or ``--out``): every hypothesis (``hyp.txt``) beside
its source (``src.txt``) and references (``ref.txt``: all of a phrase's references, tab-separated),
``scores.json`` (BLEU, chrF, sacrebleu signatures, empty outputs), and
``translate.{md,json,png}``: the model next to the copy and word-by-word baselines on the same
split, and the training curve. ``--rescore DIR`` recomputes the scores from those files with
sacrebleu alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from . import baselines as _bl
from . import data as _data
from . import train as _train
from .data import EOS, PAD
from .transformer import ModelConfig, Transformer, beam_search, greedy

__all__ = ["average_state", "load_checkpoint", "translate", "evaluate", "write_test_files", "rescore", "main"]

def average_state(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the model tensors of several checkpoint files (float64 sums)."""
    from safetensors.torch import load_file

    total: dict[str, torch.Tensor] = {}
    for path in paths:
        for k, v in load_file(str(path)).items():
            if k.startswith("model."):
                total[k[6:]] = total[k[6:]] + v.double() if k[6:] in total else v.double()
    return {k: (v / len(paths)).float() for k, v in total.items()}


def load_checkpoint(run_dir: str | Path, *, average: int = 1) -> tuple[Transformer, dict]:
    """The model of ``run_dir/checkpoint.json`` (eval mode) and the checkpoint's JSON.

    ``average=k``: the mean of the weights of the last ``k`` checkpoints the run kept (the paper
    averages the last 5 for base, 20 for big); ``meta["averaged"]`` names them.
    """
    run_dir = Path(run_dir)
    meta_path = run_dir / "checkpoint.json" if run_dir.is_dir() else run_dir
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} is missing: pass the run folder written by "
                                f"`python -m keyfold train translate` (e.g. runs/cpu)")
    meta = json.loads(meta_path.read_text())
    kept = meta.get("kept", [meta["weights"]])
    if average < 1:
        raise ValueError(f"--average must be >= 1, got {average}")
    if average > len(kept):
        raise ValueError(f"--average {average}: {meta_path.parent} keeps only {len(kept)} checkpoint(s) "
                         f"({', '.join(kept)}); pass --average {len(kept)} or less, or train with a larger keep")
    names = kept[-average:]
    missing = [n for n in names if not (meta_path.parent / n).exists()]
    if missing:
        raise FileNotFoundError(f"{meta_path} lists {missing} but they are not in {meta_path.parent}")
    model = Transformer(ModelConfig(**meta["model_config"]))
    model.load_state_dict(average_state([meta_path.parent / n for n in names]))
    meta["averaged"] = names
    return model.eval(), meta


def translate(model: Transformer, tok: _data.Tokenizer, texts: list[str], *, beam: int = 4,
              alpha: float = 0.6, batch_size: int = 64, progress: bool = False,
              device: str | torch.device = "cpu", dtype: str | torch.dtype = "fp32",
              max_len: int | None = None) -> list[str]:
    """Translate German strings (batched by length; ``beam=1`` is greedy; output at most input + 50
    tokens unless ``max_len``, and never past the model's ``cfg.max_len``). ``dtype="bf16"`` decodes
    under bf16 autocast on ``device``. An input longer than the model's positions (``cfg.max_len - 1``
    tokens and EOS) is cut there, with a warning naming how many inputs were (until 2026-12-07 every
    input was cut at ``cfg.max_len // 2 - 1`` tokens, 127 for ``cpu``/``base``, silently)."""
    from tqdm import tqdm

    device, dtype = _train.resolve_device(device), _train.resolve_dtype(dtype)
    model = model.to(device)
    ids = _data.source_ids(tok.encode(texts), model.cfg.max_len)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str | None] = [None] * len(ids)
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, disable=not progress, unit="batch", desc=f"decoding, beam {beam}"):
        idx = order[s:s + batch_size]
        src = torch.nn.utils.rnn.pad_sequence([torch.tensor(ids[i]) for i in idx], batch_first=True,
                                              padding_value=PAD).to(device)
        with _train.autocast(device, dtype):
            hyp = (greedy(model, src, max_len) if beam == 1
                   else beam_search(model, src, beam=beam, alpha=alpha, max_len=max_len))
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


def evaluate(model, tok, data_dir: Path, *, beam: int, alpha: float = 0.6, limit: int | None = None,
             device="cpu", dtype="fp32", split: str = "test") -> dict:
    """Model and both baselines on the ``split`` (same examples, same references); the result holds
    every hypothesis (``hyps``) and the examples (``examples``) for :func:`write_test_files`."""
    test = _data.load_split(data_dir, split)[:limit]
    train = _data.load_split(data_dir, "train")
    t = time.perf_counter()
    hyps = translate(model, tok, [ex.german for ex in test], beam=beam, alpha=alpha, progress=True,
                     device=device, dtype=dtype)
    decode_s = time.perf_counter() - t
    model_scores = _bl.score(hyps, test)
    model_scores["empty"] = sum(not h.strip() for h in hyps)
    systems = {"transformer": model_scores,
               "copy source": _bl.score(_bl.copy_source(test), test),
               "word by word": _bl.score(_bl.WordByWord(train)(test), test)}
    samples = [{"de": ex.german, "model": h, "refs": list(ex.english[:3])} for ex, h in zip(test[:20], hyps[:20])]
    return {"split": split, "systems": systems, "decode_seconds": round(decode_s, 1), "beam": beam, "alpha": alpha,
            "samples": samples, "hyps": hyps, "examples": test,
            "cache_check": cache_check(model.cpu(), tok, [ex.german for ex in test[:64]])}


def write_test_files(out: Path, hyps: list[str], examples, scores: dict) -> None:
    """``hyp.txt``, ``src.txt``, ``ref.txt`` (a phrase's references tab-separated), ``scores.json``."""
    out.mkdir(parents=True, exist_ok=True)
    bad = [t for t in [*hyps, *(ex.german for ex in examples), *(e for ex in examples for e in ex.english)]
           if "\n" in t or "\t" in t or "\r" in t]
    if bad:
        raise ValueError(f"{bad[0]!r} holds a tab or line break and would not read back from the text files")
    for name, lines in (("hyp.txt", hyps), ("src.txt", [ex.german for ex in examples]),
                        ("ref.txt", ["\t".join(ex.english) for ex in examples])):
        tmp = out / (name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
        os.replace(tmp, out / name)
    tmp = out / "scores.json.tmp"
    tmp.write_text(json.dumps(scores, indent=1))
    os.replace(tmp, out / "scores.json")


def rescore(folder: str | Path) -> dict:
    """BLEU and chrF of ``folder/hyp.txt`` against ``folder/ref.txt`` with sacrebleu alone (what
    :func:`write_test_files` wrote; compare with ``folder/scores.json``)."""
    import sacrebleu.metrics

    folder = Path(folder)
    hyps = (folder / "hyp.txt").read_text(encoding="utf-8").split("\n")[:-1]
    refs = [ln.split("\t") for ln in (folder / "ref.txt").read_text(encoding="utf-8").split("\n")[:-1]]
    if len(hyps) != len(refs):
        raise ValueError(f"{folder}: {len(hyps)} hypotheses but {len(refs)} reference lines")
    n = max(map(len, refs))
    streams = [[r[i] if i < len(r) else None for r in refs] for i in range(n)]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    return {"bleu": round(bleu.corpus_score(hyps, streams).score, 2),
            "chrf": round(chrf.corpus_score(hyps, streams).score, 2), "n": len(hyps),
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature()),
            "empty": sum(not h.strip() for h in hyps)}


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
    lines = [f"# Transformer on German-English dictionary phrases ({res.get('split', 'test')} split, "
             f"{model['n']} phrases)", "",
             "Reproduce (data, training, this table):", "",
             "```sh", "make data",
             f".venv/bin/python -m keyfold train translate --config {res.get('config', {}).get('name', 'cpu')}",
             ".venv/bin/" + res["command"].replace("python", "python", 1), "```", "",
             "| system | BLEU | chrF | BLEU / model | chrF / model |", "|---|---|---|---|---|"]
    for name, s in sys_.items():
        rb = s["bleu"] / model["bleu"] if model["bleu"] else float("nan")
        rc = s["chrf"] / model["chrf"] if model["chrf"] else float("nan")
        lines.append(f"| {name} | {s['bleu']:.2f} | {s['chrf']:.2f} | {rb:.2f} | {rc:.2f} |")
    tr = res.get("training", {})
    lines += ["", f"sacrebleu: BLEU `{model['bleu_signature']}`, chrF `{model['chrf_signature']}`",
              f"Decoding: beam {res['beam']}, length penalty {res['alpha']}, weights averaged over "
              f"{len(res.get('averaged', [1]))} checkpoint(s), {res['decode_seconds']} s for the split, "
              f"{model.get('empty', 0)} empty outputs of {model['n']}.",
              f"Training: {tr.get('steps')} steps, {tr.get('tokens')} tokens, {tr.get('train_seconds')} s, "
              f"final validation loss {tr.get('final_valid_loss') or float('nan'):.3f}; config {res.get('config')}.",
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
    p.add_argument("--checkpoint", type=Path, help="run folder (or its checkpoint.json)")
    p.add_argument("--data", type=Path, default=Path("data/deu-eng"), help="prepared data folder (tokenizer, splits)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty exponent (GNMT)")
    p.add_argument("--average", type=int, default=1, help="average the weights of the last k kept checkpoints")
    p.add_argument("--test", action="store_true", help="score on the test split against the baselines")
    p.add_argument("--split", default="test", choices=["test", "valid"], help="the split --test scores")
    p.add_argument("--limit", type=int, default=None, help="only the first N test phrases")
    p.add_argument("--out", type=Path, default=None, help="where --test writes (default <checkpoint>/<split>)")
    p.add_argument("--rescore", type=Path, default=None, metavar="DIR",
                   help="recompute BLEU/chrF from DIR/hyp.txt and DIR/ref.txt with sacrebleu, then stop")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--dtype", default="fp32", choices=sorted(_train.DTYPES), help="bf16: decode under autocast")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args(argv)
    if args.rescore is not None:
        res = rescore(args.rescore)
        print(json.dumps(res, indent=1))
        return 0
    if args.checkpoint is None:
        p.error("--checkpoint is required (the run folder, e.g. runs/cpu)")
    if not args.texts and not args.test:
        p.error("give German phrases to translate, or --test")
    device, dtype = _train.resolve_device(args.device), _train.resolve_dtype(args.dtype)
    torch.set_num_threads(args.threads)
    model, meta = load_checkpoint(args.checkpoint, average=args.average)
    tok = _data.Tokenizer(args.data / "spm.model")
    if tok.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"the tokenizer in {args.data} has {tok.vocab_size} pieces but the checkpoint "
                         f"expects {model.cfg.vocab_size}; pass the --data folder it was trained with")
    kw = dict(beam=args.beam, alpha=args.alpha, device=device, dtype=dtype)
    for de, en in zip(args.texts, translate(model, tok, args.texts, **kw)):
        print(f"{de}\t{en}")
    if args.test:
        if args.limit is not None and args.limit < 1:
            raise SystemExit(f"--limit {args.limit}: BLEU needs at least one phrase; pass --limit N with N >= 1, or "
                             f"leave it out for the whole split")
        run_dir = args.checkpoint if args.checkpoint.is_dir() else args.checkpoint.parent
        out = args.out or run_dir / args.split
        res = evaluate(model, tok, args.data, limit=args.limit, split=args.split, **kw)
        hyps, examples = res.pop("hyps"), res.pop("examples")
        res["training"] = _training_summary(run_dir)
        res["config"] = {"name": run_dir.name, **meta["train_config"]}
        res["averaged"] = meta["averaged"]
        res["device"], res["dtype"] = str(device), str(dtype).replace("torch.", "")
        res["command"] = "python -m keyfold translate " + " ".join(
            ["--checkpoint", str(args.checkpoint), "--test", f"--beam {args.beam}", f"--average {args.average}"]
            # every setting the scores depend on (--alpha, --data, --dtype, --device were left out: rerunning
            # the printed command after --alpha 1.5 decoded with 0.6; a review, 2026-12-07)
            + ([f"--alpha {args.alpha}"] if args.alpha != 0.6 else [])
            + ([f"--data {args.data}"] if args.data != Path("data/deu-eng") else [])
            + ([f"--dtype {args.dtype}"] if args.dtype != "fp32" else [])
            + ([f"--device {args.device}"] if args.device != "cpu" else [])
            + ([f"--split {args.split}"] if args.split != "test" else [])
            + ([f"--limit {args.limit}"] if args.limit else []) + ([f"--out {args.out}"] if args.out else []))
        write_test_files(out, hyps, examples, {**res["systems"]["transformer"], "split": args.split,
                                               "beam": args.beam, "alpha": args.alpha, "averaged": meta["averaged"]})
        _write_results(res, out)
        for name, s in res["systems"].items():
            print(f"{name:>14}: BLEU {s['bleu']:6.2f}  chrF {s['chrf']:6.2f}")
        m = res["systems"]["transformer"]
        print(f"empty outputs: {m['empty']} of {m['n']}; decoding took {res['decode_seconds']} s")
        print(f"wrote {out}/hyp.txt, src.txt, ref.txt, scores.json, translate.md, .json, .png")
    return 0
