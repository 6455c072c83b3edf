"""Config and input errors fail early and name the key, file or line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolemrc.synth.config import PersonasConfig, load_config
from rolemrc.synth.sources import load_mrc, load_personas
from tests.synth.helpers import compose


def test_default_config_and_groups_compose() -> None:
    cfg = load_config(compose([]))
    assert cfg.generator.model == "gpt-4o" and cfg.embedder.backend == "transformers"
    assert sum(v for v in cfg.dialogues.quotas.values() if v) == 24000  # paper-sized defaults (24k SFT)
    cfg = load_config(compose(["synth/generator=vllm", "synth/embedder=sfr_mistral", "synth/mix=rolemrc_mix"]))
    assert cfg.generator.api_key_env is None and cfg.embedder.backend == "openai"
    assert [m.task for m in cfg.assemble.mix] == ["rolebench", "rlhflow", "ultrafeedback"]


def test_typos_and_bad_values_fail_naming_the_key() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="generator.modle"):
        compose(["generator.modle=x"])
    with pytest.raises(ValueError, match="dialogues.narration_ratio"):
        load_config(compose(["dialogues.narration_ratio=1.5"]))
    with pytest.raises(ValueError, match="dialogues.quotas.chitchat"):
        load_config(compose(["+dialogues.quotas.chitchat=3"]))
    with pytest.raises(ValueError, match="stages"):
        load_config(compose(["stages=[personas,profile]"]))


def test_bad_input_lines_are_named(tmp_path: Path) -> None:
    p = tmp_path / "personas.jsonl"
    p.write_text(json.dumps({"persona": "A sailor who tells long stories."}) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"personas.jsonl:2: not valid JSON"):
        load_personas(PersonasConfig(source="file", path=str(p), n=5), 0)
    p.write_text(json.dumps({"text": "A sailor who tells long stories."}) + "\n")
    with pytest.raises(ValueError, match=r"personas.jsonl:1: missing field 'persona'.*text"):
        load_personas(PersonasConfig(source="file", path=str(p), n=5), 0)
    txt = tmp_path / "personas.txt"
    txt.write_text("A sailor who tells long stories.\n\nA baker who wakes at four.\n")
    got, _ = load_personas(PersonasConfig(source="file", path=str(txt), n=5), 0)
    assert sorted(x["persona"] for x in got) == ["A baker who wakes at four.", "A sailor who tells long stories."]
    m = tmp_path / "mrc.jsonl"
    m.write_text(json.dumps({"query": "q?", "answers": ["No Answer Present."], "passages": {"passage_text": ["p"], "is_selected": [0]}}) + "\n" + json.dumps({"query": "q2?", "passages": []}) + "\n")
    cfg = load_config({"mrc": {"source": "file", "path": str(m)}}).mrc
    with pytest.raises(ValueError, match=r"mrc.jsonl:\d: missing field 'answers'"):
        load_mrc(cfg, 0)


def test_broken_asset_override_names_file_and_key(tmp_path: Path) -> None:
    from rolemrc.synth.assets import Assets

    (tmp_path / "prompts.yaml").write_text("reply: hi\n")
    with pytest.raises(ValueError, match=r"prompts.yaml: missing key\(s\) profile_system"):
        Assets(str(tmp_path)).prompts
    (tmp_path / "prompts.yaml").unlink()
    (tmp_path / "templates.yaml").write_text((Assets().path("templates.yaml")).read_text().replace("You are $role_name", "You are $rolename"))
    with pytest.raises(KeyError, match=r"templates.yaml: template 'role_system' uses \$rolename"):
        Assets(str(tmp_path)).render("templates", "role_system", role_name="x", profile="p", passages="", narration="", extra="")


def test_hub_code_path_reads_a_dataset_folder(tmp_path: Path) -> None:
    """`source: hub` goes through datasets.load_dataset, which also takes a local dataset folder."""
    from rolemrc.synth.config import MRCConfig
    from tests.synth.helpers import write_inputs

    inputs = write_inputs(tmp_path / "in")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text(inputs["mrc"].read_text())
    items, stats = load_mrc(MRCConfig(source="hub", path=str(repo), name=None, n_answerable=5, n_unanswerable=3), 7)
    assert (stats["answerable"], stats["unanswerable"]) == (5, 3)
    again, _ = load_mrc(MRCConfig(source="hub", path=str(repo), name=None, n_answerable=5, n_unanswerable=3), 7)
    assert items == again, "seeded sampling is reproducible"
    assert all(it["answer"] is None for it in items if not it["answerable"])
    assert all(it["selected"] == [0, 1] for it in items if it["answerable"])
