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
from pathlib import Path
from typing import Iterable, Iterator

__all__ = [
    "DICT_DIR", "Sense", "Example", "Split", "read_index", "parse_sense", "read_senses", "clean_german",
    "clean_english", "examples_from_senses", "split_of", "ensure_package", "prepare", "load_split",
    "train_tokenizer", "Tokenizer", "PAD", "UNK", "BOS", "EOS",
]

DICT_DIR = Path("/usr/share/dictd")
DICT_NAME = "freedict-deu-eng"
PACKAGE = "dict-freedict-deu-eng"
MAX_CHARS = 100
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


def _write_jsonl(path: Path, examples: list[Example]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"de": ex.german, "en": list(ex.english)}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def load_split(data_dir: str | Path, split: str) -> list[Example]:
    """Examples of one split from a folder written by :func:`prepare`."""
    if split not in Split.ALL:
        raise ValueError(f"split must be one of {Split.ALL}, got {split!r}")
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python -m keyfold train translate --prepare` first")
    if not (Path(data_dir) / "stats.json").exists():
        raise FileNotFoundError(f"{data_dir} is incomplete (no stats.json: a --prepare was interrupted); rerun "
                                f"`python -m keyfold train translate --prepare` (it starts over)")
    with open(path, encoding="utf-8") as f:
        return [Example(d["de"], tuple(d["en"])) for d in map(json.loads, f)]


def prepare(data_dir: str | Path, *, dict_dir: str | Path = DICT_DIR, vocab_size: int = 8000,
            install: bool = True) -> dict:
    """Parse, clean, split and train the tokenizer into ``data_dir``; returns the counts.

    Writes ``train/valid/test.jsonl`` (one Example per line), ``spm.model`` and ``stats.json``.
    Every file is written to a temporary name and renamed; ``stats.json`` is removed first and
    written last, so it marks a complete folder: a prepare killed at any point leaves none, the
    loaders refuse the folder, and a rerun starts over and recovers.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "stats.json").unlink(missing_ok=True)   # the folder is incomplete until the end
    for stale in data_dir.glob("*.tmp"):                 # an earlier prepare's unfinished writes
        stale.unlink()
    index, dic = ensure_package(Path(dict_dir), install=install)
    from tqdm import tqdm

    senses = [s for _, s in tqdm(read_senses(index, dic), desc="parsing", unit=" senses", mininterval=2)]
    examples = examples_from_senses(senses)
    splits = {name: [] for name in Split.ALL}
    for ex in examples:
        splits[split_of(ex.german)].append(ex)
    for name, exs in splits.items():
        _write_jsonl(data_dir / f"{name}.jsonl", exs)
    print(f"training the {vocab_size}-piece tokenizer on {len(splits[Split.TRAIN])} phrases ...", flush=True)
    train_tokenizer(splits[Split.TRAIN], data_dir / "spm", vocab_size=vocab_size)
    stats = {"senses": len(senses), "examples": len(examples),
             "multiword": sum(" " in ex.german for ex in examples),
             "pairs": sum(len(ex.english) for ex in examples),
             **{f"{k}_examples": len(v) for k, v in splits.items()}, "vocab_size": vocab_size}
    tmp = data_dir / "stats.json.tmp"
    tmp.write_text(json.dumps(stats, indent=1))
    os.replace(tmp, data_dir / "stats.json")            # the commit point
    return stats


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(examples: list[Example], prefix: str | Path, *, vocab_size: int = 8000) -> Path:
    """A shared German+English sentencepiece unigram model on the training split: ``prefix.model``."""
    import io

    import sentencepiece as spm

    text = io.StringIO()
    for ex in examples:
        text.write(ex.german + "\n")
        for en in ex.english:
            text.write(en + "\n")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.getvalue().splitlines()), model_writer=model, vocab_size=vocab_size,
        model_type="unigram", character_coverage=1.0, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, hard_vocab_limit=False,
        num_threads=2, minloglevel=2)
    path = Path(f"{prefix}.model")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, path)
    return path


class Tokenizer:
    """Shared subword vocabulary (sentencepiece); ids ``PAD, UNK, BOS, EOS = 0, 1, 2, 3``."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        if not Path(model_path).exists():
            raise FileNotFoundError(f"tokenizer {model_path} is missing: run "
                                    f"`python -m keyfold train translate --prepare` first")
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))
        self.model_path = str(model_path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[list[int]]) -> list[str]:
        clean = [[t for t in seq if t > EOS] for seq in ids]
        return self.sp.decode(clean)
