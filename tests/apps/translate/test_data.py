"""The dictd parser, cleaning, split and tokenizer, on dictionary entries written here (no package)."""

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import require_extra

require_extra("translate")  # skip, naming the pip line, where the extra is missing (before the app imports)
pytestmark = pytest.mark.usefixtures("one_thread")

from keyfold.apps.translate import data
from keyfold.apps.translate.baselines import WordByWord, copy_source, score
from tests.apps.translate.fixtures import ENTRIES, b64, write_dictd

@given(st.integers(0, 2**40))
def test_base64_numbers_round_trip(n):
    assert data._b64_int(b64(n)) == n


def test_base64_known_value_and_bad_digit():
    assert data._b64_int("B0") == 1 * 64 + 52
    with pytest.raises(ValueError, match="base64"):
        data._b64_int("B-")


def test_parser_reads_senses_synonyms_and_references(tmp_path):
    index, dic = write_dictd(tmp_path)
    senses = list(data.read_senses(index, dic))
    assert [h for h, _ in senses] == [h for h, _ in ENTRIES]
    bank1, bank2 = senses[0][1], senses[1][1]
    assert bank1.english == (" [fin.] bank <n>",)          # the example line is not a translation
    assert bank1.synonyms == ("Bankinstitut",) and bank1.see == ("Banken", "Privatbank")
    assert bank2.synonyms == ("Sitzbank", "Parkbank")     # "Note:" lines are skipped
    assert senses[2][1].synonyms == ("Burg", "Kastell", "Feste")


def test_cleaning_rules():
    assert data.clean_german("Bank /bˈaŋk/ <fem, n, sg>") == "Bank"
    assert data.clean_german("… aber dalli! /ˌɑːbɜ dˈaliː/") == "aber dalli!"
    assert data.clean_german("jdm. etw. geben") == "jdm. etw. geben"
    assert data.clean_english("2,4,6-trinitrophenol <n>") == ["2,4,6-trinitrophenol"]
    assert data.clean_english(" [print] acute accent <n>, acute (sign) <n>") == ["acute accent", "acute"]
    assert data.clean_english("{broken} <n>") == []           # markup left: dropped
    assert data.clean_english("x" * 101) == []                # too long: dropped


@given(st.text(max_size=60))
def test_cleaned_english_never_holds_markup(line):
    for part in data.clean_english(line):
        assert part and len(part) <= data.MAX_CHARS
        assert not set(part) & set("{}<>[]/|…\"")


def test_several_senses_group_into_one_example(tmp_path):
    index, dic = write_dictd(tmp_path)
    exs = data.examples_from_senses(s for _, s in data.read_senses(index, dic))
    by_de = {ex.german: ex.english for ex in exs}
    assert by_de["Bank"] == ("bank", "bench")                 # both senses, dictionary order
    assert by_de["Schloss"] == ("castle", "palace")
    assert by_de["aber dalli!"] == ("and pronto!",)
    assert "Leer" not in by_de                                 # no clean translation left


def test_split_is_md5_of_german_and_stable():
    for de in ["Bank", "Schloss", "aber dalli", "großes Haus", "x"]:
        bucket = int(hashlib.md5(de.encode("utf-8")).hexdigest(), 16) % 200
        want = "test" if bucket < 2 else "valid" if bucket == 2 else "train"
        assert data.split_of(de) == want
    counts = {s: 0 for s in data.Split.ALL}
    for i in range(4000):
        counts[data.split_of(f"wort{i}")] += 1
    assert 10 < counts["test"] < 80 and 2 < counts["valid"] < 45


def test_missing_package_without_install_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install -y dict-freedict-deu-eng"):
        data.ensure_package(tmp_path, install=False)


def test_prepare_writes_splits_and_a_shared_tokenizer(tmp_path):
    entries = ENTRIES + [(f"wort{i}", f"Wort{i} /v/ <n>\nword{i} <n>, term{i} <n>\n") for i in range(60)]
    dict_dir = tmp_path / "dictd"
    dict_dir.mkdir()
    write_dictd(dict_dir, entries)
    stats = data.prepare(tmp_path / "out", dict_dir=dict_dir, vocab_size=60, install=False)
    loaded = {s: data.load_split(tmp_path / "out", s) for s in data.Split.ALL}
    assert sum(len(v) for v in loaded.values()) == stats["examples"] == 66
    for split, exs in loaded.items():
        assert all(data.split_of(ex.german) == split for ex in exs)
    tok = data.Tokenizer(tmp_path / "out" / "spm.model")
    assert tok.decode(tok.encode(["Wort3 word3"])) == ["Wort3 word3"]   # one vocabulary for both sides
    # a character it never saw decodes as sentencepiece's unknown mark: it vanished with PAD/BOS/EOS before
    # (a review, 2026-12-07: "Größe" came back "rße")
    unseen = tok.encode(["Wort3 Ω"])[0]
    assert data.UNK in unseen and "\u2047" in tok.decode([unseen])[0]
    assert tok.sp.pad_id() == data.PAD and tok.sp.eos_id() == data.EOS and tok.sp.bos_id() == data.BOS


def test_baselines_and_multi_reference_score():
    train = [data.Example("Haus", ("house",)), data.Example("groß", ("big", "large"))]
    test = [data.Example("groß Haus", ("big house", "large house")), data.Example("Katze", ("cat",))]
    assert copy_source(test) == ["groß Haus", "Katze"]
    assert WordByWord(train)(test) == ["big house", "Katze"]
    perfect = score(["big house", "cat"], test)
    assert perfect["chrf"] == 100.0
    assert score(["large house", "cat"], test)["chrf"] == 100.0       # any reference counts
    assert score(["groß Haus", "Katze"], test)["chrf"] < 50
