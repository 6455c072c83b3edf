"""objective.rollout=vllm: a GRPO run against a loopback vLLM-like server (real HTTP) trains on exactly
the server's tokens and syncs the policy's adapter before every step's rollout; a dead server or
failing completions stop the run with a clear error; the colocated engine is handed the policy's
merged weights under the HF names."""

from __future__ import annotations

import json
import socket
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.run.train import run

pytestmark = pytest.mark.xdist_group("grpo")

GRPO = ["objective=grpo", "data.prompts=[{path: ${asset:sample/test.jsonl}}]", "data.max_prompt_length=48",
        "data.batch_size=2", "objective.num_generations=3", "objective.max_completion_length=6",
        "data.val_fraction=0", "export.enabled=false", "optim.warmup_ratio=0", "optim.scheduler=constant",
        "optim.lr=1e-2", "+objective.rewards.vowels._target_=tests.train.test_grpo.vowel_reward",
        "model.peft.enabled=true", "objective.rollout=vllm", "objective.vllm.backoff_s=0.01",
        "objective.vllm.max_backoff_s=0.02", "objective.vllm.max_attempts=2"]


class VLLMStub:
    """What a ``vllm serve --enable-lora`` server with runtime LoRA updating answers, on 127.0.0.1:
    ``POST /v1/completions`` (prompt token ids, ``n``, ``seed``, ``max_tokens``, ``stop_token_ids``,
    ``return_token_ids``; the tokens drawn from the seed: random non-stop tokens, ended by the first
    stop id or cut at ``max_tokens``), ``/v1/load_lora_adapter`` (reads the adapter folder) and
    ``/v1/unload_lora_adapter``; a request naming a model not loaded gets 404, as vLLM's. With
    ``logprobs: 0`` each choice carries ``logprobs.token_logprobs``, the sampled tokens' log-probs
    (:func:`stub_logprob` of each token; None for the first token of every third choice, as vLLM
    gives for a token it could not score). ``fail_completions``: every completion request gets 500;
    ``omit_logprobs``: no log-probs however asked."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.loads: list[tuple[str, dict[str, torch.Tensor]]] = []
        self.unloads: list[str] = []
        self.completions: list[dict[str, Any]] = []  # body, the adapter loaded last then, rows
        self.fail_completions = False
        self.omit_logprobs = False
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = stub.answer(self.path, body)
                data = (json.dumps(answer) if not isinstance(answer, str) else answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if not isinstance(answer, str) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        from safetensors.torch import load_file

        with self.lock:
            if path.endswith("/load_lora_adapter"):
                folder = Path(body["lora_path"])
                assert (folder / "adapter_config.json").exists()
                weights = load_file(str(folder / "adapter_model.safetensors"))
                self.loaded[body["lora_name"]] = weights
                self.loads.append((body["lora_name"], weights))
                return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
            if path.endswith("/unload_lora_adapter"):
                self.unloads.append(body["lora_name"])
                if self.loaded.pop(body["lora_name"], None) is None:
                    return 404, {"error": {"message": "not loaded"}}
                return 200, "Success"
            if not path.endswith("/completions"):
                return 404, {"error": {"message": path}}
            if self.fail_completions:
                return 500, {"error": {"message": "boom"}}
            if body["model"] not in self.loaded:
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
            gen = torch.Generator().manual_seed(int(body["seed"]))
            stops, limit = list(body["stop_token_ids"]), int(body["max_tokens"])
            choices = []
            for j in range(int(body["n"])):
                length = int(torch.randint(0, limit + 1, (1,), generator=gen))
                row = [t for t in torch.randint(0, self.vocab, (3 * limit,), generator=gen).tolist()
                       if t not in stops][:min(length, limit)]
                if length < limit:
                    row.append(stops[0])
                logprobs = None
                if body.get("logprobs") is not None and not self.omit_logprobs:
                    values = [stub_logprob(t) for t in row]
                    if j % 3 == 2 and values:
                        values[0] = None
                    logprobs = {"tokens": [""] * len(row), "token_logprobs": values, "top_logprobs": None,
                                "text_offset": [0] * len(row)}
                choices.append({"index": j, "text": "", "finish_reason": "stop" if length < limit else "length",
                                "logprobs": logprobs, "token_ids": row, "prompt_token_ids": body["prompt"]})
            self.completions.append({"body": body, "adapter": self.loads[-1][0] if self.loads else None,
                                     "rows": [c["token_ids"] for c in choices]})
            return 200, {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body["model"],
                         "choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def stub_logprob(token: int) -> float:
    """The log-prob the stub server reports for a sampled token."""
    return -1.0 - (token % 7) / 10


class Record(L.Callback):
    """The policy's adapter as each step starts (what its rollout must be sampled from) and the
    sequences each micro-batch trained on (prompt ids, completion ids)."""

    adapters: list[dict[str, torch.Tensor]] = []
    trained: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    sampling: list[tuple[list[int], list[float]]] = []  # each completion's ids and the sampling log-probs laid out

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from rolemrc.rollout.weights import adapter_weights

        Record.adapters.append({k: v.clone() for k, v in adapter_weights(pl_module.model).items()})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for ids, att, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            start = int((lab != IGNORE_INDEX).int().argmax())
            prompt = ids[:start][att[:start].bool()]
            Record.trained.append((tuple(prompt.tolist()), tuple(lab[lab != IGNORE_INDEX].tolist())))
        if "sampling_logps" in batch:  # at the positions that predict the completion tokens (shifted labels)
            for lab, lp in zip(batch["labels"], batch["sampling_logps"]):
                keep = lab[1:] != IGNORE_INDEX
                Record.sampling.append((lab[1:][keep].tolist(), lp[:-1][keep].tolist()))


@pytest.fixture(scope="module")
def server_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[VLLMStub, Path]:
    from tests.conftest import FAST, compose_train

    stub = VLLMStub(vocab=_tiny_vocab())
    Record.adapters, Record.trained, Record.sampling = [], [], []
    run_dir = tmp_path_factory.mktemp("vllm") / "run"
    try:
        run(compose_train([*FAST, *GRPO, f"objective.vllm.base_url={stub.url}", "trainer.max_steps=2",
                           "+callbacks.rec._target_=tests.train.test_grpo_vllm.Record"], run_dir=run_dir))
    finally:
        stub.close()
    return stub, run_dir


def _tiny_vocab() -> int:
    """The tiny model's vocabulary: its shipped tokenizer's size (rolemrc.models.loading)."""
    from transformers import AutoTokenizer

    from rolemrc.config import asset

    return len(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))


def test_a_run_trains_on_exactly_the_servers_tokens_and_syncs_each_step(server_run) -> None:
    from tests.train.helpers import series

    stub, run_dir = server_run
    # one adapter load per step, each the policy's adapter as that step started; the previous one unloaded
    assert len(stub.loads) == 2 and len(Record.adapters) == 2
    for (name, sent), policy in zip(stub.loads, Record.adapters):
        assert sent.keys() == policy.keys() and all(torch.equal(sent[k], policy[k]) for k in sent), name
    assert any(not torch.equal(Record.adapters[0][k], Record.adapters[-1][k]) for k in Record.adapters[0])
    assert stub.unloads == [name for name, _ in stub.loads]  # the previous at each sync, the last at the end
    # every completion request named the adapter loaded for its step, with its own seed
    assert len(stub.completions) == 2 * 2 and all(c["body"]["model"] == c["adapter"] for c in stub.completions)
    # the seeds are the sampling RNG's (seeded from the run's seed and rank, in every checkpoint), step by step
    rng = torch.Generator().manual_seed((42 + 1_000_003) % 2**63)
    want = [sorted(torch.randint(0, 2**31 - 1, (2,), generator=rng).tolist()) for _ in range(2)]
    assert [sorted(c["body"]["seed"] for c in stub.completions[2 * k:2 * k + 2]) for k in range(2)] == want
    assert all(c["body"]["n"] == 3 and c["body"]["return_token_ids"] for c in stub.completions)
    # trained on exactly what the server returned, prompt for prompt
    served = sorted((tuple(c["body"]["prompt"]), tuple(row)) for c in stub.completions for row in c["rows"])
    assert sorted(Record.trained) == served
    tps = series(run_dir, "train/completion_tokens_per_s")
    assert len(tps) == 2 and all(t > 0 for t in tps)
    # TRL's vLLM importance-sampling correction (on by default): the server's log-probs asked for, laid out
    # beside the tokens they score (NaN where it gave none), and what TRL logs of the weights
    assert all(c["body"]["logprobs"] == 0 for c in stub.completions)
    assert len(Record.sampling) == len(Record.trained)
    nan = 0
    for ids, lps in Record.sampling:
        for t, lp in zip(ids, lps):
            nan += lp != lp
            assert lp != lp or lp == pytest.approx(stub_logprob(t)), (t, lp)
    assert nan > 0
    for name in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max"):
        values = series(run_dir, f"train/{name}")
        assert len(values) == 2 and all(v >= 0 for v in values), name
    assert all(0 < v for v in series(run_dir, "train/sampling/sampling_logp_difference/mean"))


def test_a_dead_server_stops_the_run_with_a_clear_error(tmp_path: Path) -> None:
    from rolemrc.rollout import RolloutError
    from tests.conftest import FAST, compose_train

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RolloutError, match=rf"127\.0\.0\.1:{port}/v1 failed \(connection: .*2 attempt"):
        run(compose_train([*FAST, *GRPO, f"objective.vllm.base_url=http://127.0.0.1:{port}/v1",
                           "trainer.max_steps=1"], run_dir=tmp_path / "run"))


def test_failing_completions_raise_after_the_retries_never_a_rollout() -> None:
    from rolemrc.config import GRPOObjectiveConfig, GRPOVLLMConfig
    from rolemrc.rollout import RolloutError, ServerEngine

    stub = VLLMStub(vocab=100)
    try:
        o = GRPOObjectiveConfig(num_generations=2, max_completion_length=4, rollout="vllm",
                                vllm=GRPOVLLMConfig(base_url=stub.url, max_attempts=3, backoff_s=0.01, max_backoff_s=0.02))
        engine = ServerEngine(o, stop_ids=[99], vocab=100)
        stub.loaded["m"] = {}
        engine.model_name = "m"
        assert len(engine.generate([[1, 2], [3]], 2, [5, 6])) == 4  # served: 2 prompts x 2
        rows = engine.generate([[1, 2], [3]], 3, [5, 6])
        assert [[stub_logprob(t) for t in row] for row in rows][:2] == engine.sampled_logprobs[:2]
        assert engine.sampled_logprobs[2][0] != engine.sampled_logprobs[2][0]  # None -> NaN
        stub.omit_logprobs = True  # the correction needs them: a malformed answer, retried, then the run stops
        engine.require_logprobs = True
        with pytest.raises(RolloutError, match=r"no logprobs\.token_logprobs.*3 attempt"):
            engine.generate([[1, 2]], 2, [5])
        engine.require_logprobs = False  # without the correction the rows are trained as they are
        assert len(engine.generate([[1, 2]], 2, [5])) == 2 and all(v != v for v in engine.sampled_logprobs[0])
        stub.fail_completions = True
        with pytest.raises(RolloutError, match=r"2 of 2 completion requests .* failed .*server_error: HTTP 500.*3 attempt"):
            engine.generate([[1, 2], [3]], 2, [5, 6])
    finally:
        stub.close()


def test_server_mode_refuses_what_it_cannot_sync(train_cfg) -> None:
    from rolemrc.config import check_train_config
    from rolemrc.errors import ConfigError

    base = [o for o in GRPO if not o.startswith("model.peft")]
    for overrides, message in (([*base, "objective.vllm.base_url=http://h:8000/v1"], "a full fine-tune cannot be synced"),
                               ([*GRPO, "objective.vllm.mode=colocate"], "model.path is not set"),
                               ([*GRPO, "objective.vllm.mode=remote"], "objective.vllm.mode must be one of")):
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            check_train_config(train_cfg(*overrides))


# ---- colocate: the weights handed to vllm.LLM are the policy's (LoRA merged, HF names) -------------------------

class FakeLLM:
    """Stands in for ``vllm.LLM``: a real HF model of the same architecture, whose ``load_weights``
    takes HF checkpoint names strictly (as vLLM's model classes load a checkpoint)."""

    made: list[FakeLLM] = []

    def __init__(self, model: str, **kwargs: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.kwargs = kwargs
        self.hf = AutoModelForCausalLM.from_pretrained(model)
        self.hf.load_weights = lambda weights: self.hf.load_state_dict(dict(weights), strict=True)
        self.calls: list[str] = []
        FakeLLM.made.append(self)

    def apply_model(self, fn: Any) -> list[Any]:
        self.calls.append("load")
        return [fn(self.hf)]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        self.calls.append("generate")
        out = []
        for p, sp in zip(prompts, params):
            ids = torch.tensor([p["prompt_token_ids"]])
            new = self.hf.generate(ids, max_new_tokens=sp.kwargs["max_tokens"], do_sample=False)[0, ids.shape[1]:]
            lps = [{t: types.SimpleNamespace(logprob=stub_logprob(t))} for t in new.tolist()]  # logprobs=0's
            out.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(index=j, token_ids=new.tolist(),
                                                                            logprobs=lps if sp.kwargs.get("logprobs") == 0
                                                                            else None)
                                                      for j in range(sp.kwargs["n"])]))
        return out


def test_colocate_loads_the_policys_merged_weights_before_generating(tmp_path: Path, monkeypatch) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rolemrc.config import GRPOObjectiveConfig, GRPOVLLMConfig
    from rolemrc.rollout import ColocateEngine

    fake = types.ModuleType("vllm")
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(kwargs=kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    base.save_pretrained(tmp_path / "base")
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    policy(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    opt.step()  # lora_B moves off zero: the merged weights differ from the base's

    o = GRPOObjectiveConfig(num_generations=2, max_completion_length=5, rollout="vllm",
                            vllm=GRPOVLLMConfig(mode="colocate"))
    engine = ColocateEngine(o, model_path=str(tmp_path / "base"), tokenizer_path=None, stop_ids=[0],
                            max_model_len=64, seed=0)
    llm = FakeLLM.made[-1]
    assert llm.kwargs["gpu_memory_utilization"] == 0.3 and llm.kwargs["max_model_len"] == 64
    engine.sync(policy, step=1)
    rows = engine.generate([[5, 6, 7]], 2, [11])
    assert llm.calls == ["load", "reset_prefix_cache", "generate"]
    import copy

    want = copy.deepcopy(policy).merge_and_unload().state_dict()
    got = llm.hf.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)
    assert not torch.allclose(got["model.layers.0.self_attn.q_proj.weight"],
                              LlamaForCausalLM.from_pretrained(tmp_path / "base").state_dict()[
                                  "model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        greedy = policy.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)[0, 3:]
    assert rows == [greedy.tolist()] * 2
    # the sampled tokens' log-probs (logprobs=0), after temperature as the trainer scores them
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.sampled_logprobs == [[stub_logprob(t) for t in greedy.tolist()]] * 2


def test_colocate_without_vllm_says_how_to_get_it(monkeypatch) -> None:
    from rolemrc.config import GRPOObjectiveConfig, GRPOVLLMConfig
    from rolemrc.rollout import ColocateEngine, RolloutError

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    o = GRPOObjectiveConfig(rollout="vllm", vllm=GRPOVLLMConfig(mode="colocate"))
    with pytest.raises(RolloutError, match=r"no `rolemrc\[vllm\]` extra.*pip install -e \. --no-deps.*mode=server"):
        ColocateEngine(o, model_path="x", tokenizer_path=None, stop_ids=[0], max_model_len=8, seed=0)


def test_every_engine_follows_the_protocol_and_the_hf_engine_continues_prompt_ids() -> None:
    """The engines of rolemrc.rollout.ENGINES are Engines; the HF one's ``generate(prompts, n, seeds,
    sampling)`` gives each prompt's ``n`` continuations next to each other, cut after the stop token,
    the greedy ones equal to evaluation's batched greedy decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rolemrc.rollout import ENGINES, Engine, HFEngine, Sampling, engine_class
    from rolemrc.rollout.hf import greedy_generate_ids

    assert set(ENGINES) == {"hf", "server", "colocate"} and all(issubclass(engine_class(n), Engine) for n in ENGINES)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    engine = HFEngine(stop_ids=[3], pad_id=0, sampling=Sampling(6, sample=True, temperature=1.0))
    engine.sync(model, step=0)
    prompts = [[5, 6, 7], [9, 10]]
    greedy = engine.generate(prompts, 2, None, Sampling(6))
    want = greedy_generate_ids(model, prompts, batch_size=2, max_new_tokens=6, pad_id=0, stop_ids=[3])
    assert greedy == [want[0], want[0], want[1], want[1]]
    sampled = engine.generate(prompts, 3, [11, 12])
    assert len(sampled) == 6 and sampled == engine.generate(prompts, 3, [11, 12])  # the seed fixes the draw
    assert all(len(r) == 6 or r[-1] == 3 for r in sampled)


def test_the_correction_weights_are_the_trainers_over_vllms_logprobs_and_resume_mid_reuse(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """``vllm_importance_sampling_mode=token_truncate`` (at most 1.5), ``num_iterations=2``: at a rollout's first use the
    weights are exp(the policy's log-probs of the sampled tokens - the server's), clipped, with the policy
    that trains on them; its reuse keeps those weights (TRL computes them once, at generation) and a run
    crashed mid-reuse resumes on them, as the uninterrupted run."""
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.objectives.grpo import vllm_importance_weights
    from tests.conftest import FAST, compose_train
    from tests.train.helpers import series
    from tests.train.test_grpo import CrashAt  # noqa: F401  (the crash callback)

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # each micro-batch's weights and the recomputed ones
    real = GRPOModule.step_loss

    def spy(self: Any, batch: dict[str, Any]) -> Any:
        out = real(self, batch)
        with torch.no_grad():
            logps, mask, _ = self.token_logps(self.model, batch)
        want = vllm_importance_weights(logps, batch["sampling_logps"], mask, mode="token_truncate", clip_max=1.5)
        seen.append((batch["is_ratio"].clone(), want))
        return out

    monkeypatch.setattr(GRPOModule, "step_loss", spy)
    stub = VLLMStub(vocab=_tiny_vocab())
    common = [*FAST, *GRPO, f"objective.vllm.base_url={stub.url}", "trainer.max_steps=4", "objective.num_iterations=2",
              "objective.vllm_importance_sampling_mode=token_truncate", "objective.vllm_importance_sampling_clip_max=1.5",
              "model.peft.dropout=0", "runtime.checkpoint_every_n_steps=1"]  # no dropout: the recomputation is exact
    try:
        reference = Path(run(compose_train(common, run_dir=tmp_path / "reference"))["run_dir"])
        assert len(seen) == 4
        for step in (0, 2):  # first uses: the weights of this policy; reuses: the first use's, kept
            torch.testing.assert_close(seen[step][0], seen[step][1])
            assert torch.equal(seen[step + 1][0], seen[step][0])
            assert not torch.equal(seen[step + 1][1], seen[step][0])  # the policy moved: recomputing would differ
        assert any(((w != 1) & (w > 0) & (w < 1.5)).any() for w, _ in seen)
        crashed = tmp_path / "crashed"
        with pytest.raises(RuntimeError, match="crash at step 3"):
            run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                               "+callbacks.crash.step=3"], run_dir=crashed))
        run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    finally:
        stub.close()
    for key in ("train/loss", "train/sampling/importance_sampling_ratio/mean", "train/reward"):
        assert series(crashed, key) == pytest.approx(series(reference, key), abs=1e-6), key
