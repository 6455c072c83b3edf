"""End-to-end synthesis against the loopback OpenAI-compatible server (see conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rolemrc.eval.verifiers import verify
from rolemrc.tasks import TEST_TASKS
from tests.synth.helpers import run_pipeline, small_overrides

RULE_KEYS = {
    "starts_with_emoji": set(),
    "all_caps": set(),
    "ends_with_punctuation": {"char"},
    "max_words": {"n"},
    "forbidden_char": {"char"},
    "no_commas": set(),
}


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        rec = json.loads(line)
        assert isinstance(rec, dict), f"{path.name}:{i}"
        out.append(rec)
    return out


def _assert_messages(msgs: Any, last: str, where: str) -> None:
    """Written independently of rolemrc.synth.records so the two check each other."""
    assert isinstance(msgs, list) and len(msgs) >= 2, where
    for j, m in enumerate(msgs):
        assert isinstance(m, dict) and sorted(m) == ["content", "role"], f"{where}[{j}]"
        assert isinstance(m["content"], str) and m["content"].strip(), f"{where}[{j}] empty"
    roles = [m["role"] for m in msgs]
    assert roles[0] == "System", where
    assert set(roles[1:]) <= {"User", "Assistant"}, where
    assert all(a != b for a, b in zip(roles[1:], roles[2:])), f"{where}: not alternating {roles}"
    assert roles[-1] == last, where


def _rule_ok(rule: dict[str, Any], text: str) -> bool:
    s = text.strip()
    t = rule["type"]
    if t == "starts_with_emoji":
        return ord(s[0]) >= 0x2300
    if t == "all_caps":
        return s == s.upper() and any(c.isalpha() for c in s)
    if t == "ends_with_punctuation":
        return s.endswith(rule["char"])
    if t == "max_words":
        return len(s.split()) <= rule["n"]
    if t == "forbidden_char":
        return rule["char"].lower() not in s.lower()
    return "," not in s


def test_assembled_files_have_the_rolemrc_shapes(assembled_dir: Path) -> None:
    assert sorted(p.name for p in assembled_dir.glob("*.jsonl")) == ["pairs.jsonl", "sft.jsonl", "test.jsonl"]
    sft = _lines(assembled_dir / "sft.jsonl")
    pairs = _lines(assembled_dir / "pairs.jsonl")
    test = _lines(assembled_dir / "test.jsonl")
    assert sft and pairs and test
    role_first = 0
    for i, r in enumerate(sft):
        assert sorted(r) == ["conversations", "task"], f"sft:{i}"
        _assert_messages(r["conversations"], "Assistant", f"sft:{i}")
        role_first += r["conversations"][1]["role"] == "Assistant"
    assert role_first > 0, "role-first chats must open with an Assistant message"
    for i, r in enumerate(pairs):
        assert sorted(r) == ["chosen", "prompt", "rejected", "task"], f"pairs:{i}"
        _assert_messages(r["prompt"], "User", f"pairs:{i}")
        assert isinstance(r["chosen"], str) and r["chosen"].strip()
        assert isinstance(r["rejected"], str) and r["rejected"].strip()
        assert r["chosen"] != r["rejected"]
        assert r["task"] in TEST_TASKS
    for i, r in enumerate(test):
        assert set(r) in ({"task", "question", "reference"}, {"task", "question", "reference", "rule"}), f"test:{i}"
        assert r["task"] in TEST_TASKS
        _assert_messages(r["question"], "User", f"test:{i}")
        assert r["reference"].strip()
        if "special" in r["task"]:
            rule = r["rule"]
            assert set(rule) - {"type"} == RULE_KEYS[rule["type"]], rule
            assert _rule_ok(rule, r["reference"]), (rule, r["reference"])
            assert verify(rule, r["reference"]), "the evaluation's verifier must pass the reference"
            want = "format" if r["task"].endswith("special-format") else "content"
            assert (rule["type"] in ("max_words", "forbidden_char")) == (want == "content")
        else:
            assert "rule" not in r
    # Every one of the 18 test tasks, every dialogue variant.
    assert {r["task"] for r in test} == set(TEST_TASKS)
    tasks = {r["task"] for r in sft}
    for base in ("role_related_dialogue", "role_related_mrc_dialogue"):
        for who in ("role_first", "user_first"):
            for narr in ("with_narration", "no_narration"):
                assert f"{base}---{who}---{narr}---answer" in tasks
    # Held-out test items never reappear in training.
    train_prompts = {json.dumps(r["prompt"]) for r in pairs}
    assert not any(json.dumps(r["question"]) in train_prompts for r in test)


def test_the_training_readers_take_the_files_as_they_are(assembled_dir: Path) -> None:
    from rolemrc.data.readers import read_examples

    for kind, name in (("sft", "sft.jsonl"), ("pairs", "pairs.jsonl"), ("test", "test.jsonl")):
        examples, report = read_examples([{"path": str(assembled_dir / name)}], kind, on_error="raise")
        assert len(examples) == len(_lines(assembled_dir / name)) and not any(report.skipped.values())


def test_no_narration_replies_carry_no_narration(assembled_dir: Path) -> None:
    for r in _lines(assembled_dir / "sft.jsonl"):
        if "no_narration" in r["task"]:
            for m in r["conversations"][1:]:
                if m["role"] == "Assistant":
                    assert not m["content"].lstrip().startswith("("), m["content"]


def test_multi_turn_and_prioritized_shapes(assembled_dir: Path) -> None:
    for r in _lines(assembled_dir / "test.jsonl"):
        n = len(r["question"])
        if r["task"].endswith(("-2ndrefused", "-2ndanswer")):
            assert n == 4, "system, question, first reply, pressing user turn"
        else:
            assert n == 2
        if r["task"].endswith("-refused"):
            assert "Highest-priority instruction" in r["question"][0]["content"]


def test_malformed_profiles_are_asked_again(synth_run: Any) -> None:
    """A profile answer that does not parse (cut JSON, a field missing) is retried, not dropped."""
    st = synth_run.stats["profiles"]
    injected = synth_run.server.malformed
    assert sorted(injected.values()) == ["json", "schema"]
    assert st["usage"]["faults"].get("rejected") == 2
    assert (st["invalid"], st["missing"], st["profiles"]) == (0, 0, st["personas"])
    assert "GLITCH" in " ".join(p["persona"] for p in _lines(synth_run.out_dir / "profiles" / "profiles.jsonl"))
    assert synth_run.stats["personas"]["duplicates"] == 1 and synth_run.stats["personas"]["too_short"] == 1


def test_429s_were_retried_and_nothing_requested_twice(synth_run: Any) -> None:
    s = synth_run.server
    assert s.rate_limited > 0
    assert s.unauthorized == 0
    retried = sum(st.get("usage", {}).get("rate_limited", 0) for st in synth_run.stats.values() if isinstance(st, dict))
    assert retried == s.rate_limited
    assert s.repeated() == {}


def test_matches_are_the_brute_force_extremes(synth_run: Any) -> None:
    d = synth_run.out_dir / "match"
    pe, me = np.load(d / "profile_emb.npy"), np.load(d / "mrc_emb.npy")
    pool = _lines(d / "mrc_pool.jsonl")
    matches = _lines(d / "matches.jsonl")
    profiles = _lines(synth_run.out_dir / "profiles" / "profiles.jsonl")
    assert [m["profile_id"] for m in matches] == [p["id"] for p in profiles]
    scores = pe @ me.T
    pos = {it["id"]: i for i, it in enumerate(pool)}
    for qi, m in enumerate(matches):
        for part, flag in (("answerable", True), ("unanswerable", False)):
            s = np.sort(scores[qi, [i for i, it in enumerate(pool) if it["answerable"] is flag]])
            for rel, want in (("related", s[::-1][:2]), ("unrelated", s[:2])):
                hits = m[rel][part]
                # Ties are common with bag-of-words vectors: compare scores, then check each id's score.
                np.testing.assert_allclose([h["score"] for h in hits], want, rtol=1e-5, atol=1e-6)
                for h in hits:
                    assert pool[pos[h["id"]]]["answerable"] is flag
                    assert abs(scores[qi, pos[h["id"]]] - h["score"]) < 1e-5


def test_rerun_sends_nothing(synth_run: Any) -> None:
    s = synth_run.server
    before = s.total_served()
    # Up-to-date stages are skipped; forcing them replays everything from the request cache.
    run_pipeline(synth_run.overrides)
    run_pipeline([*synth_run.overrides, "force=true"])
    assert s.total_served() == before


def test_dry_run_counts_requests_without_sending(synth_run: Any, tmp_path: Path, synth_inputs: dict[str, Path]) -> None:
    s = synth_run.server
    before = s.total_served()
    # Against the finished run's cache: everything is cached, nothing left to send.
    usage = run_pipeline([*synth_run.overrides, "dry_run=true"])
    assert sum(u["requests"] for u in usage.values()) == sum(st["usage"]["requests"] for st in synth_run.stats.values() if "usage" in st)
    assert sum(u["requests"] - u["cached"] for u in usage.values()) == 0
    # From an empty cache: every request would be sent, each with a token estimate.
    fresh = run_pipeline(small_overrides(s.base_url, tmp_path / "fresh", synth_inputs, dry_run="true"))
    assert fresh["profiles"]["requests"] == 12 and fresh["profiles"]["cached"] == 0
    assert fresh["profiles"]["est_prompt_tokens"] > 12 * 100
    assert fresh["dialogues"]["requests"] == 44
    assert s.total_served() == before
    assert not (tmp_path / "fresh").exists(), "a dry run writes nothing"


def test_budget_stops_a_run_and_the_rest_resumes(tmp_path: Path, synth_inputs: dict[str, Path], fake_server: Any) -> None:
    from rolemrc.api import BudgetExhausted

    ov = small_overrides(fake_server.base_url, tmp_path / "out", synth_inputs)
    with pytest.raises(BudgetExhausted, match="budget.max_requests=5"):
        run_pipeline([*ov, "budget.max_requests=5"])
    assert fake_server.requests == 5  # charged before each send (retries too): never past the cap
    run_pipeline(ov)
    assert fake_server.repeated() == {}
    assert (tmp_path / "out" / "assemble" / "sft.jsonl").exists()


def test_mixing_normalises_external_sources(synth_run: Any, tmp_path: Path) -> None:
    from rolemrc.synth.config import load_config
    from rolemrc.synth.pipeline import run

    rlhf = tmp_path / "rlhflow.jsonl"
    rlhf.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}) + "\n"  # broken: skipped
    )
    uf = tmp_path / "uf.jsonl"
    uf.write_text(json.dumps({"prompt": "q", "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}], "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]}) + "\n")
    rb = tmp_path / "rolebench.jsonl"
    rb.write_text(json.dumps({"role": "Sherlock Holmes", "question": "Who are you?", "generated": ["A consulting detective."]}) + "\n")
    from omegaconf import OmegaConf

    from tests.synth.helpers import compose

    cfg = compose([*synth_run.overrides, f"out_dir={tmp_path / 'mixed'}", "stages=[assemble]"])
    cfg = OmegaConf.to_container(cfg)
    cfg["assemble"]["mix"] = [
        {"task": "rlhflow", "into": "sft", "adapter": "messages", "source": "file", "path": str(rlhf)},
        {"task": "ultrafeedback", "into": "pairs", "adapter": "preference", "source": "file", "path": str(uf)},
        {"task": "rolebench", "into": "sft", "adapter": "role_qa", "source": "file", "path": str(rb), "default_system": "You are $role."},
    ]
    import shutil

    shutil.copytree(synth_run.out_dir / "dialogues", tmp_path / "mixed" / "dialogues")
    stats = run(load_config(cfg))
    assert stats["assemble"]["mixed"] == {"rlhflow": 1, "rlhflow:skipped": 1, "ultrafeedback": 1, "rolebench": 1}
    sft = _lines(tmp_path / "mixed" / "assemble" / "sft.jsonl")
    pairs = _lines(tmp_path / "mixed" / "assemble" / "pairs.jsonl")
    rb_rec = next(r for r in sft if r["task"] == "rolebench")
    assert rb_rec["conversations"][0] == {"role": "System", "content": "You are Sherlock Holmes."}
    uf_rec = next(r for r in pairs if r["task"] == "ultrafeedback")
    assert uf_rec["prompt"][-1] == {"role": "User", "content": "q"} and uf_rec["prompt"][0]["role"] == "System"
    assert (uf_rec["chosen"], uf_rec["rejected"]) == ("good", "bad")
    for r in sft:
        _assert_messages(r["conversations"], "Assistant", r["task"])
