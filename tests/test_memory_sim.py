"""The simulated per-rank memory (rolemrc.sizing.simulate) against the same step really run: two gloo
ranks on this CPU train the tiny model one FSDP2 step under the same tracker; the simulated peak
(fake tensors, fake process group) is within 5% of the real one, and the simulated parameter,
gradient and AdamW bytes equal what FSDP2's sharding gives by count."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rolemrc.run.build import build_module
from rolemrc.run.strategies import world_size
from rolemrc.config import TrainStep
from rolemrc.sizing import simulate as simulator
from rolemrc.sizing.decide import run_spec
from tests.conftest import ROOT, compose_train

pytestmark = [pytest.mark.multiprocess]

def simulate(cfg, **kwargs):
    """The simulator as a training run calls it: handed the run's module builder and world size."""
    return simulator.simulate(TrainStep.of(cfg), build=build_module, world=world_size(cfg.trainer), **kwargs)


# The tiny model (conf/model/tiny.yaml) on 2 ranks, 2 rows of 256 tokens.
TINY = ["strategy=fsdp", "trainer.devices=2", "data.batch_size=2", "data.max_length=256"]


def _real_peak(tmp_path: Path, cfg, checkpointing: bool) -> dict:
    """Rank 0's tracked result of the step really run on 2 gloo ranks."""
    spec = tmp_path / "spec.json"
    out = tmp_path / "real.json"
    spec.write_text(json.dumps(run_spec(TrainStep.of(cfg), checkpointing=checkpointing, build=build_module, world=2)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT / "src")}
        procs.append(subprocess.Popen([sys.executable, "-m", "rolemrc.sizing.simulate", "--real", str(spec), str(out)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    return json.loads(out.read_text())


def _shard_bytes(cfg, world: int) -> int:
    """fp32 bytes of one rank's FSDP2 shards of the tiny model's parameters (dim 0 padded to a
    multiple of the ranks), from the model's own shapes."""
    from rolemrc.run.build import build_chat, build_model

    model = build_model(cfg.model, build_chat(cfg.model).tokenizer)
    total = 0
    for p in model.parameters():
        rows = math.ceil(p.shape[0] / world)
        total += rows * (p.numel() // p.shape[0]) * 4
    return total, sum(1 for _ in model.parameters())


def test_simulated_peak_matches_the_real_two_rank_step(tmp_path: Path) -> None:
    """The recipes' setting: bf16 compute over fp32 masters, fp32 reduction, activation checkpointing
    (measured: simulated 1.009x the real peak)."""
    checkpointing = True
    cfg = compose_train([*TINY, "trainer.precision=bf16-mixed", "strategy.param_dtype=bfloat16",
                         "strategy.reduce_dtype=float32"])
    real = _real_peak(tmp_path, cfg, checkpointing)
    sim = simulate(cfg, checkpointing=checkpointing)  # in this process, which has no process group of its own
    assert real["kind"] == "gloo" and sim.kind == "fake" and sim.ranks == real["ranks"] == 2
    assert sim.tracker == real["tracker"] == "FSDPMemTracker"
    ratio = sim.peak_bytes / real["peak_bytes"]
    print(f"simulated / real per-rank peak: {ratio:.4f} ({sim.peak_bytes} / {real['peak_bytes']} bytes)")
    assert abs(ratio - 1) <= 0.05, (sim.peak_bytes, real["peak_bytes"])
    assert sim.by_category["Activation"] > 0 and real["by_category"]["Activation"] > 0

    # Parameters, gradients and AdamW states by count: fp32 shards (masters), their gradients, and
    # exp_avg + exp_avg_sq per shard plus one 4-byte step counter per parameter.
    shards, n_params = _shard_bytes(cfg, 2)
    for result in (sim.after_backward, real["after_backward"]):
        assert result["Sharded Param"] == shards
        assert result["Sharded Grad"] == shards
        assert result["OptState"] == 2 * shards + 4 * n_params


def test_dpo_copy_reference_is_held_and_sharded_like_the_policy() -> None:
    """The DPO copy reference adds its bf16 shards (model.dtype) to the policy's fp32 ones. (Simulated
    in this process, which has no process group of its own; the child process that training and
    the memory CLI use is exercised above.)"""
    base = [*TINY, "objective=dpo", "data.max_prompt_length=128", "model.dtype=bfloat16", "trainer.precision=bf16-mixed",
            "strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32"]
    copy = simulate(compose_train([*base, "objective.reference=copy"]), checkpointing=False)
    shards, _ = _shard_bytes(compose_train(base), 2)
    assert copy.after_backward["Sharded Param"] == shards + shards // 2  # fp32 masters + the copy's bf16 shards
    assert copy.rows == 2 * 2 and copy.tokens == 4 * 256  # chosen and rejected rows of max_length


@pytest.mark.parametrize("extra", [["objective=dpo", "objective.reference=copy"], ["objective=dpo", "model.peft.enabled=true"]])
def test_single_device_simulation_with_frozen_parameters(extra: list[str]) -> None:
    """One device (torch's MemTracker, not FSDP's): a frozen reference copy or LoRA's frozen base is
    simulated (torch's tracker would hook every parameter's gradient and raise on a frozen one), and
    the copy's parameters are counted beside the policy's."""
    base = ["strategy=single", "data.batch_size=2", "data.max_length=128", "data.max_prompt_length=64"]
    sim = simulate(compose_train([*base, *extra]), checkpointing=False)
    assert sim.tracker == "MemTracker" and sim.peak_bytes > 0
    if "objective.reference=copy" in extra:
        alone = simulate(compose_train([*base, "objective=simpo"]), checkpointing=False)
        assert sim.after_backward["Parameter"] > alone.after_backward["Parameter"]


# objective=grpo on one device: 2 prompts x 2 micro-batches x 3 generations = 12 completions of 16
# tokens after 48-token prompts, sampled at once at the step's start.
GRPO = ["objective=grpo", "strategy=single", "data.prompts=[{path: ${asset:sample/test.jsonl}}]",
        "data.max_prompt_length=48", "data.batch_size=2", "trainer.accumulate_grad_batches=2",
        "objective.num_generations=3", "objective.max_completion_length=16", "data.val_fraction=0"]


def test_grpo_rollout_is_simulated_against_the_real_generate_and_its_cache() -> None:
    """The simulated rollout phase (generate's prefill and last decoding step under fake tensors)
    against the training's own ``GRPOModule.generate`` really run on this CPU, every completion to
    max_completion_length, under the same tracker after the same warm step: peaks within 5%; the
    report's KV cache bytes equal the summed bytes of generate's real DynamicCache."""
    import torch

    from rolemrc.sizing import simulate as ms
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.parts import build_chat

    cfg = compose_train(GRPO)
    sim = simulate(cfg, checkpointing=False)
    n, prompt, completion = 2 * 2 * 3, 48, 16
    assert sim.rollout["sequences"] == n and set(sim.phases) == {"rollout", "step"}
    assert sim.peak_bytes == max(p["peak_bytes"] for p in sim.phases.values())
    assert sim.phase in sim.phases and sim.peak_bytes == sim.phases[sim.phase]["peak_bytes"]

    module, vocab = ms._build(TrainStep.of(cfg), False, build_module, "cpu")
    module._chat = build_chat(cfg.model)
    module.__dict__["stop_ids"] = []  # (the property, shadowed) no stop token: every completion runs to the end
    GRPOModule.stop_ids  # noqa: B018 (the property the instance shadows exists)
    ms._configure(module, None)
    optimizer = ms._optimizer(module)
    ms._one_step(module, optimizer, module.on_before_batch_transfer(ms._batch(cfg, module, 1, vocab, 16), 0),
                 cfg.trainer.precision)
    ids = torch.full((n, prompt), 5, dtype=torch.long)
    tracker = ms._tracker(module, optimizer, False)
    with tracker:
        new = ms._Call(lambda: module.generate(ids, torch.ones_like(ids)))()
    assert new.shape == (n, completion)
    _, real, real_by = ms._peak(tracker)
    simulated = sim.phases["rollout"]
    ratio = simulated["peak_bytes"] / real
    print(f"GRPO rollout, simulated / real peak: {ratio:.4f} ({simulated['peak_bytes']} / {real} bytes)")
    assert abs(ratio - 1) <= 0.05
    # generate's own share (the peak less the weights and AdamW's states it finds): within 5% too
    held = ("Parameter", "Buffer", "Optstate")
    own, real_own = (total - sum(by[k] for k in held) for total, by in ((simulated["peak_bytes"], simulated["by_category"]),
                                                                         (real, real_by)))
    assert simulated["by_category"]["Gradient"] == real_by["Gradient"] == 0  # zero_grad freed them
    assert own > 0 and abs(own / real_own - 1) <= 0.05, (own, real_own)

    with torch.no_grad():
        out = module.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion,
                                    min_new_tokens=completion, do_sample=True, use_cache=True,
                                    return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    real_cache = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert cache.get_seq_length() == prompt + completion - 1
    assert sim.rollout["kv_cache_bytes"] == real_cache == ms.kv_cache_bytes(module.model.config, n,
                                                                            prompt + completion - 1, torch.float32)


def test_multi_turn_rollouts_are_sized_by_the_whole_conversation() -> None:
    """With a multi-turn env the rollout phase is the last turn's generate after the longest
    conversation before it (env.max_turns replies, env.user.max_tokens per user turn, capped at
    env.max_tokens), and the loss step trains on whole conversations: the simulated peak grows with
    env.max_turns; one turn is sized as the single-turn rollout."""
    base = [*GRPO, "env=scripted", "env.user.max_tokens=24", "data.max_length=1024"]
    one, three = (simulate(compose_train([*base, f"env.max_turns={t}"]), checkpointing=False) for t in (1, 3))
    assert one.rollout["prompt_tokens"] == 48 and one.rollout["completion_tokens"] == 16  # as env=none
    assert three.rollout["prompt_tokens"] == 48 + 2 * 16 + 2 * 24  # the conversation before the last reply
    assert three.rollout["kv_cache_bytes"] > one.rollout["kv_cache_bytes"]
    assert three.tokens == one.tokens * (48 + 3 * 16 + 2 * 24) // (48 + 16)  # the step's rows: whole conversations
    assert three.phases["rollout"]["peak_bytes"] > one.phases["rollout"]["peak_bytes"]
    assert three.peak_bytes > one.peak_bytes
    from rolemrc.config import objective_settings  # the cap: env.max_tokens (null: data.max_length)

    capped = compose_train([*base, "env.max_turns=3", "env.max_tokens=100"])
    assert objective_settings(capped.objective).rollout_shape(capped.data, capped.trainer, capped.env) == (12, 84, 16)
