"""Two baselines on the same test split as the model, and the scoring shared by all three.

- copy: the German source as the "translation" (scores cognates and names).
- word by word: each German word replaced by the first English translation of that word as a
  single-word headword in the *training* pairs (exact, then lower-cased), else copied.

Scores are sacrebleu's corpus BLEU and chrF against every English translation of the German
phrase in the dictionary (multi-reference: a phrase with several senses has several right answers).
"""

from __future__ import annotations

from .data import Example

__all__ = ["copy_source", "WordByWord", "score"]


def copy_source(examples: list[Example]) -> list[str]:
    return [ex.german for ex in examples]


class WordByWord:
    """Word lookup built from the single-word German entries of the training split."""

    def __init__(self, train: list[Example]):
        self.exact: dict[str, str] = {}
        self.lower: dict[str, str] = {}
        for ex in train:
            if " " in ex.german:
                continue
            self.exact.setdefault(ex.german, ex.english[0])
            self.lower.setdefault(ex.german.lower(), ex.english[0])

    def word(self, w: str) -> str:
        return self.exact.get(w) or self.lower.get(w.lower()) or w

    def __call__(self, examples: list[Example]) -> list[str]:
        return [" ".join(self.word(w) for w in ex.german.split()) for ex in examples]


def score(hyps: list[str], examples: list[Example]) -> dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu defaults) of ``hyps`` against all references of each example."""
    import sacrebleu.metrics

    if len(hyps) != len(examples):
        raise ValueError(f"{len(hyps)} hypotheses for {len(examples)} examples")
    if not examples:  # (max() of nothing raised; a review, 2026-12-08)
        raise ValueError("score: no examples to score (an empty split, or --limit 0); BLEU needs at least one "
                         "phrase: check the data folder's split or pass --limit N with N >= 1")
    n = max(len(ex.english) for ex in examples)
    refs = [[ex.english[i] if i < len(ex.english) else None for ex in examples] for i in range(n)]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, refs), chrf.corpus_score(hyps, refs)
    return {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "n": len(hyps),
            "bleu_signature": str(bleu.get_signature()), "chrf_signature": str(chrf.get_signature())}
