"""German-English phrase pairs from the FreeDict/Ding dictionary (Debian ``dict-freedict-deu-eng``).

The package ships a dictd database: ``freedict-deu-eng.index`` (one line per headword:
``headword<TAB>offset<TAB>length``, offsets in dictd's base64) and ``freedict-deu-eng.dict.dz``
(dictzip, which gzip reads). One index line points at one *sense* of a headword; a word with
several senses (``Bank``: bank, bench, ...) has several index lines. One sense looks like::

    Bank /bˈaŋk/ <fem, n, sg>              German side, pronunciation, grammar
     [fin.] bank <n>, banking house <n>     domain label, English translations (comma separated)
             Note: ...                      notes, "German example"  - English example
       Synonyms: {Bankinstitut}, {Geldhaus} German synonyms (they have entries of their own)
     see: {Banken}                          cross references

Cleaning rules (simple on purpose, documented in docs/transformer.md):

1. German: the first line without ``/pronunciation/``, ``<grammar>``, ``(...)``, ``[...]`` and the
   ``…`` that marks a sentence fragment; English: the second line, split at top-level ``", "``
   (a comma and a space: ``2,4,6-Trinitrophenol`` stays one word), each part cleaned the same way.
   Punctuation is kept on both sides (``jdm. etw.``, ``aber dalli!``).
2. A side is dropped if it is empty, longer than 100 characters, or still holds markup
   (``{}<>[]/|…"``) after step 1.
3. Pairs are grouped by the German side: one :class:`Example` holds a German phrase and all its
   English translations, in dictionary order, without duplicates.
4. Split by ``md5(German UTF-8) % 200``: 0-1 test (1 %), 2 valid (0.5 %), the rest train. Every
   sense of a German phrase therefore lands in the same split.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterable, Iterator

__all__ = [
    "DICT_DIR", "Sense", "Example", "Split", "read_index", "parse_sense", "read_senses", "clean_german",
    "clean_english", "examples_from_senses", "split_of", "ensure_package", "prepare", "is_prepared", "load_split",
    "train_tokenizer", "Tokenizer", "PAD", "UNK", "BOS", "EOS",
]

DICT_DIR = Path("/usr/share/dictd")
DICT_NAME = "freedict-deu-eng"
PACKAGE = "dict-freedict-deu-eng"
MAX_CHARS = 100
VOCAB_SIZE = 8000  # shared sentencepiece pieces (docs/transformer.md: chosen on the validation split)
PAD, UNK, BOS, EOS = 0, 1, 2, 3  # sentencepiece ids, fixed when the tokenizer is trained

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_VALUE = {c: i for i, c in enumerate(_B64)}


# ------------------------------------------------------------------------ dictd format


def _b64_int(s: str) -> int:
    """dictd's base64 number (most significant digit first)."""
    n = 0
    for c in s:
        if c not in _B64_VALUE:
            raise ValueError(f"bad dictd base64 number {s!r}: character {c!r} is not in [A-Za-z0-9+/]")
        n = n * 64 + _B64_VALUE[c]
    return n


def read_index(path: str | Path) -> list[tuple[str, int, int]]:
    """``(headword, offset, length)`` per line of a dictd ``.index`` file, in file order."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            parts = line.split("\t")
            if len(parts) != 3:
                raise ValueError(f"{path}:{lineno}: expected 'headword<TAB>offset<TAB>length', got {line!r}")
            rows.append((parts[0], _b64_int(parts[1]), _b64_int(parts[2])))
    return rows


def _read_dict(path: str | Path) -> bytes:
    """The whole text of a ``.dict`` or ``.dict.dz`` (dictzip is gzip with an index header)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".dz" else open
    with opener(path, "rb") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class Sense:
    """One index entry of the dictionary: a German headword line and its English translations."""

    german: str                    # the raw first line (with pronunciation and grammar)
    english: tuple[str, ...]       # the raw translation line(s)
    synonyms: tuple[str, ...]      # German synonyms from ``Synonym(s): {...}``
    see: tuple[str, ...]           # cross references from ``see: {...}``


_BRACES = re.compile(r"\{([^{}]*)\}")


def parse_sense(text: str) -> Sense:
    """Parse the text of one dictd entry of the FreeDict deu-eng database into a :class:`Sense`.

    >>> s = parse_sense("Bank /bˈaŋk/ <fem, n, sg>\\n [fin.] bank <n>\\n   Synonym: {Bankinstitut}\\n")
    >>> s.english, s.synonyms
    ((' [fin.] bank <n>',), ('Bankinstitut',))
    """
    lines = text.split("\n")
    german = lines[0].strip()
    english, synonyms, see = [], [], []
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith(("Synonym:", "Synonyms:")):
            synonyms += [s.strip() for s in _BRACES.findall(stripped)]
        elif stripped.startswith("see:"):
            see += [s.strip() for s in _BRACES.findall(stripped)]
        elif line.startswith("   "):
            continue  # notes and usage examples, indented by 3 or more spaces
        else:
            english.append(line)
    return Sense(german, tuple(english), tuple(synonyms), tuple(see))


def read_senses(index_path: str | Path, dict_path: str | Path) -> Iterator[tuple[str, Sense]]:
    """``(index headword, Sense)`` for every index line, in index order."""
    data = _read_dict(dict_path)
    for headword, offset, length in read_index(index_path):
        if offset + length > len(data):
            raise ValueError(f"index entry {headword!r} points past the end of {dict_path} "
                             f"({offset}+{length} > {len(data)}); are the .index and .dict from one database?")
        yield headword, parse_sense(data[offset:offset + length].decode("utf-8"))


# ----------------------------------------------------------------------------- cleaning

_PRON = re.compile(r"/[^/]*/")
_ANGLE = re.compile(r"<[^<>]*>")
_SQUARE = re.compile(r"\[[^\[\]]*\]")
_ROUND = re.compile(r"\([^()]*\)")
_SPACES = re.compile(r"\s+")
_MARKUP = re.compile(r"[{}<>\[\]/|…\"]")


def _strip(s: str) -> str:
    for pat in (_PRON, _ANGLE, _SQUARE, _ROUND):
        s = pat.sub(" ", s)
    return _SPACES.sub(" ", s).strip()


def _accept(s: str) -> str | None:
    if not s or len(s) > MAX_CHARS or _MARKUP.search(s):
        return None
    return s


def clean_german(line: str) -> str | None:
    """The German phrase of a headword line, or None if it does not pass the cleaning rules."""
    return _accept(_strip(line.replace("…", " ")))


def _split_top_level(s: str) -> list[str]:
    """Split at ``", "`` (comma, space) where it is not inside (), [] or <>."""
    parts, depth, cur = [], 0, []
    for i, c in enumerate(s):
        if c in "([<":
            depth += 1
        elif c in ")]>":
            depth = max(0, depth - 1)
        if c == "," and depth == 0 and s[i + 1:i + 2].isspace():
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def clean_english(line: str) -> list[str]:
    """The English translations on one translation line, cleaned; rejected parts are dropped."""
    out = []
    for part in _split_top_level(line):
        s = _accept(_strip(part.replace("…", " ")))
        if s is not None and s not in out:
            out.append(s)
    return out


@dataclasses.dataclass(frozen=True)
class Example:
    """One German phrase and all its English translations (several senses merged, in order)."""

    german: str
    english: tuple[str, ...]


def examples_from_senses(senses: Iterable[Sense]) -> list[Example]:
    """Clean and group senses by their German side (first appearance order)."""
    grouped: dict[str, list[str]] = {}
    for sense in senses:
        de = clean_german(sense.german)
        if de is None:
            continue
        ens = [e for line in sense.english for e in clean_english(line)]
        if not ens:
            continue
        bucket = grouped.setdefault(de, [])
        bucket += [e for e in ens if e not in bucket]
    return [Example(de, tuple(en)) for de, en in grouped.items()]


class Split:
    """Names of the three splits (plain strings in files and on the command line)."""

    TRAIN, VALID, TEST = "train", "valid", "test"
    ALL = (TRAIN, VALID, TEST)


def split_of(german: str) -> str:
    """Deterministic split from md5 of the UTF-8 German side (never Python's salted ``hash``)."""
    bucket = int(hashlib.md5(german.encode("utf-8")).hexdigest(), 16) % 200
    return Split.TEST if bucket < 2 else Split.VALID if bucket == 2 else Split.TRAIN


# ----------------------------------------------------------------------- the data folder


def ensure_package(dict_dir: Path = DICT_DIR, *, install: bool = True) -> tuple[Path, Path]:
    """Paths of the ``.index`` and ``.dict.dz``; installs the Debian package when missing."""
    index, dic = dict_dir / f"{DICT_NAME}.index", dict_dir / f"{DICT_NAME}.dict.dz"
    if index.exists() and dic.exists():
        return index, dic
    if not install:
        raise FileNotFoundError(f"{index} is missing: install it with "
                                f"`apt-get install -y {PACKAGE}` (or pass --dict-dir)")
    if shutil.which("apt-get") is None:
        raise FileNotFoundError(f"{index} is missing and apt-get is not available: install the Debian "
                                f"package {PACKAGE} by hand, or copy its two files into a folder and pass --dict-dir")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    print(f"installing {PACKAGE} with apt-get ...", flush=True)
    subprocess.run(sudo + ["apt-get", "update", "-qq"], check=True)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", PACKAGE], check=True)
    if not (index.exists() and dic.exists()):
        raise FileNotFoundError(f"apt-get installed {PACKAGE} but {index} is still missing")
    return index, dic


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _write_jsonl(path: Path, examples: list[Example]) -> None:
    _write_atomic(path, "".join(json.dumps({"de": ex.german, "en": list(ex.english)}, ensure_ascii=False) + "\n"
                                for ex in examples))


def load_split(data_dir: str | Path, split: str) -> list[Example]:
    """Examples of one split from a folder written by :func:`prepare`."""
    if split not in Split.ALL:
        raise ValueError(f"split must be one of {Split.ALL}, got {split!r}")
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make data` "
                                f"(or `.venv/bin/python -m keyfold train translate --prepare`) first")
    if not (Path(data_dir) / "stats.json").exists():
        raise FileNotFoundError(f"{data_dir} is incomplete (no stats.json: a --prepare was interrupted); rerun "
                                f"`make data` (or `python -m keyfold train translate --prepare`): it resumes")
    return _read_jsonl(path)


def _read_jsonl(path: Path) -> list[Example]:
    with open(path, encoding="utf-8") as f:
        return [Example(d["de"], tuple(d["en"])) for d in map(json.loads, f)]


PAIRS_STAMP, DONE_STAMP = "pairs.json", "stats.json"


def is_prepared(data_dir: str | Path, vocab_size: int | None = None) -> bool:
    """Whether :func:`prepare` finished in ``data_dir`` (for ``vocab_size``, when given)."""
    stamp = Path(data_dir) / DONE_STAMP
    if not stamp.exists() or not (Path(data_dir) / "spm.model").exists():
        return False
    return vocab_size is None or json.loads(stamp.read_text()).get("vocab_size") == vocab_size


def prepare(data_dir: str | Path, *, dict_dir: str | Path = DICT_DIR, vocab_size: int = VOCAB_SIZE,
            install: bool = True, progress: bool = True) -> dict:
    """Parse, clean, split and train the tokenizer into ``data_dir``; returns the counts.

    Writes ``train/valid/test.jsonl`` (one Example per line) and ``spm.model``, each to a temporary
    name moved into place; two stamps mark finished stages: ``pairs.json`` after the splits,
    ``stats.json`` (the counts) after the tokenizer. A finished folder is reused as it is; a killed
    preparation restarts at the first unfinished stage. ``stats.json`` is removed before the
    tokenizer stage and written last: the loaders refuse a folder without it.
    """
    from tqdm import tqdm

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if is_prepared(data_dir, vocab_size):
        print(f"{data_dir} is prepared already ({DONE_STAMP}); nothing to do", flush=True)
        return json.loads((data_dir / DONE_STAMP).read_text())
    (data_dir / DONE_STAMP).unlink(missing_ok=True)     # incomplete until the end
    for stale in data_dir.glob("*.tmp"):                 # an earlier prepare's unfinished writes
        stale.unlink()
    pairs_stamp = data_dir / PAIRS_STAMP
    index, dic = ensure_package(Path(dict_dir), install=install)
    source = {"index": str(index.resolve()), "index_bytes": index.stat().st_size,
              "dict_bytes": dic.stat().st_size, "dict_mtime_ns": dic.stat().st_mtime_ns,
              "index_mtime_ns": index.stat().st_mtime_ns}
    done = json.loads(pairs_stamp.read_text()) if pairs_stamp.exists() else {}
    if done.get("source") == source and all((data_dir / f"{n}.jsonl").exists() for n in Split.ALL):
        counts = {k: v for k, v in done.items() if k != "source"}
        print(f"[1/2] phrase pairs: reusing {data_dir}/{{train,valid,test}}.jsonl ({PAIRS_STAMP})", flush=True)
    else:
        pairs_stamp.unlink(missing_ok=True)
        print(f"[1/2] phrase pairs from {index.parent}", flush=True)
        rows = read_index(index)
        data = _read_dict(dic)
        senses = []
        for headword, offset, length in tqdm(rows, desc="parsing senses", unit=" senses", mininterval=1,
                                             disable=not progress):
            if offset + length > len(data):
                raise ValueError(f"index entry {headword!r} points past the end of {dic} "
                                 f"({offset}+{length} > {len(data)}); are the .index and .dict from one database?")
            senses.append(parse_sense(data[offset:offset + length].decode("utf-8")))
        examples = examples_from_senses(tqdm(senses, desc="cleaning, grouping", unit=" senses", mininterval=1,
                                             disable=not progress))
        splits = {name: [] for name in Split.ALL}
        for ex in examples:
            splits[split_of(ex.german)].append(ex)
        for name, exs in splits.items():
            _write_jsonl(data_dir / f"{name}.jsonl", exs)
        counts = {"senses": len(senses), "examples": len(examples),
                  "multiword": sum(" " in ex.german for ex in examples),
                  "pairs": sum(len(ex.english) for ex in examples),
                  **{f"{k}_examples": len(v) for k, v in splits.items()}}
        _write_atomic(pairs_stamp, json.dumps({**counts, "source": source}, indent=1))
    train = _read_jsonl(data_dir / f"{Split.TRAIN}.jsonl")
    print(f"[2/2] the shared {vocab_size}-piece tokenizer on {len(train)} training phrases", flush=True)
    train_tokenizer(train, data_dir / "spm", vocab_size=vocab_size, progress=progress)
    stats = {**counts, "vocab_size": vocab_size}
    _write_atomic(data_dir / DONE_STAMP, json.dumps(stats, indent=1))  # the commit point
    return stats


# ---------------------------------------------------------------------------- tokenizer

TOKENIZER_SENTENCES = 600_000   # lines sampled for sentencepiece (German + English sides)
TOKENIZER_S_PER_LINE = 1.4e-4   # seconds per sampled line on one quiet core at 8k pieces (for the ETA only)


def train_tokenizer(examples: list[Example], prefix: str | Path, *, vocab_size: int = 8000,
                    sentences: int = TOKENIZER_SENTENCES, progress: bool = False) -> Path:
    """A shared German+English sentencepiece unigram model on the training split: ``prefix.model``.

    sentencepiece reports no progress, so the bar advances with the clock against an estimate
    (``TOKENIZER_S_PER_LINE``); it says so, and it finishes when the trainer does.
    """
    import io
    import threading

    import sentencepiece as spm
    from tqdm import tqdm

    lines = []
    for ex in examples:
        lines.append(ex.german)
        lines.extend(ex.english)
    model = io.BytesIO()
    n = min(len(lines), sentences)
    kwargs = dict(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                  model_type="unigram", character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
                  input_sentence_size=sentences, shuffle_input_sentence=True, hard_vocab_limit=False,
                  num_threads=2, minloglevel=2, seed_sentencepiece_size=200_000)
    failure: list[BaseException] = []

    def run():
        try:
            spm.SentencePieceTrainer.train(**kwargs)
        except BaseException as err:  # re-raised in the caller's thread
            failure.append(err)

    thread = threading.Thread(target=run, daemon=True)
    estimate = max(5.0, n * TOKENIZER_S_PER_LINE * (vocab_size / 8000) ** 0.5)
    t0 = time.perf_counter()
    thread.start()
    with tqdm(total=round(estimate), desc="tokenizer (time estimate)", unit="s", disable=not progress,
              bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}]") as bar:
        while thread.is_alive():
            thread.join(1.0)
            done = time.perf_counter() - t0
            if done > bar.total:
                bar.total = round(done * 1.1)
            bar.n = round(done)
            bar.refresh()
        bar.total = bar.n = round(time.perf_counter() - t0)
        bar.refresh()
    if failure:
        raise failure[0]
    path = Path(f"{prefix}.model")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, path)
    return path


class Tokenizer:
    """Shared subword vocabulary (sentencepiece); ids ``PAD, UNK, BOS, EOS = 0, 1, 2, 3``."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        if not Path(model_path).exists():
            raise FileNotFoundError(f"tokenizer {model_path} is missing: run `make data` "
                                    f"(or `.venv/bin/python -m keyfold train translate --prepare`) first")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        self.model_path = str(model_path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[list[int]]) -> list[str]:
        # UNK stays (sentencepiece writes it " ⁇ "): dropped with PAD/BOS/EOS, an unknown character or an
        # UNK the model generated vanished from the text without a trace (a review, 2026-12-07)
        clean = [[t for t in seq if t > EOS or t == UNK] for seq in ids]
        return self.sp.decode(clean)


def source_ids(encoded: list[list[int]], max_len: int) -> list[list[int]]:
    """Encoded inputs as a model of ``max_len`` positions takes them: EOS appended, an input longer than
    ``max_len - 1`` tokens cut there with a warning naming how many were (until 2026-12-07 every input was
    cut at ``max_len // 2 - 1`` tokens, 127 for the ``cpu`` and ``base`` presets, silently)."""
    import warnings

    room = max_len - 1
    cut = sum(len(seq) > room for seq in encoded)
    if cut:
        warnings.warn(f"{cut} of {len(encoded)} input(s) longer than the model's {room} source positions "
                      f"(ModelConfig.max_len - 1) were cut there; split long inputs into sentences", stacklevel=3)
    return [seq[:room] + [EOS] for seq in encoded]
