"""evaluate.py end to end on a tiny random-init export: files, judge routing, resume after a
kill, left-padded batches = one-by-one greedy, judge cache on rerun, clear vllm/config errors."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from rolemrc import asset
from rolemrc.config import ModelConfig
from rolemrc.data.schemas import parse_test_item
from rolemrc.data.templates import ChatFormat
from rolemrc.eval import generation
from rolemrc.eval.generation import greedy_generate_ids, stop_token_ids
from rolemrc.eval.run import run
from rolemrc.models.export import export_pretrained
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.tasks import dimensions_of
from tests.conftest import CONF, ROOT

# One item per task, chosen to cover all five dimensions; the NI format item carries a rule.
TASKS = [
    "role_related_mrc_answer_with_narration",  # KB + RS
    "role_related_mrc_answer_no_narration-special-format",  # NI (rule)
    "role_related_mrc_refused_with_narration-2ndrefused",  # MT
    "role_related_mrc_answer_with_narration-refused",  # PI
    "role_unrelated_mrc_refused_no_narration",  # KB + RS
    "role_unrelated_mrc_answer_no_narration",  # RS
    "role_related_mrc_answer_no_narration",  # beyond limit=6
    "role_related_mrc_refused_no_narration",
]
# Fast settings: short replies and judge answers; METEOR's WordNet load alone takes ~20 s.
FAST = [
    "limit=6",
    "generation.max_new_tokens=6",
    "generation.batch_size=4",
    "generation.progress=false",
    "judge.max_tokens=3",
    "metrics.names=[bleu,rougeL,bertscore_f1]",
    "metrics.bertscore.model=minilm",  # offline; the default (roberta-large, the paper's) needs the hub
]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and on a shared 2-core machine two threads wait
    on each other: generation here is ~10x faster with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny model saved as an HF folder, like a training run's export."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "tiny.yaml"))
    cfg.tokenizer = asset("tokenizers/tiny-llama3")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    return export_pretrained(load_model(cfg, tok), tok, tmp_path_factory.mktemp("tiny") / "export")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``test.jsonl`` with the first sample item of each task in TASKS, in that order."""
    records = [json.loads(line) for line in Path(asset("sample/test.jsonl")).read_text().splitlines()]
    first = {}
    for r in records:
        first.setdefault(r["task"], r)
    out = tmp_path_factory.mktemp("data")
    (out / "test.jsonl").write_text("".join(json.dumps(first[t]) + "\n" for t in TASKS))
    return out


def compose_eval(*overrides: str) -> DictConfig:
    """``conf/evaluate.yaml`` composed as ``python evaluate.py`` would (out_dir given)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_end_to_end_then_rerun_hits_caches(export: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    cfg = compose_eval(*FAST, f"model.path={export}", "data=local", f"data.dir={data_dir}", "judge=hf",
                       f"out_dir={out}")
    res = run(cfg)

    for name in ("generations.jsonl", "generation_settings.json", "metrics.json", "judge.jsonl", "summary.md"):
        assert (out / name).is_file(), name
    gens = [json.loads(line) for line in lines(out / "generations.jsonl")]
    assert len(gens) == 6 and sorted(g["id"] for g in gens) == sorted(res["ids"])
    assert all(isinstance(g["reply"], str) and 1 <= g["n_tokens"] <= 6 for g in gens)

    # Every evaluated task is judged on exactly its dimensions.
    verdicts = [json.loads(line) for line in lines(out / "judge.jsonl")]
    by_item: dict[str, set[str]] = {}
    for v in verdicts:
        by_item.setdefault(v["item_id"], set()).add(v["dimension"])
    tasks = {g["id"]: g["task"] for g in gens}
    assert set(by_item) == set(tasks)
    for item, dims in by_item.items():
        assert dims == {d.short for d in dimensions_of(tasks[item])}
    assert {v["dimension"] for v in verdicts} == {"KB", "RS", "NI", "MT", "PI"}

    # A random model's "verdicts" are unparseable: counted as such, never scored as 0.
    doc = json.loads((out / "metrics.json").read_text())
    assert all(v["status"] == "unparseable" and v["verdict"] is None for v in verdicts)
    for dim in doc["judge"].values():
        assert dim["accuracy"] is None and dim["n_unparseable"] == dim["n_total"] > 0
    assert doc["counts"]["judgement_status"] == {"unparseable": len(verdicts)}
    assert doc["meta"]["model"] == str(export) and doc["meta"]["judge_model"] == str(export)
    assert "MiniLM" in doc["meta"]["bertscore_model"]
    assert set(doc["metrics"]["summary"]) == {"bleu", "rougeL", "bertscore_f1"}
    assert doc["counts"]["items"] == 6 and doc["counts"]["generated"] == 6
    # The NI item's rule was checked by program; no usable judge verdict to compare with.
    assert len(doc["rule_verifier"]) == 1 and doc["verifier_agreement"]["n_without_verdict"] == 1
    assert "Nested Instruction-following (NI)" in (out / "summary.md").read_text()

    # Rerun into the same folder: nothing regenerated. Answers without a verdict are never cached,
    # so the (greedy, local) judge is asked again and says the same.
    before = (out / "generations.jsonl").read_bytes()
    again = run(cfg)
    assert again["generation"].n_new == 0 and again["generation"].n_resumed == 6
    assert (out / "generations.jsonl").read_bytes() == before
    stats = again["judge_stats"]
    assert stats.cache_hits == 0 and stats.requests == stats.prompts == len(verdicts)
    assert [(v["raw"], v["cached"]) for v in map(json.loads, lines(out / "judge.jsonl"))] == [(v["raw"], False) for v in verdicts]


SLOW_CHILD = """
import runpy, sys, time
import transformers.generation.utils as gu
original = gu.GenerationMixin.generate
def slow(self, *args, **kwargs):  # slow enough that the parent can kill us between batches
    time.sleep(0.3)
    return original(self, *args, **kwargs)
gu.GenerationMixin.generate = slow
sys.argv = ["evaluate.py", *sys.argv[1:]]
runpy.run_path("evaluate.py", run_name="__main__")
"""


def test_resume_after_sigkill_keeps_written_lines(export: Path, data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    gen_file = out / "generations.jsonl"
    overrides = [*FAST, "generation.batch_size=1", "metrics.names=[]", f"model.path={export}", "data=local",
                 f"data.dir={data_dir}", f"out_dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", SLOW_CHILD, *overrides, f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (gen_file.exists() and len(lines(gen_file)) >= 2):
            if child.poll() is not None:
                pytest.fail(f"evaluate.py exited early ({child.returncode}): {child.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "no generations written within 120 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    written = lines(gen_file)
    assert 2 <= len(written) < 6, "the kill should land before the last item"
    # Simulate a kill in the middle of a write too: a torn last line without newline.
    with gen_file.open("a", encoding="utf-8") as f:
        f.write('{"id": "00005-abc", "task": "role_rel')

    res = run(compose_eval(*overrides))
    assert res["generation"].n_resumed == len(written)
    assert res["generation"].n_new == 6 - len(written)
    final = lines(gen_file)
    assert len(final) == 6 and final[: len(written)] == written
    assert sorted(json.loads(line)["id"] for line in final) == sorted(res["ids"])
    assert (out / "summary.md").is_file()

    # Resuming with settings that change the replies is refused, not silently mixed.
    with pytest.raises(ValueError, match="other settings"):
        run(compose_eval(*overrides, "generation.max_new_tokens=7"))


def _prompts_and_model(export: Path) -> tuple[Any, Any, ChatFormat, list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    chat = ChatFormat(tok)
    items = [parse_test_item(json.loads(line)) for line in Path(asset("sample/test.jsonl")).read_text().splitlines()]
    by_length = {len(p): p for p in (chat.encode_prompt(it.question) for it in items[::5])}
    prompts = [by_length[n] for n in sorted(by_length)][::2][:4]  # 4 different lengths
    return tok, model, chat, prompts


def test_left_padded_batches_match_one_by_one(export: Path) -> None:
    tok, model, chat, prompts = _prompts_and_model(export)
    assert len({len(p) for p in prompts}) == len(prompts) == 4
    kw = dict(max_new_tokens=10, pad_id=tok.pad_token_id, stop_ids=stop_token_ids(tok, chat.eot))
    batched = greedy_generate_ids(model, prompts, batch_size=len(prompts), **kw)
    single = greedy_generate_ids(model, prompts, batch_size=1, **kw)
    assert batched == single
    assert all(len(ids) >= 1 for ids in batched)


def test_restraint_wraps_generation(export: Path, data_dir: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``restraint=<spec>`` -> rolemrc.probing.restraint.load_restraint(spec, model), entered
    around generation only (a stand-in function here; test_real_restraint_changes_replies uses the real one)."""
    events: list[str] = []

    @contextmanager
    def load_restraint(spec: str, model: Any) -> Iterator[None]:
        events.append(f"enter {spec}")
        original = model.generate
        model.generate = lambda *a, **k: (events.append("generate"), original(*a, **k))[1]
        try:
            yield
        finally:
            del model.generate
            events.append("exit")

    monkeypatch.setattr(generation, "load_restraint", load_restraint)
    out = tmp_path / "eval"
    common = [*FAST, "limit=2", "metrics.names=[]", f"model.path={export}", "data=local", f"data.dir={data_dir}"]
    res = run(compose_eval(*common, "restraint=maps/mt_top.pt", f"out_dir={out}"))
    assert events == ["enter maps/mt_top.pt", "generate", "exit"] and res["generation"].n_new == 2
    assert json.loads((out / "metrics.json").read_text())["meta"]["restraint"] == "maps/mt_top.pt"


def test_real_restraint_changes_replies(export: Path, data_dir: Path, tmp_path: Path) -> None:
    """With rolemrc.probing's own restraint file: silencing every MLP neuron changes the replies."""
    restraint = pytest.importorskip("rolemrc.probing.restraint")
    spec = restraint.Restraint(neurons=[(layer, n) for layer in (0, 1) for n in range(128)], site="mlp_out",
                               factor=0.0).save(tmp_path / "restraint.json")
    common = [*FAST, "limit=2", "metrics.names=[]", f"model.path={export}", "data=local", f"data.dir={data_dir}"]
    plain = run(compose_eval(*common, f"out_dir={tmp_path / 'plain'}"))["generation"]
    held = run(compose_eval(*common, f"restraint={spec}", f"out_dir={tmp_path / 'held'}"))["generation"]
    assert held.n_new == 2 and held.replies != plain.replies


def test_openai_judge_with_shared_cache(export: Path, data_dir: Path, tmp_path: Path, openai_server,
                                        judge_key_env) -> None:
    url, server = openai_server
    common = [*FAST, "limit=3", "metrics.names=[]", f"model.path={export}", "data=local", f"data.dir={data_dir}",
              "judge=openai", "judge.model=fake-judge", f"judge.base_url={url}", f"judge.api_key_env={judge_key_env[0]}",
              f"judge.cache_dir={tmp_path / 'shared_cache'}"]
    first = run(compose_eval(*common, f"out_dir={tmp_path / 'a'}"))
    verdicts = first["verdicts"]
    assert {v.status for v in verdicts} == {"ok"} and server.models == {"fake-judge"}
    doc = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert doc["judge"]["KB"]["accuracy"] == 0.0  # parseable "VERDICT: 0" answers: a real 0
    sent = server.requests
    assert sent == len(verdicts)
    # Another evaluation folder, same shared cache: nothing is sent again.
    second = run(compose_eval(*common, f"out_dir={tmp_path / 'b'}"))
    assert server.requests == sent and second["judge_stats"].cache_hits == len(verdicts)


def test_rolebench_sources_score_rouge_l_only(export: Path, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    cfg = compose_eval(*FAST, "limit=3", f"model.path={export}", "judge=hf", "logger=csv", f"out_dir={out}",
                       f"data.test=[{{path: {asset('sample/rolebench.jsonl')}, format: rolebench}}]")
    run(cfg)
    doc = json.loads((out / "metrics.json").read_text())
    assert set(doc["metrics"]["summary"]) == {"rougeL"} and doc["metrics"]["summary"]["rougeL"]["n"] == 3
    assert "judge" not in doc and not (out / "judge.jsonl").exists()
    assert "eval/rougeL" in (out / "csv" / "metrics.csv").read_text()  # logger=csv got the scalars


def test_vllm_missing_is_a_clear_error(export: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    cfg = compose_eval(f"model.path={export}", "generation.backend=vllm", f"out_dir={tmp_path}")
    with pytest.raises(ImportError, match="separate environment"):
        run(cfg)


def test_checks_come_in_order_of_relevance_before_any_slow_work(export: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The model before BERTScore's encoder: an empty model folder is the error to read, though the
    paper's roberta-large is not cached either. With a good model, BERTScore's error names the
    overrides that fix it, before the model is resolved (a checkpoint exported, an adapter merged)."""
    from huggingface_hub import constants

    from rolemrc.errors import InputNotFound
    from rolemrc.eval import run as eval_run
    from rolemrc.eval.metrics import BertScoreUnavailable

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputNotFound, match="model.path=.*empty: the folder has no model files"):
        run(compose_eval(f"model.path={empty}", f"out_dir={tmp_path / 'a'}"))

    def resolved_too_early(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model source was resolved before the checks")

    monkeypatch.setattr(eval_run, "resolve_model_sources", resolved_too_early)
    with pytest.raises(BertScoreUnavailable) as err:
        run(compose_eval(f"model.path={export}", f"out_dir={tmp_path / 'b'}"))
    assert "Add metrics.bertscore.model=minilm" in str(err.value) and "HF_HUB_OFFLINE=0" in str(err.value)


def test_config_typos_fail_and_groups_compose() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_eval("generation.batchsize=2")
    with pytest.raises(ConfigCompositionException):
        compose_eval("judge=openai", "judge.api_key=sk-x")  # the key lives in the environment only
    cfg = compose_eval("data=rolemrc_test", "judge=openai", "logger=wandb", "out_dir=/tmp/x")
    assert cfg.data.test[0].data_files == "roleMRC_test.jsonl" and cfg.judge.model == "gpt-4-turbo"
    assert OmegaConf.to_container(cfg.logger, resolve=True)["wandb"]["save_dir"] == "/tmp/x"
    assert cfg.generation.max_new_tokens == 256 and cfg.metrics.bertscore.model == "roberta-large"
    assert cfg.metrics.meteor_tokenizer == "punkt" and cfg.generation.strip_replies is False


def test_wandb_offline_run_gets_the_scores_and_the_samples_table(export: Path, data_dir: Path, tmp_path: Path) -> None:
    from tests.callbacks.helpers import wandb_history

    out = tmp_path / "eval"
    cfg = compose_eval(*FAST, f"model.path={export}", "data=local", f"data.dir={data_dir}", "judge=hf",
                       "logger=wandb", f"out_dir={out}")
    run(cfg)
    rows = wandb_history(out)
    (row,) = [r for r in rows if "eval/bleu" in r]
    assert [r["samples/_type"] for r in rows if "samples/_type" in r] == ["table-file"]
    doc = json.loads((out / "metrics.json").read_text())
    for name in ("bleu", "rougeL", "bertscore_f1"):
        assert row[f"eval/{name}"] == pytest.approx(doc["metrics"]["summary"][name]["mean"])
    for dim, counts in doc["judge"].items():  # counted, and no accuracy for unparseable verdicts
        assert row[f"judge/{dim}/n_unparseable"] == counts["n_unparseable"]
        assert f"judge/{dim}/accuracy" not in row
    (table_file,) = (next(out.glob("wandb/offline-run-*/files/media")) / "table").glob("samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert len(table["data"]) == 6 and "reply" in table["columns"]
