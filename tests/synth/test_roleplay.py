"""Context-Instruct and RoleGPT stages against the shared fake OpenAI server on loopback:
segments -> checked question-answer-confidence triples filtered by confidence; dialogue-mode
few-shot replies; 429s and unparseable answers retried; an answer never usable reported as
missing (non-zero) and asked again by a rerun, nothing else resent; the output trains as it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rolemrc.data.readers import read_examples
from rolemrc.data.roles import RoleSystem
from rolemrc.synth.pipeline import SynthIncomplete
from rolemrc.synth.roleplay import segments
from tests.fake_openai import FakeOpenAI, Request
from tests.synth.helpers import API_KEY, API_KEY_ENV, run_pipeline

PAD = " It was written down in the island's records, which anyone may read at the harbour office."
SCRIPT = {  # each paragraph over 100 characters: with segment_chars=200, one segment each
    "Wren": ["The keeper lit the lamp at dusk for thirty-one winters." + PAD,
             "GLITCH He logged every storm in a leather book kept by the stove." + PAD,
             "His sister Maud rowed out each Sunday with bread and letters." + PAD],
    "Colette": ["Colette runs the ovens of Le Petit Fouet in Lyon." + PAD, "She folds the butter into the dough by hand." + PAD],
}


class RolePlayServer(FakeOpenAI):
    """Triples for Context-Instruct (one confident, one not, per segment), in-role replies for
    RoleGPT; GLITCH segments' first answer is cut in half; questions marked [[ai]] always get an
    out-of-character reply unless ``fixed``."""

    fixed = False

    def chat_content(self, req: Request) -> str:
        rf = req.body.get("response_format") or {}
        text = req.last_content
        if rf.get("type") == "json_schema" and rf["json_schema"]["name"] == "qa_confidence_triples":
            seg = text.split('"""')[1].strip()
            first = seg.split()[1] if seg.startswith("GLITCH") else seg.split()[0]
            return json.dumps({"items": [
                {"question": f"What about {first}?", "answer": f"I remember {first} well.", "confidence": 9},
                {"question": f"Guess about {first}?", "answer": "Perhaps.", "confidence": 3}]})
        if "[[ai]]" in text and not self.fixed:
            return "As an AI language model, I cannot have a favourite."
        system = req.body["messages"][0]["content"]
        return f"{system.split('.')[0].removeprefix('You are ')} says: {text[:20]}"

    def fault(self, req: Request) -> str | None:
        if "GLITCH" in req.last_content and req.attempt == 1:
            return "invalid_content"
        if req.attempt == 1 and req.index % 4 == 0:
            return "rate_limit"
        return None


@pytest.fixture()
def inputs(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "colette.txt").write_text("\n\n".join(SCRIPT["Colette"]))
    roles = [
        {"name": "Wren", "description": "A lighthouse keeper.", "catchphrases": ["Aye"],
         "dialogue": [{"user": "Cold out?", "assistant": "Aye, bitter."}, {"user": "Tea?", "assistant": "Aye, strong."}],
         "script": "\n\n".join(SCRIPT["Wren"])},
        {"name": "Colette", "description": "A pastry chef.", "catchphrases": ["Voila!"], "script_file": "colette.txt"},
    ]
    (tmp_path / "roles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in roles))
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in
                                                      ["Name a colour.", "Give advice on sleep.", "Favourite film? [[ai]]"]))
    return {"roles": tmp_path / "roles.jsonl", "questions": tmp_path / "questions.jsonl"}


def overrides(server: FakeOpenAI, out: Path, inputs: dict[str, Path], *extra: str) -> list[str]:
    return [f"out_dir={out}", "progress=false", "stages=[context_instruct,rolegpt]",
            f"generator.base_url={server.base_url}", "generator.model=fake-gen", f"generator.api_key_env={API_KEY_ENV}",
            "generator.backoff_s=0.01", "generator.max_retries=2", "generator.timeout_s=20",
            f"context_instruct.roles={inputs['roles']}", "context_instruct.segment_chars=200",
            "context_instruct.per_segment=2", f"rolegpt.roles={inputs['roles']}",
            f"rolegpt.questions={inputs['questions']}", "rolegpt.few_shot=1", *extra]


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_segments_cut_at_paragraphs() -> None:
    text = "\n\n".join(["a" * 90, "b" * 90, "c" * 90, "d " * 150])
    segs = segments(text, 200)
    assert segs[0] == "a" * 90 + "\n\n" + "b" * 90 and segs[1] == "c" * 90
    assert all(len(s) <= 200 for s in segs) and "".join(segs).replace("\n", "").replace(" ", "") == \
        text.replace("\n", "").replace(" ", "")


def test_context_instruct_and_rolegpt_stages(tmp_path: Path, inputs: dict[str, Path]) -> None:
    out = tmp_path / "out"
    with RolePlayServer(api_key=API_KEY) as server:
        ov = overrides(server, out, inputs)
        with pytest.raises(SynthIncomplete, match="rolegpt 2 record"):
            run_pipeline(ov)
        ci = rows(out / "context_instruct" / "rows.jsonl")
        # One segment per paragraph (200 chars), one confident triple kept per segment.
        assert len(ci) == 5 and all(r["confidence"] >= 7 for r in ci)
        assert {r["question"] for r in ci if r["role"] == "Wren"} == {"What about The?", "What about He?", "What about His?"}
        assert server.fault_counts["invalid_content"] == 1 and server.fault_counts["rate_limit"] >= 1
        rg = rows(out / "rolegpt" / "rows.jsonl")
        assert len(rg) == 4 and all("[[ai]]" not in r["question"] for r in rg)
        missing = rows(out / "rolegpt" / "missing.jsonl")
        assert sorted(m["id"] for m in missing) == ["Colette#5", "Wren#2"] and {m["reason"] for m in missing} == {"rejected"}
        # Dialogue mode: the role's own exchanges come as earlier turns (few_shot=1).
        wren = next(r for r in rg if r["role"] == "Wren")
        assert wren["generated"][0].startswith("Wren says:")
        # The output trains as it is: conversations with the RoCIT system turn, and RoleBench rows.
        convs, _ = read_examples([{"path": str(out / "context_instruct" / "sft.jsonl")}], "sft")
        system = RoleSystem({"profiles": [str(out / "context_instruct" / "roles.jsonl")]})
        assert convs[0].messages[0]["content"] == system(ci[0]["role"])
        rb, _ = read_examples([{"path": str(out / "rolegpt" / "rows.jsonl"), "format": "rolebench",
                                "roles": {"profiles": [str(out / "rolegpt" / "roles.jsonl")]}}], "sft")
        assert len(rb) == 4 and '"Aye"' in rb[0].messages[0]["content"]
        # Rerun with the server fixed: only the two missing requests are sent.
        sent = server.requests
        server.fixed = True
        stats = run_pipeline(ov)
        assert server.requests - sent == 2
        assert stats["rolegpt"]["rows"] == 6 and stats["rolegpt"]["missing"] == 0
        assert stats["context_instruct"]["kept"] == 5  # up to date: not redone
        # A dry run plans only what was asked (no RoleMRC chain), sends nothing.
        sent = server.requests
        dry = run_pipeline(overrides(server, out, inputs, "dry_run=true", "rolegpt.per_role=1"))
        assert list(dry) == ["context_instruct", "rolegpt"] and server.requests == sent
        assert dry["rolegpt"]["requests"] == 2 and dry["rolegpt"]["cached"] == 2


def test_bad_role_records_name_file_and_line(tmp_path: Path, inputs: dict[str, Path]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(inputs["roles"].read_text() + json.dumps({"name": "Nemo", "description": "x"}) + "\n")
    with RolePlayServer(api_key=API_KEY) as server:
        with pytest.raises(ValueError, match=rf"{bad}:3: role 'Nemo' has no 'script'"):
            run_pipeline(overrides(server, tmp_path / "o", inputs, f"context_instruct.roles={bad}"))
        assert server.requests == 0
    with pytest.raises(ValueError, match="rolegpt.questions: must name"):
        run_pipeline([f"out_dir={tmp_path}", "stages=[rolegpt]", f"rolegpt.roles={bad}"])


def test_readme_dry_run_on_the_shipped_roles_file(tmp_path: Path) -> None:
    """The docs' offline command (docs/synthesis.md) on the shipped sample roles (scripts read
    through script_file) exits 0 and plans one request per segment, sending nothing."""
    import os
    import shlex
    import subprocess
    import sys

    from tests.synth.helpers import REPO

    readme = (REPO / "docs" / "synthesis.md").read_text(encoding="utf-8")
    [line] = [ln for ln in readme.splitlines()
              if ln.startswith("python synthesize.py stages=[context_instruct]") and "roles_with_scripts.jsonl" in ln
              and ln.endswith("dry_run=true")]
    argv = shlex.split(line)[2:]
    roles = next(a for a in argv if a.startswith("context_instruct.roles=")).split("=", 1)[1]
    assert (REPO / roles).is_file()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "COLUMNS": "250"}
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run([sys.executable, str(REPO / "synthesize.py"), *argv, f"out_dir={tmp_path / 'out'}",
                           "progress=false", f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "roles=3" in proc.stdout and "would send 3" in proc.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing into out_dir
