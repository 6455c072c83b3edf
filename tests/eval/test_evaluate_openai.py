"""generation.backend=openai through evaluate.py: the evaluated model behind the real loopback
fake server (tests/fake_openai.py) with scripted faults. Every reply arrives (429/5xx/malformed
200s retried), the requests carry the test conversation as chat messages at temperature 0, a
rerun of a finished run sends nothing, missing replies end the run non-zero naming how many, and
the RoleBench and CharacterLLM suites generate through the same backend."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rolemrc import asset
from rolemrc.eval.generation import GenerationIncomplete
from rolemrc.eval.run import run
from tests.conftest import ROOT
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

N = 6
FAST = ["generation.progress=false", "generation.max_new_tokens=32", "generation.backoff_s=0.01",
        "generation.max_backoff_s=0.05", "generation.timeout_s=5", "metrics.names=[bleu,rouge1,rougeL,rougeLsum]"]


def sample_items(n: int = N) -> list[dict]:
    return [json.loads(x) for x in Path(asset("sample/test.jsonl")).read_text().splitlines()[:n]]


def last_user(messages: list[dict]) -> str:
    return messages[-1]["content"]


def reply_for(req: Request) -> str:
    """The served model's reply: a function of the conversation, so a test can check which is which."""
    return f"Aye shipmate, as to {last_user(req.body['messages'])[:40]!r}: the tide turns."


def openai_overrides(server: FakeOpenAI, key_env: str, out: Path, *extra: str) -> list[str]:
    return [*FAST, "generation.backend=openai", "generation.model=served-test", f"generation.base_url={server.base_url}",
            f"generation.api_key_env={key_env}", f"out_dir={out}", *extra]


def test_every_reply_arrives_under_faults_and_a_rerun_sends_nothing(api_key_env: tuple[str, str],
                                                                    tmp_path: Path) -> None:
    items = sample_items()
    # Per conversation (its last user turn), the faults of its first attempts, in order.
    plan = {last_user(items[0]["question"]): ["rate_limit", "rate_limit"],
            last_user(items[1]["question"]): ["server_error"],
            last_user(items[2]["question"]): ["truncated"],
            last_user(items[3]["question"]): ["empty_content"],
            last_user(items[4]["question"]): ["non_json"]}

    def faults(req: Request) -> str | None:
        seq = plan.get(last_user(req.body["messages"]), [])
        return seq[req.attempt - 1] if req.attempt <= len(seq) else None

    out = tmp_path / "eval"
    with FakeOpenAI(api_key=api_key_env[1], answer=reply_for, faults=faults) as server:
        seen: list[dict] = []
        real = server._decide

        def record(path: str, auth: str, raw: bytes):  # the bodies the server received
            seen.append(json.loads(raw))
            return real(path, auth, raw)

        server._decide = record  # type: ignore[method-assign]
        res = run(compose_eval(*openai_overrides(server, api_key_env[0], out), "data=sample", f"limit={N}"))

        # Every reply, in item order, is the served model's answer to that conversation.
        gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
        by_id = {g["id"]: g for g in gens}
        assert len(gens) == N and sorted(by_id) == sorted(res["ids"])
        for iid, it in zip(res["ids"], items):
            want = f"Aye shipmate, as to {last_user(it['question'])[:40]!r}: the tide turns."
            assert by_id[iid]["reply"] == want and by_id[iid]["stopped"] is True
        # Each request: the test conversation as chat messages, greedy, max_new_tokens.
        convs = [[{"role": m["role"].lower(), "content": m["content"]} for m in it["question"]] for it in items]
        assert len(seen) == N + 2 + 1 + 1 + 1 + 1  # one good answer each, plus the scripted faults
        for body in seen:
            assert body["model"] == "served-test" and body["temperature"] == 0.0 and body["max_tokens"] == 32
            assert body["messages"] in convs
            assert {m["role"] for m in body["messages"]} <= {"system", "user", "assistant"}
        assert server.unauthorized == 0

        doc = json.loads((out / "metrics.json").read_text())
        c = doc["counts"]
        assert c["generated"] == N and c["generation_requests"] == len(seen)
        assert c["generation_faults"] == {"rate_limited": 2, "server_error": 1, "malformed_body": 2, "empty_content": 1}
        assert doc["meta"]["model"] == f"served-test (OpenAI-compatible API at {server.base_url})"
        assert doc["metrics"]["summary"]["rougeL"]["n"] == N
        # The cache holds the good replies only (none of the faults).
        with sqlite3.connect(out / "generation_cache" / "generation_cache.sqlite") as db:
            texts = [t for (t,) in db.execute("SELECT text FROM answers")]
        assert sorted(texts) == sorted(g["reply"] for g in gens)

        # A rerun of the finished run sends no request at all.
        before = server.requests
        again = run(compose_eval(*openai_overrides(server, api_key_env[0], out), "data=sample", f"limit={N}"))
        assert server.requests == before
        assert again["generation"].n_resumed == N and again["generation"].n_new == 0
        # A fresh folder sharing the cache: no request either (good replies come from the cache).
        fresh = run(compose_eval(*openai_overrides(server, api_key_env[0], tmp_path / "fresh",
                                                   f"generation.cache_dir={out / 'generation_cache'}"),
                                 "data=sample", f"limit={N}"))
        assert server.requests == before and fresh["generation"].replies == again["generation"].replies
    # The key never reaches the report files.
    for f in out.iterdir():
        if f.is_file():
            assert api_key_env[1] not in f.read_text(errors="ignore"), f


def test_missing_replies_end_evaluate_py_non_zero_then_a_rerun_asks_only_for_them(
        api_key_env: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As a user runs it: `python evaluate.py generation.backend=openai ...` against a server that
    keeps failing one conversation exits 1 naming how many replies are missing, keeps the others;
    once the server recovers the same run asks only for that one and prints the headline table."""
    items = sample_items()
    broken = last_user(items[2]["question"])
    state = {"down": True}

    def faults(req: Request) -> str | None:
        return "unavailable" if state["down"] and last_user(req.body["messages"]) == broken else None

    out = tmp_path / "eval"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    with FakeOpenAI(api_key=api_key_env[1], answer=reply_for, faults=faults) as server:
        cmd = [sys.executable, "evaluate.py", *openai_overrides(server, api_key_env[0], out), "data=sample",
               f"limit={N}", "generation.max_attempts=2"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert f"error: generation: 1 of {N} replies missing from served-test" in proc.stderr
        assert "server_error 2" in proc.stderr and "rerun the same command" in proc.stderr
        assert len((out / "generations.jsonl").read_text().splitlines()) == N - 1
        assert not (out / "metrics.json").exists()  # nothing scored with a reply missing
        assert api_key_env[1] not in proc.stdout + proc.stderr

        state["down"] = False
        served = server.total_served()
        capsys.readouterr()
        run(compose_eval(*cmd[2:]))  # the same overrides, in this process
        assert server.total_served() == served + 1  # only the missing reply was asked for
        # The headline table on the console, then the summary's path.
        stdout = capsys.readouterr().out
        assert "| ROUGE-L |" in stdout and "| metric | mean ± std | n |" in stdout
        assert f"evaluation summary: {out / 'summary.md'}" in stdout
    assert len((out / "generations.jsonl").read_text().splitlines()) == N


def test_rolebench_and_characterllm_suites_generate_through_the_api(api_key_env: tuple[str, str],
                                                                    tmp_path: Path) -> None:
    def answer(req: Request) -> str:
        if "'SCORE: <1-7>'" in last_user(req.body["messages"]):
            return "Consistent enough.\nSCORE: 5"
        return reply_for(req)

    with FakeOpenAI(api_key=api_key_env[1], answer=answer) as server:
        rb = run(compose_eval(*openai_overrides(server, api_key_env[0], tmp_path / "rb"), "data=rolebench_sample",
                              "limit=1"))
        gens = [json.loads(x) for x in (tmp_path / "rb" / "rolebench" / "generations.jsonl").read_text().splitlines()]
        assert len(gens) == 6 and all(g["reply"].startswith("Aye shipmate") for g in gens)
        assert rb["results"]["counts"]["generation_requests"] == 6
        assert rb["results"]["rolebench"]["splits"]["InstZh"]["CUS"]["n"] == 1

        cl = run(compose_eval(*openai_overrides(server, api_key_env[0], tmp_path / "cl"), "data=characterllm_sample",
                              "data.characterllm.questions=1", "data.characterllm.turns=2", "judge=openai",
                              "judge.model=judge-test", f"judge.base_url={server.base_url}",
                              f"judge.api_key_env={api_key_env[0]}"))
        res = cl["results"]["characterllm"]
        assert cl["results"]["counts"]["generated"] > 0 and cl["results"]["counts"]["generation_requests"] > 0
        assert not res.get("missing")
        before = server.requests
        run(compose_eval(*openai_overrides(server, api_key_env[0], tmp_path / "cl"), "data=characterllm_sample",
                         "data.characterllm.questions=1", "data.characterllm.turns=2", "judge=openai",
                         "judge.model=judge-test", f"judge.base_url={server.base_url}",
                         f"judge.api_key_env={api_key_env[0]}"))
        assert server.requests == before  # replies resumed, scores cached


def test_openai_backend_checks_before_anything_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rolemrc.errors import ConfigError, MissingAPIKey

    monkeypatch.delenv("ROLEMRC_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="generation.backend=openai needs generation.model"):
        run(compose_eval("generation.backend=openai", "data=sample", f"out_dir={tmp_path}"))
    with pytest.raises(MissingAPIKey, match="ROLEMRC_NO_SUCH_KEY"):
        run(compose_eval("generation.backend=openai", "generation.model=m", "generation.api_key_env=ROLEMRC_NO_SUCH_KEY",
                         "data=sample", f"out_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="generation.backend must be one of hf, vllm, openai, file"):
        run(compose_eval("generation.backend=tgi", "data=sample", f"out_dir={tmp_path}"))
    assert not (tmp_path / "generations.jsonl").exists()
    assert issubclass(GenerationIncomplete, RuntimeError)
