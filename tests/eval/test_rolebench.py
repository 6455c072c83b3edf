"""RoleBench per split (RAW/CUS/SPE, ROUGE-1/2/L) and RoCIT system instructions: values equal
direct rouge_score calls, Chinese is scored per character, bad rows name file:line, and the
documented commands run on the shipped samples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rouge_score import rouge_scorer

from rolemrc import asset
from rolemrc.data.readers import read_examples
from rolemrc.data.roles import DEFAULT_TEMPLATE, RoleProfile, RoleSystem, check_template, render_system
from rolemrc.data.schemas import DataError
from rolemrc.errors import ConfigError
from rolemrc.eval.rolebench import chinese_rouge
from rolemrc.eval.run import run
from tests.conftest import ROOT, compose_train
from tests.eval.test_evaluate_run import compose_eval

FAST = ["generation.max_new_tokens=8", "generation.progress=false", "generation.batch_size=8"]
RB = Path(asset("sample/rolebench"))


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- RoCIT


def test_rocit_template_renders_profile_parts() -> None:
    prof = RoleProfile("Ada", "A mapmaker.", ["north is up"], [("Where to?", "Wherever the map ends.")])
    text = render_system(prof)
    assert text.startswith("You are Ada. A mapmaker.")
    assert '"north is up"' in text and "Q: Where to?\nAda: Wherever the map ends." in text
    assert "never say that you are an AI" in text
    bare = render_system(RoleProfile("Ada"))  # no catchphrases/dialogue: no empty lines left behind
    assert "\n\n" not in bare and "Phrases" not in bare and "Some lines" not in bare
    assert render_system(prof, few_shot=0).count("Q:") == 0
    custom = render_system(prof, "[{name}] {description} | {catchphrases}")
    assert custom == '[Ada] A mapmaker. | Phrases Ada is known for: "north is up".'
    with pytest.raises(ConfigError, match=r"unknown field \{persona\}"):
        check_template("You are {persona}")
    assert check_template(DEFAULT_TEMPLATE) == DEFAULT_TEMPLATE


def test_rolebench_rows_train_with_rocit_and_missing_profiles_name_file_line(tmp_path: Path) -> None:
    profiles = [str(RB / "profiles-eng/desc.json"), str(RB / "profiles-eng/roles.jsonl")]
    src = RB / "rolebench-eng/instruction-generalization/general/train.jsonl"
    convs, _ = read_examples([{"path": str(src), "format": "rolebench", "roles": {"profiles": profiles}}], "sft")
    row = json.loads(src.read_text().splitlines()[0])
    expected = RoleSystem({"profiles": profiles})(row["role"])
    assert convs[0].messages[0] == {"role": "system", "content": expected}
    assert "Mind the tide" in expected and convs[0].messages[-1]["content"] == row["generated"][0]
    # A role without a profile is a record error naming the file and line.
    bad = tmp_path / "train.jsonl"
    bad.write_text(src.read_text() + json.dumps({"role": "Nobody", "question": "Hi?", "generated": ["Hello."]}) + "\n")
    n = len(bad.read_text().splitlines())
    with pytest.raises(DataError, match=rf"{bad}:{n}: role 'Nobody' has no profile"):
        read_examples([{"path": str(bad), "format": "rolebench", "roles": {"profiles": profiles}}], "sft")


def test_rolebench_data_configs_compose_for_training() -> None:
    """data=rolebench_sample trains RoleMRC sample rows + RoleBench rows with RoCIT instructions;
    data=rolebench_mix is RoleBench + RoleMRC-mix in one config."""
    cfg = compose_train(["data=rolebench_sample"])
    convs, report = read_examples(list(cfg.data.sft), "sft")
    rb = [c for c in convs if c.task == "rolebench"]
    assert rb and all(c.messages[0]["role"] == "system" and "Stay in character as" in c.messages[0]["content"]
                      for c in rb)
    assert any("Phrases Colette Marchand is known for" in c.messages[0]["content"] for c in rb)
    mix = compose_train(["data=rolebench_mix"])
    paths = [s.path for s in mix.data.sft]
    assert paths[0] == "Junrulu/RoleMRC" and paths[-1] == "RLHFlow/RLHFlow-SFT-Dataset-ver2"
    assert [s.format for s in mix.data.sft].count("rolebench") == 2
    assert mix.data.sft[1].roles.profiles[0].endswith("profiles-eng/desc.json")
    assert [s.path for s in mix.data.pairs] == ["Junrulu/RoleMRC", "HuggingFaceH4/ultrafeedback_binarized"]


# ---------------------------------------------------------------- metrics


def test_chinese_rouge_is_character_level_rouge_score() -> None:
    """Character tokens = rouge_score's own default scorer on the same text with every character
    spelt as an ASCII word (its default tokenizer would drop CJK altogether)."""
    pairs = [("客官请坐，今天喝红茶。", ["客官请坐，今儿下雨，来一壶红茶。"]), ("针脚要细", ["心静手才稳", "针脚要细密"]),
             ("", ["茶要慢慢喝"]), ("abc 茶", ["茶 abc"])]
    got = chinese_rouge([p for p, _ in pairs], [r for _, r in pairs])
    vocab: dict[str, str] = {}

    def spell(text: str) -> str:
        return " ".join(vocab.setdefault(c, f"w{len(vocab)}") for c in text if not c.isspace())

    plain = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    for k, (p, refs) in enumerate(pairs):
        want = plain.score_multi([spell(r) for r in refs], spell(p))
        for t in ("rouge1", "rouge2", "rougeL"):
            assert got[t][k] == pytest.approx(want[t].fmeasure, abs=1e-12)
    english = rouge_scorer.RougeScorer(["rougeL"]).score("针脚要细密", "针脚要细")["rougeL"].fmeasure
    assert english == 0.0 and got["rougeL"][1] > 0.8  # why the character tokenizer is needed


def _direct(lang: str, reply: str, refs: list[str]) -> dict[str, float]:
    if lang == "zh":
        vocab: dict[str, str] = {}

        def spell(text: str) -> str:
            return " ".join(vocab.setdefault(c, f"w{len(vocab)}") for c in text if not c.isspace())

        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"])
        scores = [scorer.score(spell(reply), spell(r)) for r in refs]
    else:  # the authors' call: Porter stemming, the reply as rouge_score's target
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
        scores = [scorer.score(reply, r) for r in refs]
    return {t: max(s[t].fmeasure for s in scores) for t in ("rouge1", "rouge2", "rougeL", "rougeLsum")}


def test_rolebench_sample_scores_equal_rouge_score(tmp_path: Path) -> None:
    out = tmp_path / "rb"
    res = run(compose_eval(*FAST, "data=rolebench_sample", "logger=csv", f"out_dir={out}"))
    doc = json.loads((out / "metrics.json").read_text())
    rb = doc["rolebench"]
    assert set(rb["splits"]) == {"InstEng", "RoleEng", "InstZh"}
    assert rb["tokenization"]["zh"].startswith("character-level")
    replies = [json.loads(x)["reply"] for x in (out / "rolebench" / "generations.jsonl").read_text().splitlines()]
    assert len(replies) == len(rb["per_item"]) == rb["items"]
    # Recompute every split/set mean from the files with direct rouge_score calls.
    raw = {lang: {json.loads(x)["question"]: json.loads(x)["answer"]
                  for x in (RB / f"instructions-{lang}/instructions-general.jsonl").read_text().splitlines()}
           for lang in ("eng", "zh")}
    folders = {"InstEng": ("eng", "rolebench-eng/instruction-generalization"),
               "RoleEng": ("eng", "rolebench-eng/role-generalization"), "InstZh": ("zh", "rolebench-zh")}
    by_id = {(it["origin"]): it for it in rb["per_item"]}
    for split, (lang, folder) in folders.items():
        sums: dict[str, list[dict[str, float]]] = {"RAW": [], "CUS": [], "SPE": []}
        for subset in ("general", "role_specific"):
            f = RB / folder / subset / "test.jsonl"
            for line, text in enumerate(f.read_text().splitlines(), start=1):
                row = json.loads(text)
                reply = by_id[f"{f}:{line}"]["reply"]
                if subset == "role_specific":
                    sums["SPE"].append(_direct(lang, reply, row["generated"]))
                else:
                    sums["CUS"].append(_direct(lang, reply, row["generated"]))
                    sums["RAW"].append(_direct(lang, reply, [raw[lang][row["question"]]]))
        for kind, rows in sums.items():
            got = rb["splits"][split][kind]
            assert got["n"] == len(rows)
            for t in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
                assert got[t] == pytest.approx(sum(r[t] for r in rows) / len(rows), abs=1e-12)
    summary = (out / "summary.md").read_text()
    inst = rb["splits"]["InstEng"]
    assert f"| InstEng | {100 * inst['RAW']['rougeL']:.2f} | {100 * inst['CUS']['rougeL']:.2f} | " in summary
    assert "| split | set | n | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum |" in summary
    assert "Porter stemmer (use_stemmer=True)" in rb["tokenization"]["eng"]
    assert "rolebench/InstZh/SPE/rougeL" in (out / "csv" / "metrics.csv").read_text()
    assert res["scalars"]["rolebench/InstEng/CUS/rougeL"] == inst["CUS"]["rougeL"]
    # Rerun: nothing is generated again.
    again = run(compose_eval(*FAST, "data=rolebench_sample", f"out_dir={out}"))
    assert again["results"]["counts"]["generated"] == 0 and again["results"]["rolebench"]["splits"] == rb["splits"]


def test_rolebench_bad_rows_and_paths_are_clear_errors(tmp_path: Path) -> None:
    root = tmp_path / "RoleBench"
    shutil.copytree(RB, root)
    f = root / "rolebench-zh/role_specific/test.jsonl"
    f.write_text(f.read_text() + '{"role": "林掌柜", "question": "?"}\n')
    n = len(f.read_text().splitlines())
    with pytest.raises(DataError, match=rf"{f}:{n}: RoleBench row lacks \['generated'\]"):
        run(compose_eval(*FAST, "data=rolebench_sample", f"data.rolebench.root={root}", f"out_dir={tmp_path / 'o'}"))
    with pytest.raises(FileNotFoundError, match="data.rolebench.root: not a folder"):
        run(compose_eval(*FAST, "data=rolebench", "data.rolebench.root=/nonexistent/RoleBench", f"out_dir={tmp_path}"))
    # RAW answers absent (as in the public release): RAW left out and counted, not an error.
    f.write_text("\n".join(f.read_text().splitlines()[:-1]) + "\n")
    (root / "instructions-eng/instructions-general.jsonl").unlink()
    res = run(compose_eval(*FAST, "data=rolebench_sample", f"data.rolebench.root={root}", "limit=1",
                           f"out_dir={tmp_path / 'p'}"))
    rb = res["results"]["rolebench"]
    assert "raw_answers.eng" in rb["raw_absent"]["eng"] and "zh" not in rb["raw_absent"]
    assert rb["splits"]["InstEng"]["RAW"] is None and rb["splits"]["InstEng"]["raw_missing"] == 1
    assert rb["splits"]["InstZh"]["RAW"]["n"] == 1


def test_unknown_suite_keys_added_with_plus_are_refused(tmp_path: Path) -> None:
    """Hydra's '+' lifts the schema's check at compose time; the run refuses the key by name
    before loading anything, instead of carrying a misspelt key that nothing reads."""
    cfg = compose_eval(*FAST, "data=rolebench_sample", "+data.rolebench.splitz=[role_generalization_eng]",
                       f"out_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"data.rolebench.splitz is not a key of data.rolebench \(RoleBenchConfig\); "
                                          r"did you mean data.rolebench.splits\?"):
        run(cfg)
    with pytest.raises(ConfigError, match=r"benchmarks.tasx is not a key of benchmarks"):
        run(compose_eval(*FAST, "benchmarks=general_sample", "+benchmarks.tasx=[x]", f"out_dir={tmp_path}"))
    assert not (tmp_path / "summary.md").exists()


def test_rolebench_sample_command_runs(tmp_path: Path) -> None:
    """`python evaluate.py data=rolebench_sample` as a user runs it (short replies for speed)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "evaluate.py", "data=rolebench_sample", f"out_dir={tmp_path}",
                           "generation.max_new_tokens=4", "generation.progress=false", "generation.cpu_threads=1",
                           "limit=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"evaluation summary: {tmp_path / 'summary.md'}" in proc.stdout
    assert "| split | RAW | CUS | SPE | avg |" in proc.stdout  # the headline table on the console
    doc = json.loads((tmp_path / "metrics.json").read_text())
    assert doc["rolebench"]["items"] == 6  # limit=1: the first row of each of the six test files
