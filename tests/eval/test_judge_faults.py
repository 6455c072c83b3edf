"""``python evaluate.py judge=openai`` against a misbehaving server (tests/fake_openai.py):

- empty choices, truncated JSON, HTML bodies, empty content, 429, 500 and slow answers mixed:
  one run obtains every verdict, and a rerun sends no request;
- server down: the run ends non-zero with the counts, keeping generations and metrics; once the
  server is back the same command asks only the judge;
- budget spent: non-zero, the verdicts obtained are kept (cached) and not asked again;
- no API key: fails before generation starts, naming the variable.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from rolemrc.errors import MissingAPIKey
from rolemrc.eval.run import JudgeIncomplete, run
from tests.conftest import CONF, ROOT
from tests.eval.conftest import JudgeServer
from tests.fake_openai import Request

N_ITEMS = 6  # the first 6 sample items: 9 judgements (three of them have two dimensions)
FIRST_FAULTS = ("empty_choices", "truncated", "rate_limit", "server_error", "slow", "non_json", "empty_content", None)


def _mixed(req: Request) -> str | None:
    """A fault for most first attempts and some second ones (by the prompt's hash), then answers."""
    h = int(hashlib.sha256(req.last_content.encode()).hexdigest()[:8], 16)
    if req.attempt == 1:
        return FIRST_FAULTS[h % len(FIRST_FAULTS)]
    if req.attempt == 2 and h % 3 == 0:
        return ("truncated", "rate_limit", "empty_choices")[h % 9 // 3]
    return None


def _args(out: Path, url: str, key_env: str, *extra: str) -> list[str]:
    return [
        f"limit={N_ITEMS}", "generation.max_new_tokens=4", "generation.progress=false", "metrics.names=[]",
        "judge=openai", "judge.model=fake-judge", f"judge.base_url={url}", f"judge.api_key_env={key_env}",
        "judge.timeout_s=2", "judge.backoff_s=0.01", "judge.max_backoff_s=0.05", "judge.max_attempts=6",
        f"out_dir={out}", *extra,
    ]


def _evaluate(out: Path, url: str, key_env: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *_args(out, url, key_env, *extra), f"hydra.run.dir={out}/hydra"]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)


def _compose(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_one_run_gets_every_verdict_through_mixed_faults_and_a_rerun_sends_nothing(tmp_path, judge_key_env):
    with JudgeServer(api_key=judge_key_env[1], faults=_mixed, slow_s=3.0) as server:
        out = tmp_path / "eval"
        proc = _evaluate(out, server.base_url, judge_key_env[0])
        assert proc.returncode == 0, proc.stderr[-3000:]
        counts = _metrics(out)["counts"]
        assert counts["judgement_status"] == {"ok": counts["judgements"]} and counts["judgements"] == 9
        verdicts = [json.loads(line) for line in (out / "judge.jsonl").read_text().splitlines()]
        assert len(verdicts) == 9 and all(v["status"] == "ok" and v["verdict"] in (0, 1) for v in verdicts)
        # Every kind of fault happened and was counted, in metrics.json and in the log.
        faults = counts["judge_faults"]
        for kind in ("empty_choices", "malformed_body", "rate_limited", "server_error", "timeout", "empty_content"):
            assert faults.get(kind, 0) > 0, (kind, faults, server.fault_counts)
        sf = server.fault_counts
        assert faults["malformed_body"] == sf["truncated"] + sf["non_json"]
        assert faults["empty_choices"] == sf["empty_choices"] and faults["empty_content"] == sf["empty_content"]
        assert faults["rate_limited"] == sf["rate_limit"] and faults["server_error"] == sf["server_error"]
        assert faults["timeout"] >= sf["slow"]  # (a busy machine may time out one more)
        assert counts["judge_requests"] == server.requests
        log = proc.stdout + proc.stderr
        assert "faults: " in log and "rate_limited" in log
        assert judge_key_env[1] not in proc.stdout + proc.stderr + (out / "metrics.json").read_text()

        sent = server.requests
        again = run(_compose(*_args(out, server.base_url, judge_key_env[0])))  # the same command, in process
        assert server.requests == sent  # a rerun sends nothing
        assert again["judge_stats"].cache_hits == 9 and {v.status for v in again["verdicts"]} == {"ok"}


def test_server_down_fails_with_counts_keeps_the_work_and_a_rerun_fills_in(tmp_path, judge_key_env):
    with JudgeServer(api_key=judge_key_env[1]) as server:
        server.down = True  # every connection closed without an answer
        out = tmp_path / "eval"
        proc = _evaluate(out, server.base_url, judge_key_env[0], "judge.max_attempts=2")
        assert proc.returncode != 0
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith("error: judge: 0 of 9 verdicts obtained, missing 9 failed") and "connection 18" in err, err
        assert "Traceback" not in proc.stderr
        # What was finished is kept: every generation, and a report saying what is missing.
        assert len((out / "generations.jsonl").read_text().splitlines()) == N_ITEMS
        counts = _metrics(out)["counts"]
        assert counts["judgement_status"] == {"failed": 9} and counts["judge_faults"] == {"connection": 18}

        server.down = False
        res = run(_compose(*_args(out, server.base_url, judge_key_env[0])))  # the same command, in process
        assert (res["generation"].n_new, res["generation"].n_resumed) == (0, N_ITEMS)
        assert _metrics(out)["counts"]["judgement_status"] == {"ok": 9} and server.requests == 18 + 9


def test_budget_spent_fails_keeping_the_verdicts_obtained(tmp_path, judge_server, judge_key_env):
    out = tmp_path / "eval"
    args = _args(out, judge_server.base_url, judge_key_env[0])
    with pytest.raises(JudgeIncomplete, match=r"3 of 9 verdicts obtained, missing 6 budget_exhausted"):
        run(_compose(*args, "judge.max_requests=3"))
    assert judge_server.requests == 3
    assert [json.loads(v)["status"] for v in (out / "judge.jsonl").read_text().splitlines()].count("ok") == 3
    res = run(_compose(*args))
    assert judge_server.requests == 9 and res["judge_stats"].cache_hits == 3
    assert {v.status for v in res["verdicts"]} == {"ok"}


def test_missing_key_fails_before_generation_naming_the_variable(tmp_path, judge_server, monkeypatch):
    monkeypatch.delenv("ROLEMRC_NO_SUCH_KEY", raising=False)
    out = tmp_path / "eval"
    with pytest.raises(MissingAPIKey, match="ROLEMRC_NO_SUCH_KEY"):
        run(_compose(*_args(out, judge_server.base_url, "ROLEMRC_NO_SUCH_KEY")))
    assert not (out / "generations.jsonl").exists() and judge_server.requests == 0
