"""What the translation tests share: tiny token pairs, a dictd database written on the spot, the
training log. Import only after ``require_extra("translate")`` (it imports the app)."""

import gzip
import json

import torch

from keyfold.apps.translate import data
from keyfold.apps.translate.data import BOS, EOS
from keyfold.apps.translate.transformer import MODEL_CONFIGS

TINY = MODEL_CONFIGS["tiny"]

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

# Entries in the format of /usr/share/dictd/freedict-deu-eng.dict.dz (copied in style from it):
# "Bank" has two senses (two index lines), "Schloss" lists synonyms and notes and examples,
# "aber dalli" starts with an ellipsis, "Akut" has a domain label and several translations.
ENTRIES = [
    ("bank", "Bank /bˈaŋk/ <fem, n, sg>\n [fin.] bank <n>\n"
             "      \"die vorlegende Bank\"  - the presenting bank\n"
             "   Synonym: {Bankinstitut}\n\n see: {Banken}, {Privatbank}\n\n"),
    ("bank", "Bank /bˈaŋk/ <fem, n, sg>\nbench <n>\n         Note: in a public area\n"
             "   Synonyms: {Sitzbank}, {Parkbank}\n\n see: {Bänke}\n\n"),
    ("schloss", "Schloss /ʃlˈɔs/ <neut, n, sg>\ncastle <n>, palace <n>\n"
                "   Synonyms: {Burg}, {Kastell}, {Feste}\n\n see: {Schlösser}\n\n"),
    ("aber dalli", "… aber dalli! /ˌɑːbɜ dˈaliː/\n… and pronto!\n see: {fix}\n\n"),
    ("akut", "Akut /akˈuːt/ <masc, n, sg>\n [print] acute accent <n>, acute (sign) <n>\n"),
    ("haus", "Haus /hˈaʊs/ <neut, n, sg>\nhouse <n>\n"),
    ("grosses haus", "großes Haus /ɡɾˈoːsəs hˈaʊs/\nbig house\n"),
    ("leer", "Leer /lˈeːɐ/\n{broken} <n>\n"),
]


def b64(n: int) -> str:
    s = ""
    while True:
        s = B64[n % 64] + s
        n //= 64
        if n == 0:
            return s


def write_dictd(folder, entries=ENTRIES, name=data.DICT_NAME):
    """A dictd database: ``name.index`` (base64 offsets) and ``name.dict.dz`` (gzip)."""
    body, index = b"", []
    for headword, text in entries:
        raw = text.encode("utf-8")
        index.append(f"{headword}\t{b64(len(body))}\t{b64(len(raw))}")
        body += raw
    (folder / f"{name}.index").write_text("\n".join(index) + "\n", encoding="utf-8")
    with gzip.open(folder / f"{name}.dict.dz", "wb") as f:
        f.write(body)
    return folder / f"{name}.index", folder / f"{name}.dict.dz"


def synthetic_pairs(n=48, seed=0, mapped=True):
    """``n`` (source, target) id lists of 2-5 tokens; ``mapped``: the target is a fixed function of
    the source (learnable), else random ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(2, 6, (1,), generator=g))
        s = torch.randint(4, TINY.vocab_size, (k,), generator=g).tolist()
        t = ([(x * 7) % (TINY.vocab_size - 4) + 4 for x in s] if mapped
             else torch.randint(4, TINY.vocab_size, (k,), generator=g).tolist())
        out.append((s + [EOS], [BOS] + t + [EOS]))
    return out


def run_log(run_dir):
    """The rows of a run's ``log.jsonl``."""
    return [json.loads(ln) for ln in (run_dir / "log.jsonl").read_text().splitlines()]
