"""Kill training while it writes a checkpoint, and data preparation halfway; then resume or rerun.

Each kill is a real SIGKILL of a forked child process (nothing gets to clean up), at a chosen
point inside the write. The checkpoint on disk must be the last complete one, resuming must give
exactly the uninterrupted run (same loss curve, same weights), and a rerun of ``prepare`` must
recover a folder it left half-written.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import require_extra

require_extra("translate")  # skip, naming the pip line, where the extra is missing (before the app imports)
pytestmark = pytest.mark.usefixtures("one_thread")

from keyfold.apps.translate import data
from keyfold.apps.translate import train as T
from tests.apps.translate.fixtures import ENTRIES, TINY, run_log, synthetic_pairs, write_dictd

# keep=1: every checkpoint deletes the one before (the "cleanup" kill point needs a deletion)
CFG = dataclasses.replace(T.TRAIN_CONFIGS["tiny"], steps=12, checkpoint_every=5, eval_every=4, keep=1)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _in_child(target, *args) -> int:
    """Run ``target(*args)`` in a forked process; return its exit code (-9 when it was killed)."""
    p = mp.get_context("fork").Process(target=target, args=args)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        pytest.fail("the child did not finish")
    return p.exitcode


def _train_and_die(run_dir: str, where: str):
    """Train; on the checkpoint at step 10, die at ``where`` inside the write."""
    import safetensors.torch as sft

    torch.set_num_threads(1)
    real_save, real_write, real_unlink = sft.save_file, Path.write_text, Path.unlink

    def save_file(tensors, path, *a, **kw):
        real_save(tensors, path, *a, **kw)
        if where == "weights" and "0000010" in path:
            with open(path, "r+b") as f:                     # half of the file reached the disk
                f.truncate(os.path.getsize(path) // 2)
            _die()

    def write_text(self, text, *a, **kw):
        if where == "json" and self.name == "checkpoint.json.tmp" and '"step": 10' in text:
            real_write(self, text[: len(text) // 2], *a, **kw)
            _die()
        return real_write(self, text, *a, **kw)

    def unlink(self, *a, **kw):
        real_unlink(self, *a, **kw)
        if where == "cleanup" and self.name == "step-0000005.safetensors":
            _die()

    sft.save_file, Path.write_text, Path.unlink = save_file, write_text, unlink
    if where == "log":   # die in the middle of appending the log line of step 8
        real_log = T._log

        def log(run, rec):
            if rec["step"] == 8:
                with open(Path(run) / "log.jsonl", "a") as f:
                    f.write(json.dumps(rec)[:20])
                _die()
            real_log(run, rec)
        T._log = log
    T.train(CFG, TINY, Path(run_dir), synthetic_pairs(), synthetic_pairs(8, seed=1), progress=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("whole")
    tr = T.train(CFG, TINY, run, synthetic_pairs(), synthetic_pairs(8, seed=1), progress=False)
    return _curve(run), {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def _curve(run):
    return [(r["step"], r["loss"], r.get("valid_loss")) for r in run_log(run)]


@pytest.mark.slow  # trains 9 short runs (~35 s here); `make test` (CI) runs it, `make test-fast` skips it
@pytest.mark.parametrize("where,on_disk", [("weights", 5), ("json", 5), ("cleanup", 10), ("log", 5)])
def test_kill_while_checkpointing_then_resume_loses_nothing(tmp_path, uninterrupted, where, on_disk):
    run = tmp_path / "run"
    assert _in_child(_train_and_die, str(run), where) == -signal.SIGKILL
    meta = json.loads((run / "checkpoint.json").read_text())     # parses: it is a complete one
    assert meta["step"] == on_disk
    tr = T.Trainer(CFG, TINY, run, [], [])
    assert tr.load() and tr.step == on_disk                      # and its weights load
    torch.set_num_threads(1)
    resumed = T.train(CFG, TINY, run, synthetic_pairs(), synthetic_pairs(8, seed=1), progress=False)
    curve, weights = uninterrupted
    assert _curve(run) == curve                                  # no step lost, repeated or changed
    for n, p in resumed.model.named_parameters():
        assert torch.equal(p, weights[n]), n
    assert not list(run.glob("*.tmp"))                           # the interrupted write is gone
    kept = json.loads((run / "checkpoint.json").read_text())["kept"]   # the last `keep`, for averaging
    assert sorted(f.name for f in run.glob("step-*")) == kept and kept[-1] == "step-0000012.safetensors"


# ------------------------------------------------------------------ data preparation killed halfway


def _prepare_and_die(dict_dir: str, out: str, where: str):
    if where == "tokenizer":
        def boom(*a, **kw):
            _die()
        data.train_tokenizer = boom
    else:   # in the middle of writing valid.jsonl
        real = data._write_jsonl

        def write(path, exs):
            if path.name == "valid.jsonl":
                with open(str(path) + ".tmp", "w") as f:
                    f.write('{"de": "hal')
                _die()
            real(path, exs)
        data._write_jsonl = write
    data.prepare(out, dict_dir=dict_dir, vocab_size=60, install=False)


@pytest.mark.parametrize("where", ["jsonl", "tokenizer"])
@pytest.mark.parametrize("earlier", [False, True])
def test_prepare_killed_halfway_is_refused_and_a_rerun_recovers(tmp_path, where, earlier):
    dict_dir, out = tmp_path / "dictd", tmp_path / "out"
    dict_dir.mkdir()
    write_dictd(dict_dir, ENTRIES)
    if earlier:   # a complete folder from before, from another dictionary and vocabulary: must not pass
        old = tmp_path / "old"
        old.mkdir()
        write_dictd(old, ENTRIES[:-2])
        data.prepare(out, dict_dir=old, vocab_size=50, install=False)
    assert _in_child(_prepare_and_die, str(dict_dir), str(out), where) == -signal.SIGKILL
    assert not (out / "stats.json").exists()
    with pytest.raises(FileNotFoundError, match="(missing|incomplete).*--prepare"):
        T.load_data(out, CFG)
    stats = data.prepare(out, dict_dir=dict_dir, vocab_size=60, install=False)
    fresh = tmp_path / "fresh"
    assert stats == data.prepare(fresh, dict_dir=dict_dir, vocab_size=60, install=False)
    for split in data.Split.ALL:
        assert (out / f"{split}.jsonl").read_bytes() == (fresh / f"{split}.jsonl").read_bytes()
    assert (out / "spm.model").read_bytes() == (fresh / "spm.model").read_bytes()
    assert not list(out.glob("*.tmp"))
    tok, train_pairs, _ = T.load_data(out, CFG)
    assert tok.vocab_size > 0 and train_pairs


def test_scoring_nothing_says_what_is_wrong():
    """An empty split (or --limit 0) crashed with "max() arg is an empty sequence" (a review, 2026-12-08)."""
    from keyfold.apps.translate import baselines
    with pytest.raises(ValueError, match="no examples to score"):
        baselines.score([], [])
