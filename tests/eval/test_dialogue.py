"""evaluate.py's dialogue mode (env=<name>, rolemrc.eval.dialogue) on data=sample_dialogues: a
conversation per seed with the scripted user, every reply judged and each conversation judged on
role consistency, scores by turn in summary.md / metrics.json / the plot; resume after an
interruption plays only what is missing and asks the judge nothing twice; the openai backend's
text loop (rolemrc.env.converse) against the loopback server; conversations from a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data.templates import ChatFormat
from rolemrc.env import Fault, Reply, ScriptedEnv, converse
from rolemrc.errors import ConfigError
from rolemrc.eval import dialogue, generation
from rolemrc.eval.generation import GenerationIncomplete
from rolemrc.eval.judge import JudgeIncomplete
from rolemrc.eval.report import log_to_loggers
from rolemrc.eval.run import run
from tests.eval.test_evaluate_run import compose_eval, export  # noqa: F401 - the tiny export fixture
from tests.fake_openai import FakeOpenAI, Request

SEEDS = [json.loads(x) for x in Path(asset("sample/dialogues.jsonl")).read_text().splitlines()]
FAST = ["env=scripted", "env.max_turns=4", "data=sample_dialogues", "generation.progress=false",
        "generation.cpu_threads=1",
        "generation.max_new_tokens=4", "judge.max_tokens=4"]
REPLIES = ["[[good]] Aye shipmate.", "[[good]] Aye, the tide.", "Sure! [[bad]]"]  # turn 3 slips


def judge_answer(req: Request) -> str:
    """Per-turn prompts: VERDICT 1 when the reply judged carries [[good]]; the consistency prompt:
    1 unless some reply carries [[bad]]."""
    content = req.last_content
    if "## Reply to judge" in content:
        reply = content.split("## Reply to judge", 1)[1].split("## Criterion", 1)[0]
        return f"Checked.\nVERDICT: {int('[[good]]' in reply)}"
    return f"Checked the whole dialogue.\nVERDICT: {int('[[bad]]' not in content)}"


def judge_args(server: FakeOpenAI, key_env: str) -> list[str]:
    return ["judge=openai", "judge.model=judge-test", f"judge.base_url={server.base_url}",
            f"judge.api_key_env={key_env}", "judge.backoff_s=0.01", "judge.max_backoff_s=0.05"]


class ScriptedModel:
    """Stands in for the tiny model's greedy continuations: at turn k, ``REPLIES[k-1]`` as the
    template tokenises it (the turn read from the prompt: its assistant turns so far)."""

    def __init__(self, r: Any, model: Any, tokenizer: Any, stops: Any, fail_after: int | None = None) -> None:
        self.chat = ChatFormat(tokenizer, eot=r.model.eot_token)
        self.prompts: list[list[int]] = []
        self.fail_after = fail_after

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        if self.fail_after is not None and len(self.prompts) >= self.fail_after:
            raise KeyboardInterrupt  # killed mid-run
        self.prompts += prompts
        out = []
        for p in prompts:
            turn = sum(r in self.chat.tokenizer.decode(p) for r in REPLIES)
            out.append(self.chat.encode_response([{"role": "user", "content": "q"}], REPLIES[turn]))
        return out


def test_dialogues_by_turn_then_resume_after_an_interruption(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             api_key_env: tuple[str, str]) -> None:
    made: list[ScriptedModel] = []

    def model(fail_after: int | None = None):
        def make(*args: Any) -> ScriptedModel:
            made.append(ScriptedModel(*args, fail_after=fail_after))
            return made[-1]
        return make

    out = tmp_path / "eval"
    with FakeOpenAI(api_key=api_key_env[1], answer=judge_answer) as server:
        args = [*FAST, "limit=4", "generation.batch_size=2", f"out_dir={out}", *judge_args(server, api_key_env[0])]
        # Killed after the first two conversations (one batch of seeds): they are kept.
        monkeypatch.setattr(dialogue, "hf_generate", model(fail_after=6))
        with pytest.raises(KeyboardInterrupt):
            run(compose_eval(*args))
        assert len((out / "dialogues.jsonl").read_text().splitlines()) == 2

        # The rerun plays only the two missing seeds, then judges everything.
        monkeypatch.setattr(dialogue, "hf_generate", model())
        res = run(compose_eval(*args))
        assert len(made[-1].prompts) == 2 * 3  # two conversations, three turns each
        records = [json.loads(x) for x in (out / "dialogues.jsonl").read_text().splitlines()]
        assert len(records) == 4 and {r["reason"] for r in records} == {"script_end"}
        for rec, seed in zip(records, SEEDS):
            users = [m["content"] for m in rec["messages"] if m["role"] == "user"]
            assert users == [seed["prompt"][-1]["content"], *seed["user_turns"]]
            assert [m["content"] for m in rec["messages"] if m["role"] == "assistant"] == REPLIES

        # Scores by turn: the role holds two turns, then slips; the dialogue is judged inconsistent.
        doc = json.loads((out / "metrics.json").read_text())
        s = doc["dialogue"]["scores"]
        assert (s["dialogue/turn_1/NI"], s["dialogue/turn_2/NI"], s["dialogue/turn_3/NI"]) == (1.0, 1.0, 0.0)
        assert s["dialogue/consistency"] == 0.0 and s["dialogue/turns_mean"] == 3.0
        assert s["dialogue/ends/script_end"] == 4.0 and s["dialogue/turn_3/replies"] == 4.0
        assert doc["dialogue"]["consistency"]["n_ok"] == 4
        summary = (out / "summary.md").read_text()
        assert "### Scores by turn" in summary and "| 3 | 4 | 0.00% (4) |" in summary
        assert "| 1 | 4 | 100.00% (4) |" in summary and "Role consistency across the turns" in summary
        assert (out / dialogue.PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
        verdicts = [json.loads(x) for x in (out / "judge.jsonl").read_text().splitlines()]
        assert len(verdicts) == 4 * 3 + 4 and sum(v["dimension"] == "consistency" for v in verdicts) == 4
        assert res["scores"] == s

        # Once more: nothing played, nothing asked.
        sent = server.requests
        monkeypatch.setattr(dialogue, "hf_generate", model(fail_after=0))
        run(compose_eval(*args))
        assert server.requests == sent
        assert json.loads((out / "metrics.json").read_text())["dialogue"]["scores"] == s


def test_vllm_backend_plumbing_with_a_stand_in_engine(export: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """generation.backend=vllm without vllm (CPU): a stand-in for vLLM's module, LLM and outputs
    (token ids as vLLM gives them: the stop token last) runs the dialogue mode end to end; vLLM
    itself is exercised on GPU nodes only."""
    built: list[dict] = []

    class Out:
        def __init__(self, ids: list[int]) -> None:
            self.outputs = [type("C", (), {"token_ids": ids})()]

    class Cfg:
        class model:
            eot_token = None

    player = ScriptedModel(Cfg, None, AutoTokenizer.from_pretrained(export), None)

    fake = object()
    monkeypatch.setattr(generation, "require_vllm", lambda *a, **k: fake)
    monkeypatch.setattr(dialogue, "require_vllm", lambda *a, **k: fake)
    monkeypatch.setattr(dialogue, "build_llm", lambda vllm, **kw: built.append(kw) or "llm")
    monkeypatch.setattr(dialogue, "llm_generate", lambda vllm, llm, prompts, sampling, stops: [
        Out(ids) for ids in player(prompts)])
    out = tmp_path / "eval"
    run(compose_eval(*FAST, "limit=3", "generation.backend=vllm", f"model.path={export}", f"out_dir={out}"))
    assert built and built[0]["model"] == str(export)
    records = [json.loads(x) for x in (out / "dialogues.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in records] == ["script_end"] * 3
    assert all([m["content"] for m in r["messages"] if m["role"] == "assistant"] == REPLIES for r in records)


def test_the_tiny_model_end_to_end_with_a_local_judge(tmp_path: Path) -> None:
    """No stand-in: the random-init tiny model holds the conversations (its replies run to
    max_new_tokens: each ends at turn 1, truncated) and judges them (judge=hf)."""
    out = tmp_path / "eval"
    run(compose_eval(*FAST, "limit=2", "judge=hf", f"out_dir={out}"))
    records = [json.loads(x) for x in (out / "dialogues.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in records] == ["truncated", "truncated"] and all(r["n_tokens"] for r in records)
    verdicts = [json.loads(x) for x in (out / "judge.jsonl").read_text().splitlines()]
    assert sorted(v["dimension"] for v in verdicts) == ["NI", "NI", "consistency", "consistency"]
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["dialogue"]["ends"] == {"truncated": 2} and doc["dialogue"]["by_turn"][0]["replies"] == 2
    assert "### Scores by turn" in (out / "summary.md").read_text()


def served_reply(req: Request) -> str:
    """The served role-player: its reply names the user turn it answers (a function of the conversation)."""
    return f"[[good]] Aye, to {req.last_content[:30]!r}."


def test_openai_text_loop_resumes_and_reads_whole_conversations_from_a_file(
        tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    key = api_key_env[0]
    down = {"on": True}
    # The second seed's third turn fails until the server recovers: that conversation is unfinished.
    third = SEEDS[1]["user_turns"][1]

    def faults(req: Request) -> str | None:
        return "unavailable" if down["on"] and req.last_content == third else None

    def judge_faults(req: Request) -> str | None:  # the consistency judge is down while the model is
        return "unavailable" if down["judge"] and "## Reply to judge" not in req.last_content else None

    down["judge"] = True
    out = tmp_path / "eval"
    with FakeOpenAI(api_key=api_key_env[1], answer=served_reply, faults=faults) as served, \
            FakeOpenAI(api_key=api_key_env[1], answer=judge_answer, faults=judge_faults) as judge:
        args = [*FAST, "limit=3", "generation.backend=openai", "generation.model=served-test",
                f"generation.base_url={served.base_url}", f"generation.api_key_env={key}",
                "generation.backoff_s=0.01", "generation.max_backoff_s=0.05", "generation.max_attempts=2",
                f"out_dir={out}", *judge_args(judge, key)]
        with pytest.raises(GenerationIncomplete, match="1 of 3 conversations unfinished"):
            run(compose_eval(*args))
        assert len((out / "dialogues.jsonl").read_text().splitlines()) == 2
        down["on"] = False
        before = served.requests
        with pytest.raises(JudgeIncomplete, match="9 of 12 verdicts obtained, missing 3 failed"):
            run(compose_eval(*args))
        assert served.requests == before + 1  # the unfinished one's first two replies come from the cache
        doc = json.loads((out / "metrics.json").read_text())["dialogue"]  # the report of what was obtained
        assert doc["consistency"]["n_failed"] == 3 and "dialogue/consistency" not in doc["scores"]  # never a 0
        assert doc["scores"]["dialogue/turn_3/NI"] == 1.0
        down["judge"] = False
        asked = judge.requests
        run(compose_eval(*args))
        assert served.requests == before + 1 and judge.requests == asked + 3  # only the missing verdicts
        records = [json.loads(x) for x in (out / "dialogues.jsonl").read_text().splitlines()]
        assert len(records) == 3 and {r["reason"] for r in records} == {"script_end"}
        conv = records[2]["messages"]  # the whole conversation was sent: each reply answers its user turn
        assert [m["role"] for m in conv] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
        assert conv[4]["content"] == f"[[good]] Aye, to {conv[3]['content'][:30]!r}."
        s = json.loads((out / "metrics.json").read_text())["dialogue"]["scores"]
        assert s["dialogue/turn_3/NI"] == 1.0 and s["dialogue/consistency"] == 1.0

        # The same conversations as a file: scored without generating, the same scores.
        path = tmp_path / "conversations.jsonl"
        path.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in records))
        out2 = tmp_path / "file"
        run(compose_eval(*FAST, "limit=3", "generation.backend=file", f"generation.path={path}", f"out_dir={out2}",
                         *judge_args(judge, key)))
        s2 = json.loads((out2 / "metrics.json").read_text())["dialogue"]["scores"]
        assert {k: v for k, v in s2.items() if "/ends/" not in k} == {k: v for k, v in s.items() if "/ends/" not in k}
        assert s2["dialogue/ends/file"] == 3.0
        path.write_text(json.dumps({"messages": records[0]["messages"]}) + "\n")
        with pytest.raises(GenerationIncomplete, match="2 of 3 seeds have no conversation"):
            run(compose_eval(*FAST, "limit=3", "generation.backend=file", f"generation.path={path}",
                             f"out_dir={tmp_path / 'file2'}"))


def test_an_llm_user_env_its_failures_unscored_then_resumed(tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    """env=llm_user (any registered environment): the served user talks with the served model; a
    user that fails for one conversation leaves it unfinished, never scored; the rerun holds only
    that one, the others' user turns and replies from the caches."""
    key = api_key_env[0]
    broken = {"on": True}
    first_turn = SEEDS[0]["prompt"][-1]["content"]

    def answer(req: Request) -> str:
        model = req.body["model"]
        if model == "user-test":
            return f"And what about the sea? (turn {sum(m['role'] == 'assistant' for m in req.body['messages'])})"
        if model == "judge-test":
            return judge_answer(req)
        return served_reply(req)

    def faults(req: Request) -> str | None:
        text = json.dumps(req.body["messages"])
        return "unavailable" if broken["on"] and req.body["model"] == "user-test" and first_turn in text else None

    out = tmp_path / "eval"
    with FakeOpenAI(api_key=api_key_env[1], answer=answer, faults=faults) as server:
        args = [*FAST, "env=llm_user", "env.max_turns=2", "limit=2", "generation.backend=openai",
                "generation.model=served-test", f"generation.base_url={server.base_url}",
                f"generation.api_key_env={key}", "env.user.model=user-test", f"env.user.base_url={server.base_url}",
                f"env.user.api_key_env={key}", "env.user.max_attempts=1", "env.user.backoff_s=0.01",
                f"out_dir={out}", *judge_args(server, key)]
        with pytest.raises(GenerationIncomplete, match="1 of 2 conversations unfinished.*user_failed"):
            run(compose_eval(*args))
        assert len((out / "dialogues.jsonl").read_text().splitlines()) == 1
        broken["on"] = False
        before = server.requests
        run(compose_eval(*args))
        records = [json.loads(x) for x in (out / "dialogues.jsonl").read_text().splitlines()]
        assert [r["reason"] for r in records] == ["turn_cap", "turn_cap"]
        assert [m["role"] for m in records[1]["messages"]][2:] == ["assistant", "user", "assistant"]
        # the failed conversation: 1 user turn + 1 reply asked again (its first reply cached), then the judge
        judge_requests = 2 * 2 + 2  # NI per reply, one consistency each
        assert server.requests - before == 2 + judge_requests


def test_text_loop_end_reasons_and_faults() -> None:
    rows = [{"messages": [{"role": s["role"].lower(), "content": s["content"]} for s in seed["prompt"]],
             "columns": {"user_turns": seed["user_turns"]}} for seed in SEEDS[:4]]
    answers = iter([[Reply("a"), Reply("b", cut=True), Reply("c", tokens=900), Fault("down")], [Reply("d")]])
    d = converse([ScriptedEnv().reset(r) for r in rows], lambda batch: next(answers), max_turns=2, max_tokens=800)
    assert [x.reason for x in d] == ["turn_cap", "truncated", "length_cap", ""]
    assert [x.turns for x in d] == [2, 1, 1, 0] and d[3].error == "down" and not d[3].finished


def test_bad_consistency_template_no_matplotlib_and_loggers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "t.txt"
    bad.write_text("Judge {dialogue}.\nVERDICT: 1 or 0")
    with pytest.raises(ConfigError, match=r"dialogue.consistency_template=.*unknown placeholder\(s\) \{dialogue\}"):
        dialogue.load_template(str(bad))
    bad.write_text("Judge {conversation}.")
    with pytest.raises(ConfigError, match="never asks for the verdict line"):
        dialogue.load_template(str(bad))

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the plot is skipped, the report says so
    rows = [{"turn": 1, "replies": 1, "judge": {}, "rule": 1.0, "rule_n": 1}]
    note = dialogue.plot(rows, None, tmp_path / "p.png")
    assert "matplotlib is not installed" in note and not (tmp_path / "p.png").exists()
    assert f"Plot: {note}" in dialogue.render("scripted", 3, [], ["turn"], [[1]], None, note, 0)

    class Logger:  # what the W&B logger is given
        def __init__(self) -> None:
            self.got: list[Any] = []

        def log_metrics(self, m: Any, step: int) -> None:
            self.got.append(("metrics", m))

        def log_table(self, key: str, columns: Any, data: Any) -> None:
            self.got.append(("table", key))

        def log_image(self, key: str, images: Any) -> None:
            self.got.append(("image", key, images))

        def finalize(self, status: str) -> None:
            pass

    lg = Logger()
    log_to_loggers([lg], {"dialogue/consistency": 1.0}, [], ["id"], tables={"dialogue_by_turn": (["turn"], [[1]])},
                   images={"dialogue_by_turn": tmp_path / "p.png"})
    assert lg.got[1:] == [("table", "samples"), ("table", "dialogue_by_turn"),
                          ("image", "dialogue_by_turn", [str(tmp_path / "p.png")])]
