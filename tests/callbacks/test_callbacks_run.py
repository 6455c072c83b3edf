"""``callbacks=judge_scores`` and ``callbacks=activation_maps`` in real tiny training runs: scalars,
the samples table and the heatmaps reach a W&B offline run; with the CSV logger the files and the
scalars land in the run folder and metrics.csv; a resumed run keeps the rounds and the start maps;
an hf judge from a folder is loaded once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import hydra
import numpy as np
import pytest
import torch

from rolemrc import asset
from rolemrc.callbacks.activation_maps import ActivationMaps
from rolemrc.callbacks.judge_scores import JudgeScores
from rolemrc.data.readers import read_examples
from rolemrc.eval.judge import judge_items
from rolemrc.probing import balanced_subset, load_maps
from rolemrc.tasks import dimensions_of
from rolemrc.run.build import build_callbacks
from rolemrc.run.train import run
from tests.callbacks.helpers import wandb_history
from tests.conftest import compose_train
from tests.train.helpers import metric_rows

# 4 steps, validation after steps 2 and 4 (one batch each); 6 test items, 8 new tokens.
RUN = ["data.max_length=192", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
       "data.val_fraction=0.1", "export.enabled=false", "callbacks=[judge_scores,activation_maps]"]
SMALL = ["callbacks.judge_scores.n_items=6", "callbacks.judge_scores.max_new_tokens=8",
         "callbacks.activation_maps.n_items=6"]
N_ITEMS = 6


def expected_judgements() -> Counter[str]:
    """Judgements per dimension for the callbacks' 6-item subset of the sample test set."""
    items, _ = read_examples([{"path": asset("sample/test.jsonl")}], "test")
    return Counter(d.short for it in balanced_subset(items, N_ITEMS) for d in dimensions_of(it.task))


def test_wandb_offline_run_gets_scalars_table_and_images(train_cfg) -> None:
    import wandb

    cfg = train_cfg(*RUN, *SMALL, "logger=wandb", "callbacks.judge_scores.judge.backend=hf",
                    "callbacks.judge_scores.judge.max_tokens=8")
    try:
        out = run(cfg)
    finally:
        wandb.finish()  # flush the offline run to disk
    run_dir = Path(out["run_dir"])
    rows = wandb_history(run_dir)

    def at(key: str) -> list[dict]:
        return [r for r in rows if key in r]

    gen = at("gen/bleu")
    assert [r["trainer/global_step"] for r in gen] == [2, 4]
    expected = expected_judgements()
    for r in gen:
        assert 0.0 <= r["gen/rougeL"] <= 1.0 and 0 < r["gen/n_tokens"] <= 8
        for dim, n in expected.items():
            counted = sum(r[f"judge/{dim}/n_{s}"] for s in ("ok", "unparseable", "failed", "budget_exhausted"))
            assert counted == n, (dim, r)
            # A random model's judgements are unparseable: no accuracy then, never a 0 for them.
            assert (f"judge/{dim}/accuracy" in r) == (r[f"judge/{dim}/n_ok"] > 0)

    tables = at("judge_scores/samples/_type")
    assert [r["judge_scores/samples/_type"] for r in tables] == ["table-file"] * 2
    media = next(run_dir.glob("wandb/offline-run-*/files/media"))
    table_files = sorted((media / "table" / "judge_scores").glob("samples_*.table.json"))
    assert len(table_files) == 2
    table = json.loads(table_files[0].read_text())
    assert table["columns"][:6] == ["step", "id", "task", "prompt", "reply", "reference"]
    assert len(table["data"]) == N_ITEMS

    for kind in ("frequency", "discrepancy"):
        logged = at(f"activation_maps/{kind}/_type")
        assert [r["trainer/global_step"] for r in logged] == [2, 4]
        assert len(list((media / "images" / "activation_maps").glob(f"{kind}_*.png"))) == 2
    change = at("activation_maps/ALL/mean_abs_change")
    assert len(change) == 2 and all(r["activation_maps/ALL/mean_abs_change"] > 0 for r in change)

    # The files are written whatever the logger.
    assert (run_dir / "callbacks" / "judge_scores" / "step_4.jsonl").exists()
    assert (run_dir / "callbacks" / "activation_maps" / "step_4_discrepancy.png").exists()


def test_csv_run_writes_files_and_metrics(train_cfg, openai_server, judge_key_env) -> None:
    base_url, server = openai_server
    cfg = train_cfg(
        *RUN, *SMALL, "logger=csv",
        "callbacks.judge_scores.every_n_val=2",
        "callbacks.judge_scores.judge.backend=openai", "callbacks.judge_scores.judge.model=fake-judge",
        f"callbacks.judge_scores.judge.base_url={base_url}",
        f"callbacks.judge_scores.judge.api_key_env={judge_key_env[0]}",
        "callbacks.activation_maps.compare_to_start=false",
    )
    run_dir = Path(run(cfg)["run_dir"])
    expected = expected_judgements()

    # judge_scores: only the 2nd validation round (step 4).
    judge_dir = run_dir / "callbacks" / "judge_scores"
    assert sorted(p.name for p in judge_dir.glob("step_*")) == ["step_4.json", "step_4.jsonl"]
    lines = [json.loads(line) for line in (judge_dir / "step_4.jsonl").read_text().splitlines()]
    assert len(lines) == N_ITEMS and {ln["step"] for ln in lines} == {4}
    for ln in lines:
        assert set(ln["judge"]) == {d.short for d in dimensions_of(ln["task"])}
        assert all(j == {"verdict": 0, "status": "ok"} for j in ln["judge"].values())  # the server says 0
        assert set(ln["metrics"]) == {"bleu", "rouge1", "rougeL"}
    summary = json.loads((judge_dir / "step_4.json").read_text())
    assert {d: s["n_ok"] for d, s in summary["judge"]["dimensions"].items()} == dict(expected)
    assert "api_key_env" not in summary["judge"]["settings"]
    assert server.requests == sum(expected.values()) and server.models == {"fake-judge"}
    assert (judge_dir / "judge_cache").exists()

    maps_dir = run_dir / "callbacks" / "activation_maps"
    assert sorted(p.name for p in maps_dir.iterdir()) == ["step_2.npz", "step_2.png", "step_4.npz", "step_4.png"]
    maps = load_maps(maps_dir / "step_4.npz")
    assert maps["names"][0] == "step 4" and "diff" not in maps
    assert maps["n_cases"]["ALL"] == N_ITEMS

    rows = metric_rows(run_dir)
    judged = [r for r in rows if "gen/bleu" in r]
    assert [r["step"] for r in judged] == [4]
    for dim, n in expected.items():
        assert judged[0][f"judge/{dim}/accuracy"] == 0.0 and judged[0][f"judge/{dim}/n_ok"] == n
    assert [r["step"] for r in rows if "activation_maps/seconds" in r] == [2, 4]
    assert not any(k.endswith("mean_abs_change") for r in rows for k in r)


def test_resume_keeps_rounds_and_start_maps(train_cfg) -> None:
    common = [*RUN, *SMALL, "callbacks=[default,judge_scores,activation_maps]", "callbacks.judge_scores.every_n_val=2",
              "callbacks.judge_scores.metrics=[bleu]", "trainer.max_epochs=50"]
    first = Path(run(train_cfg(*common, "trainer.max_steps=2"))["run_dir"])
    maps_dir = first / "callbacks" / "activation_maps"
    start = load_maps(maps_dir / "start.npz")
    start_written = (maps_dir / "start.npz").stat().st_mtime_ns
    assert not (first / "callbacks" / "judge_scores").exists()  # round 1 of every 2

    resumed = Path(run(train_cfg(*common, "trainer.max_steps=4", "ckpt_path=last"))["run_dir"])
    assert resumed == first
    # Round 2 after the resume: the round count came back from the checkpoint.
    judged = sorted(p.name for p in (first / "callbacks" / "judge_scores").glob("step_*"))
    assert judged == ["step_4.json", "step_4.jsonl"]
    # The discrepancy is still against the maps of step 0, which were not recomputed.
    assert (maps_dir / "start.npz").stat().st_mtime_ns == start_written
    now = load_maps(maps_dir / "step_4.npz")
    assert now["names"] == ["start", "step 4"]
    for g, f in start["freq_a"].items():
        np.testing.assert_array_equal(now["freq_a"][g], f)
        np.testing.assert_allclose(now["diff"][g], now["freq_b"][g] - f, atol=1e-6)


def test_configs_compose_with_the_default_callbacks(tmp_path: Path) -> None:
    cfg = compose_train(["callbacks=[default,judge_scores,activation_maps]"], run_dir=tmp_path)
    kinds = [type(c).__name__ for c in build_callbacks(cfg.callbacks, run_dir=str(tmp_path))]
    assert kinds == ["ModelCheckpoint", "LearningRateMonitor", "JudgeScores", "ActivationMaps"]
    judge = build_callbacks(compose_train(["callbacks=judge_scores"], run_dir=tmp_path).callbacks, run_dir=str(tmp_path))[0]
    assert isinstance(judge, JudgeScores) and judge.judge.backend == "none"
    assert judge.metrics == ["bleu", "rouge1", "rougeL"]

    typo = compose_train(["callbacks=judge_scores", "+callbacks.judge_scores.judge.modle=x"], run_dir=tmp_path)
    with pytest.raises(Exception, match="modle"):  # a misspelt judge key fails at start-up
        build_callbacks(typo.callbacks, run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs judge_scores.judge.model"):
        JudgeScores(judge={"backend": "openai"})
    with pytest.raises(ValueError, match="unknown"):
        JudgeScores(metrics=["bleu", "blue"])
    with pytest.raises(ValueError, match="site"):
        ActivationMaps(site="mlp")
    assert hydra.utils.get_class(cfg.callbacks.activation_maps._target_) is ActivationMaps


def test_hf_judge_from_a_folder_is_loaded_once_and_cached(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "judge"
    tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    callback = JudgeScores(judge={"backend": "hf", "model": str(folder), "max_tokens": 4, "dtype": "float32"},
                           out_dir=str(tmp_path / "out"))
    module = SimpleNamespace(device=torch.device("cpu"))
    judge = callback.external_judge(module)
    assert callback.external_judge(module) is judge  # loaded once, kept across rounds
    assert judge.backend.model_id == str(folder)
    items, _ = read_examples([{"path": asset("sample/test.jsonl")}], "test")
    verdicts = judge.judge(judge_items(items[:1], ["Aye, shipmate."]))
    assert [v.dimension for v in verdicts] == ["KB", "RS"] and all(v.status in ("ok", "unparseable") for v in verdicts)
    assert (tmp_path / "out" / "judge_cache").exists()
    callback.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert callback._external_judge is None
