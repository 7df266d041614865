"""HotpotQA answer scoring: exact match and token F1 under the standard answer normalisation.

The normalisation is the one of the official HotpotQA/SQuAD evaluation scripts: lower-case, drop
punctuation, drop the articles a/an/the, collapse whitespace. As in the official HotpotQA script,
a yes/no answer earns no partial credit: when either side normalises to "yes", "no" or "noanswer"
and the two differ, F1 is 0 (otherwise "no" vs "yes no" would score 0.67).
"""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_NO_PARTIAL_CREDIT = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    """Lower-case, strip punctuation, articles and extra whitespace (in the official order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def f1_score(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall after normalisation (bag of tokens)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if pred != ref and (pred in _NO_PARTIAL_CREDIT or ref in _NO_PARTIAL_CREDIT):
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = collections.Counter(pred_tokens) & collections.Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)
