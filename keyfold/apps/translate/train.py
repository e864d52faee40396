"""``python -m keyfold train translate``: train the Transformer on German-English dictionary pairs.

Seeded and reproducible: the batch order of epoch ``e`` is a function of ``(seed, e)`` only, and
the dropout RNG state is checkpointed, so a run killed and resumed continues the same loss curve.
Checkpoints are written atomically: the weights and Adam moments go to a new safetensors file,
then ``checkpoint.json`` (config, step, position in the data, optimizer settings) is replaced in
one ``os.replace`` — the JSON is the commit point, so a kill at any moment leaves the previous
checkpoint intact.

    python -m keyfold train translate --prepare            # install + parse the data, tokenizer
    python -m keyfold train translate --config cpu         # train (resumes if runs/cpu has a checkpoint)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from torch import nn

from . import data as _data
from .data import BOS, EOS, PAD
from .transformer import MODEL_CONFIGS, ModelConfig, Transformer

__all__ = ["TrainConfig", "TRAIN_CONFIGS", "Trainer", "encode_pairs", "make_batches", "learning_rate", "main"]

DEFAULT_DATA = Path("data/deu-eng")
DEFAULT_RUNS = Path("runs")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training recipe: a model preset and the paper's optimisation settings."""

    model: str = "base"            # key of MODEL_CONFIGS
    steps: int = 100_000           # optimizer steps in total
    batch_tokens: int = 25_000     # per batch: sum over pairs of max(source, target) tokens
    warmup: int = 4000             # linear warm-up steps, then inverse square root decay
    lr_scale: float = 1.0          # lr = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    label_smoothing: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    max_tokens: int = 64           # longer sides are truncated (dictionary phrases are short)
    translations: int | None = None  # train on the first N translations of each phrase (None: all)
    seed: int = 0
    eval_every: int = 1000         # steps between validation runs (and one at every epoch end)
    checkpoint_every: int = 500    # steps between checkpoints (and one at the end)
    threads: int = 2               # torch threads (results are reproducible at a fixed count)


TRAIN_CONFIGS = {
    "base": TrainConfig(),
    "small": TrainConfig(model="small", steps=20_000, batch_tokens=8000),
    # under 30 minutes on the 2 shared CPU cores (docs/transformer.md has the measured time and
    # scores); one thread, because with the cores oversubscribed two threads ran 5x slower
    # and the first translation of each phrase only: sharper targets, more distinct phrases per step
    "cpu": TrainConfig(model="cpu", steps=1000, batch_tokens=2000, warmup=200, lr_scale=0.4,
                       translations=1, eval_every=250, checkpoint_every=100, threads=1),
    "tiny": TrainConfig(model="tiny", steps=40, batch_tokens=64, warmup=10, eval_every=20,
                        checkpoint_every=10, threads=1),
}


def learning_rate(step: int, d_model: int, cfg: TrainConfig) -> float:
    """The paper's schedule (step counts from 1)."""
    step = max(step, 1)
    return cfg.lr_scale * d_model ** -0.5 * min(step ** -0.5, step * cfg.warmup ** -1.5)


# --------------------------------------------------------------------------------- data


def encode_pairs(examples, tok, max_tokens: int, translations: int | None = None):
    """Token id pairs ``(source, target)`` for the (German, English translation) pairs of the examples.

    source: German ids + EOS; target: BOS + English ids + EOS (both truncated to ``max_tokens``).
    translations: use only the first N translations of each phrase (None: all of them).
    """
    des = tok.encode([ex.german for ex in examples])
    flat_en = [en for ex in examples for en in ex.english[:translations]]
    ens = tok.encode(flat_en)
    pairs, j = [], 0
    for ex, de in zip(examples, des):
        src = de[:max_tokens - 1] + [EOS]
        for _ in ex.english[:translations]:
            pairs.append((src, [BOS] + ens[j][:max_tokens - 2] + [EOS]))
            j += 1
    return pairs


def make_batches(pairs, batch_tokens: int, seed: int, epoch: int, pool: int = 100):
    """Index lists of one epoch's batches: shuffled by ``(seed, epoch)``, bucketed by length in pools.

    A batch holds pairs while ``n_pairs * max(len)`` stays within ``batch_tokens``.
    """
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(pairs)))
    rng.shuffle(order)
    size = lambda i: max(len(pairs[i][0]), len(pairs[i][1]))  # noqa: E731
    batches = []
    avg = max(1, batch_tokens // 12)
    for start in range(0, len(order), pool * avg):
        chunk = sorted(order[start:start + pool * avg], key=size)
        cur, longest = [], 0
        for i in chunk:
            n = max(longest, size(i))
            if cur and n * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, n = [], size(i)
            cur.append(i)
            longest = n
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(pairs, idx):
    """``(src (B, S), tgt (B, T + 1))`` int64, right-padded with PAD."""
    src = [torch.tensor(pairs[i][0]) for i in idx]
    tgt = [torch.tensor(pairs[i][1]) for i in idx]
    pad = nn.utils.rnn.pad_sequence
    return pad(src, batch_first=True, padding_value=PAD), pad(tgt, batch_first=True, padding_value=PAD)


# ------------------------------------------------------------------------------ trainer


class Trainer:
    """Model, Adam, the data position and checkpoints of one run directory."""

    def __init__(self, cfg: TrainConfig, model_cfg: ModelConfig, run_dir: Path, train_pairs, valid_pairs):
        self.cfg, self.model_cfg, self.run_dir = cfg, model_cfg, Path(run_dir)
        torch.manual_seed(cfg.seed)
        self.model = Transformer(model_cfg)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=cfg.betas, eps=cfg.eps)
        self.loss_fn = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=cfg.label_smoothing, reduction="sum")
        self.train_pairs, self.valid_pairs = train_pairs, valid_pairs
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self._batches: list | None = None

    # -- checkpoints ---------------------------------------------------------------------
    def save(self) -> Path:
        """Weights + Adam moments + RNG state to safetensors; config and position to JSON (atomic)."""
        from safetensors.torch import save_file

        self.run_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"model.{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for k, v in st.items():
                tensors[f"adam.{names[id(p)]}.{k}"] = v.detach().reshape(v.shape).contiguous()
        tensors["rng.torch"] = torch.get_rng_state()
        weights = self.run_dir / f"step-{self.step:07d}.safetensors"
        tmp = weights.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, weights)
        meta = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "weights": weights.name, "train_config": dataclasses.asdict(self.cfg),
                "model_config": dataclasses.asdict(self.model_cfg),
                "optimizer": {"name": "Adam", "betas": list(self.cfg.betas), "eps": self.cfg.eps,
                              "lr": self.opt.param_groups[0]["lr"]},
                "rng": {"seed": self.cfg.seed, "torch_state": "rng.torch in the safetensors file",
                        "data_order": "random.Random(f'{seed}:{epoch}')"}}
        tmp = self.run_dir / "checkpoint.json.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, self.run_dir / "checkpoint.json")  # the commit point
        for old in self.run_dir.glob("step-*.safetensors"):
            if old.name != weights.name:
                old.unlink()
        return weights

    def load(self) -> bool:
        """Resume from ``run_dir/checkpoint.json`` if there is one; returns whether it did."""
        from safetensors.torch import load_file

        meta_path = self.run_dir / "checkpoint.json"
        if not meta_path.exists():
            return False
        meta = json.loads(meta_path.read_text())
        if meta["model_config"] != dataclasses.asdict(self.model_cfg):
            raise ValueError(f"{meta_path} was written for another model config; use a new --run-dir or --fresh")
        tensors = load_file(str(self.run_dir / meta["weights"]))
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        for n, p in self.model.named_parameters():
            st = {k.rsplit(".", 1)[1]: v for k, v in tensors.items()
                  if k.startswith(f"adam.{n}.") and k.count(".") == n.count(".") + 2}
            if st:
                self.opt.state[p] = st
        torch.set_rng_state(tensors["rng.torch"])
        self.step, self.epoch, self.batch_in_epoch = meta["step"], meta["epoch"], meta["batch_in_epoch"]
        return True

    # -- training ------------------------------------------------------------------------
    def batches(self):
        if self._batches is None:
            self._batches = make_batches(self.train_pairs, self.cfg.batch_tokens, self.cfg.seed, self.epoch)
        return self._batches

    def train_step(self) -> tuple[float, int]:
        """One optimizer step; returns (mean loss per target token, tokens in the batch)."""
        self.model.train()
        batches = self.batches()
        src, tgt = collate(self.train_pairs, batches[self.batch_in_epoch])
        logits = self.model(src, tgt[:, :-1])
        n_tok = int(tgt[:, 1:].ne(PAD).sum())
        loss = self.loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1)) / n_tok
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.step += 1
        lr = learning_rate(self.step, self.model_cfg.d_model, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.batch_in_epoch += 1
        if self.batch_in_epoch >= len(batches):
            self.epoch, self.batch_in_epoch, self._batches = self.epoch + 1, 0, None
        return float(loss.detach()), int(src.ne(PAD).sum()) + n_tok

    @torch.no_grad()
    def validate(self, max_pairs: int = 4000) -> float:
        """Label-smoothed loss per target token on the validation pairs (dropout off)."""
        self.model.eval()
        pairs = self.valid_pairs[:max_pairs]
        total, count = 0.0, 0
        for idx in make_batches(pairs, self.cfg.batch_tokens, 0, 0):
            src, tgt = collate(pairs, idx)
            logits = self.model(src, tgt[:, :-1])
            total += float(self.loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1)))
            count += int(tgt[:, 1:].ne(PAD).sum())
        return total / max(count, 1)


def _log(run_dir: Path, record: dict) -> None:
    with open(run_dir / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(run_dir: Path, step: int) -> None:
    """Drop log records after the checkpoint we resume from (they will be recomputed)."""
    path = run_dir / "log.jsonl"
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if _record_step(ln) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, path)


def _record_step(line: str) -> float:
    """The step of one log line; a line cut short by a kill (or empty) sorts after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def train(cfg: TrainConfig, model_cfg: ModelConfig, run_dir: Path, train_pairs, valid_pairs, *,
          stop_after: int | None = None, fresh: bool = False, progress: bool = True) -> Trainer:
    """Train to ``cfg.steps`` (or ``stop_after`` more steps), resuming from ``run_dir`` if it holds a checkpoint."""
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for f in list(run_dir.glob("step-*.safetensors")) + [run_dir / "checkpoint.json", run_dir / "log.jsonl"]:
            f.unlink(missing_ok=True)
    for stale in run_dir.glob("*.tmp"):   # a checkpoint write that a kill interrupted (never committed)
        stale.unlink()
    tr = Trainer(cfg, model_cfg, run_dir, train_pairs, valid_pairs)
    if tr.load():
        print(f"resumed from {run_dir / 'checkpoint.json'} at step {tr.step}", flush=True)
    _truncate_log(run_dir, tr.step)
    end = cfg.steps if stop_after is None else min(cfg.steps, tr.step + stop_after)
    bar = tqdm(total=cfg.steps, initial=tr.step, disable=not progress, unit="step", dynamic_ncols=True)
    t0, tokens, ema = time.perf_counter(), 0, None
    while tr.step < end:
        epoch = tr.epoch
        loss, n = tr.train_step()
        tokens += n
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        rate = tokens / max(time.perf_counter() - t0, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{rate:,.0f}", epoch=tr.epoch)
        rec = {"step": tr.step, "loss": loss, "lr": tr.opt.param_groups[0]["lr"], "tokens": n,
               "time": time.perf_counter() - t0}
        if tr.step % cfg.eval_every == 0 or tr.epoch != epoch or tr.step == cfg.steps:
            rec["valid_loss"] = tr.validate()
            bar.write(f"step {tr.step} epoch {tr.epoch}: valid loss {rec['valid_loss']:.4f}")
        _log(run_dir, rec)
        if tr.step % cfg.checkpoint_every == 0 or tr.step == end:
            tr.save()
    bar.close()
    return tr


def load_data(data_dir: Path, cfg: TrainConfig):
    tok = _data.Tokenizer(Path(data_dir) / "spm.model")
    train_pairs = encode_pairs(_data.load_split(data_dir, "train"), tok, cfg.max_tokens, cfg.translations)
    valid_pairs = encode_pairs(_data.load_split(data_dir, "valid"), tok, cfg.max_tokens, cfg.translations)
    return tok, train_pairs, valid_pairs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m keyfold train translate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="cpu", choices=sorted(TRAIN_CONFIGS), help="training recipe")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="prepared data folder")
    p.add_argument("--dict-dir", type=Path, default=_data.DICT_DIR, help="folder with the dictd files")
    p.add_argument("--prepare", action="store_true", help="install (apt-get) and parse the dictionary, "
                   "train the tokenizer, then stop")
    p.add_argument("--vocab-size", type=int, default=8000, help="tokenizer pieces (with --prepare)")
    p.add_argument("--run-dir", type=Path, default=None, help="checkpoints and log (default runs/<config>)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    p.add_argument("--steps", type=int, default=None, help="override the recipe's total steps")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps in this process")
    args = p.parse_args(argv)
    if args.prepare or not (args.data / "spm.model").exists():
        t = time.perf_counter()
        stats = _data.prepare(args.data, dict_dir=args.dict_dir, vocab_size=args.vocab_size)
        print(f"prepared {args.data} in {time.perf_counter() - t:.0f} s: {json.dumps(stats)}")
        if args.prepare:
            return 0
    cfg = TRAIN_CONFIGS[args.config]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    tok, train_pairs, valid_pairs = load_data(args.data, cfg)
    model_cfg = dataclasses.replace(MODEL_CONFIGS[cfg.model], vocab_size=tok.vocab_size)
    run_dir = args.run_dir or DEFAULT_RUNS / args.config
    print(f"{len(train_pairs)} training pairs, vocab {tok.vocab_size}, model {model_cfg}", flush=True)
    t = time.perf_counter()
    tr = train(cfg, model_cfg, run_dir, train_pairs, valid_pairs, stop_after=args.stop_after, fresh=args.fresh)
    print(f"step {tr.step}/{cfg.steps} in {time.perf_counter() - t:.0f} s; checkpoint in {run_dir}")
    return 0
