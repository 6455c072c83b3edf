"""Equal to the peer: each preference objective's first-step loss and logged metrics against TRL
1.16's trainer on the same tiny model, tokens and settings.

One build (module-scoped): our module on the sample pairs, its policy moved off the reference by a
seeded perturbation (so rewards, margins and accuracies are not all zero), and one micro-batch of
the run's own loader. TRL's trainer gets copies of the same weights and the same rows (its
collators' layout: prompt + response, right-padded, the response marked), and its
``compute_loss`` runs on them; its ``_metrics`` / ``store_metrics`` are what it logs.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import open_dict

from rolemrc.config import typed
from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.run.train import setup
from tests.conftest import FAST, compose_train

pytestmark = pytest.mark.xdist_group("objective_conformance")

PAIRS = ["data.max_length=160", "data.max_prompt_length=96", "data.val_fraction=0", "export.enabled=false",
         "data.batch_size=4", "trainer.max_steps=1"]
TOL = 1e-5


def _perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def _build(tmp: Path, *overrides: str) -> tuple[Any, dict[str, torch.Tensor]]:
    parts = setup(compose_train([*FAST, *PAIRS, *overrides], run_dir=tmp / "run"))
    module = parts.module
    # float64 on both sides: TRL's fused head and ours sum ~100 token log-probs of ~-4 each in
    # different orders, which in float32 alone differs by ~1e-3 on a sequence's log-prob.
    reference = getattr(module, "reference", None)
    for model in [module.model, *(reference.models() if reference is not None else [])]:
        model.double()
    _perturb(module.model)
    parts.datamodule.setup("fit")
    batch = next(iter(parts.datamodule.train_dataloader()))
    step_items = batch["step_pairs"] if "step_pairs" in batch else batch["step_examples"]
    assert float(step_items) == batch["index"].shape[0]  # one micro-batch is the whole step
    return parts, batch


def _ours(module: Any, batch: dict[str, torch.Tensor], objective: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Our step's loss and logged metrics (train/<name> -> value) under the objective settings given."""
    node = copy.deepcopy(module.objective)
    for key, value in objective.items():
        setattr(node, key, value)
    node.__post_init__()
    saved, module.objective = module.objective, node
    try:
        with torch.no_grad():
            loss, shares = module.step_loss(batch)
    finally:
        module.objective = saved
    return float(loss), {k.removeprefix("train/"): float(v) for k, v in shares.items()}


def _compare(ours: dict[str, float], theirs: dict[str, float], names: tuple[str, ...]) -> None:
    for name in names:
        assert name in ours, f"{name} is not logged (TRL logs it)"
        assert abs(ours[name] - theirs[name]) <= TOL * max(1.0, abs(theirs[name])), (name, ours[name], theirs[name])


# ---------------------------------------------------------------- DPO: every loss type of TRL 1.16

@pytest.fixture(scope="module")
def dpo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    return _build(tmp_path_factory.mktemp("dpo"), "objective=dpo")


def _trl_dpo(parts: Any, batch: dict[str, torch.Tensor], **args: Any) -> tuple[float, dict[str, float]]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    module = parts.module
    # The reference log-probs go in as TRL's precomputed ones (precompute_ref_log_probs): TRL 1.16's
    # reference forward (its fused head with log_probs alone) is the one part of its step that is
    # not exact in float64 (test_trls_reference_forward_is_ours_within_its_float32_head).
    with torch.no_grad():
        ref = module.reference_logps(batch, "train")
    config = DPOConfig(output_dir=str(Path(parts.parts.run_dir) / "trl"), report_to=[], use_cpu=True,
                       precompute_ref_log_probs=True,
                       per_device_train_batch_size=batch["index"].shape[0], max_length=None, save_strategy="no",
                       **args)
    dummy = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=copy.deepcopy(module.model), args=config,
                             train_dataset=dummy, processing_class=parts.chat.tokenizer)
        trainer.model.train()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "completion_mask": (batch["labels"] != IGNORE_INDEX).long()}
        b = batch["index"].shape[0]
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref[:b], ref[b:]
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, inputs)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")

# (our objective keys, TRL's DPOConfig arguments): each TRL 1.16 loss type, and weighted combinations.
DPO_CASES = {
    "sigmoid": ({}, {}),
    "hinge": ({}, {}),
    "ipo": ({}, {}),
    "exo_pair": ({"label_smoothing": 1e-3}, {"label_smoothing": 1e-3}),
    "nca_pair": ({}, {}),
    "robust": ({"label_smoothing": 0.1}, {"label_smoothing": 0.1}),
    "bco_pair": ({}, {}),
    "sppo_hard": ({}, {}),
    "aot": ({"label_smoothing": 0.1}, {"label_smoothing": 0.1}),
    "aot_unpaired": ({}, {}),
    "apo_zero": ({}, {}),
    "apo_down": ({}, {}),
    "discopop": ({"discopop_tau": 0.1}, {"discopop_tau": 0.1}),
    "sigmoid_norm": ({}, {}),
    "sft": ({}, {}),
}


@pytest.mark.parametrize("loss_type", list(DPO_CASES))
def test_each_dpo_loss_type_equals_trls_first_step(dpo, loss_type: str) -> None:
    parts, batch = dpo
    module = parts.module
    ours_extra, trl_extra = DPO_CASES[loss_type]
    loss, ours = _ours(module, batch, {"loss_type": loss_type, "beta": 0.3, **ours_extra})
    trl_loss, theirs = _trl_dpo(parts, batch, beta=0.3, loss_type=[loss_type], **trl_extra)
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    _compare(ours, theirs, DPO_METRICS)
    assert 0.0 < theirs["rewards/accuracies"] < 1.0  # the perturbed policy: a test that can fail


@pytest.mark.parametrize(("types", "weights"), [(["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]),
                                                (["ipo", "apo_zero"], None)])
def test_weighted_combinations_equal_trls_mpo(dpo, types: list[str], weights: list[float] | None) -> None:
    parts, batch = dpo
    module = parts.module
    loss, ours = _ours(module, batch, {"loss_type": types, "loss_weights": weights, "beta": 0.2})
    trl_loss, theirs = _trl_dpo(parts, batch, beta=0.2, loss_type=types, loss_weights=weights)
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    _compare(ours, theirs, DPO_METRICS)


def test_trls_reference_forward_is_ours_within_its_float32_head(dpo) -> None:
    """What the precomputed reference log-probs above stand in for: TRL's own reference forward
    (float32 log-probs of its fused head) gives the reference log-probs we compute within 1e-4 relative."""
    from trl.trainer.utils import add_fused_lm_head

    parts, batch = dpo
    ref_model = copy.deepcopy(parts.module.ref_model)
    add_fused_lm_head(ref_model)
    labels = batch["input_ids"].masked_fill(batch["labels"] == IGNORE_INDEX, IGNORE_INDEX)
    with torch.no_grad():
        theirs = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                           fused_lm_head=True).log_probs.sum(1).double()
        ours = parts.module.reference_logps(batch, "train")
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=0)


def test_a_combination_is_configured_with_hydra_overrides(tmp_path: Path) -> None:
    cfg = compose_train(["objective=dpo", "objective.loss_type=[sigmoid,bco_pair]", "objective.loss_weights=[0.8,0.2]"],
                        run_dir=tmp_path)
    objective = typed(cfg.objective)
    assert list(objective.loss_type) == ["sigmoid", "bco_pair"] and list(objective.loss_weights) == [0.8, 0.2]
    with open_dict(cfg):
        cfg.objective.loss_weights = [1.0]
    from rolemrc.config import check_train_config
    from rolemrc.errors import ConfigError

    with pytest.raises(ConfigError, match="loss_weights has 1 weights for 2 loss types"):
        check_train_config(cfg)


# ---------------------------------------------------------------- SimPO and ORPO: TRL's CPO and ORPO trainers

def _trl_pairs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our pair batch in the CPO/ORPO trainers' layout (chosen_* and rejected_* rows, labels -100
    outside the responses)."""
    b = batch["index"].shape[0]
    out = {}
    for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, 2 * b))):
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = batch["attention_mask"][rows]
        out[f"{side}_labels"] = batch["labels"][rows]
    return out


def _trl_reference_free(trainer_class: Any, config_class: Any, parts: Any, batch: dict[str, torch.Tensor],
                        **args: Any) -> tuple[float, dict[str, float]]:
    from datasets import Dataset

    config = config_class(output_dir=str(Path(parts.parts.run_dir) / "trl"), report_to=[], use_cpu=True,
                          per_device_train_batch_size=batch["index"].shape[0], save_strategy="no", **args)
    dummy = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(model=copy.deepcopy(parts.module.model), args=config, train_dataset=dummy,
                                processing_class=parts.chat.tokenizer)
        trainer.model.train()
        with torch.no_grad():
            loss, metrics = trainer.get_batch_loss_metrics(trainer.model, _trl_pairs(batch), train_eval="train")
    return float(loss), metrics


@pytest.fixture(scope="module")
def simpo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    return _build(tmp_path_factory.mktemp("simpo"), "objective=simpo")


@pytest.fixture(scope="module")
def orpo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    return _build(tmp_path_factory.mktemp("orpo"), "objective=orpo")


PREF_METRICS = DPO_METRICS


def _response_logps(module: Any, batch: dict[str, torch.Tensor], n: int) -> Any:
    saved = module.objective.nll_on_prompt
    module.objective.nll_on_prompt = False
    try:
        return module.sequence_logps(module.model, batch, n)
    finally:
        module.objective.nll_on_prompt = saved


@pytest.mark.parametrize(("ours_args", "trl_args"), [
    ({"beta": 2.0, "gamma": 1.0}, {"beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0}),
    ({"beta": 2.5, "gamma": 1.4, "sft_weight": 0.5, "label_smoothing": 0.1},
     {"beta": 2.5, "simpo_gamma": 1.4, "cpo_alpha": 0.5, "label_smoothing": 0.1}),
])
def test_simpo_equals_trls_cpo_simpo_first_step(simpo, ours_args, trl_args) -> None:
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    parts, batch = simpo
    assert parts.module.reference is None and parts.module.ref_model is None  # reference-free
    loss, ours = _ours(parts.module, batch, ours_args)
    trl_loss, theirs = _trl_reference_free(CPOTrainer, CPOConfig, parts, batch, loss_type="simpo", **trl_args)
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    _compare(ours, theirs, PREF_METRICS + (("nll_loss",) if trl_args["cpo_alpha"] else ()))
    assert 0.0 < theirs["rewards/accuracies"] < 1.0


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_equals_trls_orpo_first_step(orpo, beta: float) -> None:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    parts, batch = orpo
    assert parts.module.reference is None
    loss, ours = _ours(parts.module, batch, {"beta": beta})
    trl_loss, theirs = _trl_reference_free(ORPOTrainer, ORPOConfig, parts, batch, beta=beta)
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    _compare(ours, theirs, PREF_METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen"))
    # without the prompt in the NLL: only the NLL term changes, to the chosen responses' token mean
    loss_r, ours_r = _ours(parts.module, batch, {"beta": beta, "nll_on_prompt": False})
    b = batch["index"].shape[0]
    with torch.no_grad():  # the responses' log-probs, as the base module scores them
        logps, counts = _response_logps(parts.module, batch, 2 * b)
    nll = float(-logps[:b].sum() / counts[:b].sum())
    assert abs(ours_r["nll_loss"] - nll) < 1e-9 and abs(loss_r - (loss - ours["nll_loss"] + nll)) < 1e-9


# ---------------------------------------------------------------- KTO: TRL's KTOTrainer

@pytest.fixture(scope="module")
def kto(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    parts, batch = _build(tmp_path_factory.mktemp("kto"), "objective=kto")
    # The policy's perturbation alone lowers every log-prob, so the KL estimate would clamp to 0:
    # the reference is moved further off, making the estimate positive and the KL term live.
    _perturb(parts.module.ref_model, seed=1, scale=0.05)
    return parts, batch


@pytest.fixture(scope="module")
def kto_unpaired(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    """KTO on data.unpaired (not data.pairs): unbalanced labels, the first micro-batch mixing both."""
    from tests.data.test_unpaired_records import split_sample_pairs

    tmp = tmp_path_factory.mktemp("kto_unpaired")
    path = split_sample_pairs(tmp, keep=40)  # 40 desirable, 80 undesirable
    parts, batch = _build(tmp, "objective=kto", f"data.unpaired=[{{path: '{path}'}}]", "data.batch_size=7")
    _perturb(parts.module.ref_model, seed=1, scale=0.05)
    n_good = int(batch["label"].sum())
    assert 0 < n_good < batch["label"].shape[0] and 2 * n_good != batch["label"].shape[0]  # mixed, unbalanced
    assert not bool(batch["label"][:n_good].all())  # not sorted desirable-first: per-example labels matter
    return parts, batch


def _trl_kto(parts: Any, batch: dict[str, torch.Tensor], **args: Any) -> tuple[float, dict[str, float]]:
    """TRL's KTOTrainer on our batch's rows as unpaired examples (pairs split: chosen rows
    desirable, then rejected rows undesirable; unpaired: each row's label), its KL completions
    rotated by one as its dataset preparation does, padded by its own collator; the reference
    log-probs go in precomputed (see _trl_dpo)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from rolemrc.modules.kto import layout

    module = parts.module
    desirable = layout(batch)[0]
    n = batch["input_ids"].shape[0]
    examples = []
    for r in range(n):
        att = batch["attention_mask"][r].bool()
        resp = batch["labels"][r] != IGNORE_INDEX
        examples.append({"prompt_ids": batch["input_ids"][r][att & ~resp].tolist(),
                         "completion_ids": batch["input_ids"][r][resp].tolist(), "label": bool(desirable[r])})
    completions = [e["completion_ids"] for e in examples]
    for e, kl_completion in zip(examples, [completions[-1]] + completions[:-1]):
        e["KL_completion_ids"] = kl_completion
    tokenizer = parts.chat.tokenizer
    inputs = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id)(examples)
    # the reference log-probs of both layouts, as our reference computes them (TRL's precomputed columns)
    with torch.no_grad():
        inputs["ref_logps"] = module.reference_logps(batch, "train")
        kl_batch = {"input_ids": inputs["KL_input_ids"], "attention_mask": inputs["KL_attention_mask"],
                    "labels": inputs["KL_input_ids"].masked_fill(inputs["KL_completion_mask"] == 0, IGNORE_INDEX),
                    "index": batch["index"]}
        inputs["ref_KL_logps"] = module.reference_logps(kl_batch, "train")
    config = KTOConfig(output_dir=str(Path(parts.parts.run_dir) / "trl"), report_to=[], use_cpu=True,
                       precompute_ref_log_probs=True, per_device_train_batch_size=n, max_length=None,
                       save_strategy="no", **args)
    dummy = Dataset.from_list([{"prompt": "a", "completion": "b", "label": True},
                               {"prompt": "c", "completion": "d", "label": False}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(model=copy.deepcopy(module.model), args=config, train_dataset=dummy,
                             processing_class=tokenizer)
        trainer.model.train()
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, inputs)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


KTO_METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize(("ours_args", "trl_args"), [
    ({"beta": 0.3}, {"beta": 0.3}),
    ({"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7},
     {"beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7}),
    ({"beta": 0.2, "loss_type": "apo_zero_unpaired"}, {"beta": 0.2, "loss_type": "apo_zero_unpaired"}),
])
@pytest.mark.parametrize("data", ["pairs", "unpaired"])
def test_kto_equals_trls_kto_first_step(request, data: str, ours_args, trl_args) -> None:
    parts, batch = request.getfixturevalue("kto" if data == "pairs" else "kto_unpaired")
    loss, ours = _ours(parts.module, batch, ours_args)
    trl_loss, theirs = _trl_kto(parts, batch, **trl_args)
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    _compare(ours, theirs, KTO_METRICS)
    if ours_args.get("loss_type", "kto") == "kto":
        assert theirs["kl"] > 0  # the perturbed policy: the KL term is live, a test that can fail


def test_kto_fixed_kl_pairing_is_trls(kto_unpaired) -> None:
    """Each example's KL completion (:func:`fixed_kl_completions`) is the one TRL's KTOTrainer
    attaches to it when it prepares its dataset, on TRL's own tokenized rows (11 examples in
    chunks of 4: a last, shorter chunk)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from rolemrc.modules.kto import fixed_kl_completions

    parts, _ = kto_unpaired
    records = [{"prompt": f"Question {i}: what is {i} + {i}?", "completion": f" It is {2 * i}" + " ok" * (i % 3),
                "label": i % 3 != 0} for i in range(11)]
    config = KTOConfig(output_dir=str(Path(parts.parts.run_dir) / "trl_kl"), report_to=[], use_cpu=True,
                       per_device_train_batch_size=4, max_length=None, save_strategy="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = KTOTrainer(model=copy.deepcopy(parts.module.model), ref_model=copy.deepcopy(parts.module.model),
                             args=config, train_dataset=Dataset.from_list(records),
                             processing_class=parts.chat.tokenizer)
    rows = trainer.train_dataset.to_list()
    assert len(rows) == 11 and len({tuple(r["completion_ids"]) for r in rows}) == 11  # a pairing that can fail
    ours = fixed_kl_completions(rows, list(range(11)), 4, pairs=False)
    assert ours == [r["KL_completion_ids"] for r in rows]
    # shuffled batches look the same rows' partners up
    assert fixed_kl_completions(rows, [7, 2, 10], 4, pairs=False) == [rows[i]["KL_completion_ids"] for i in (7, 2, 10)]


@pytest.mark.parametrize("data", ["pairs", "unpaired"])
def test_kto_kl_pairs_each_prompt_with_anothers_completion(request, data: str) -> None:
    """The re-paired rows are TRL's: row j = prompt j + completion j-1, as TRL's collator pads them."""
    from rolemrc.modules.kto import mismatched

    _, batch = request.getfixturevalue("kto" if data == "pairs" else "kto_unpaired")
    kl = mismatched(batch)
    n = batch["input_ids"].shape[0]
    for j in range(n):
        resp = batch["labels"][j] != IGNORE_INDEX
        prompt = batch["input_ids"][j][batch["attention_mask"][j].bool() & ~resp]
        completion = batch["input_ids"][j - 1][batch["labels"][j - 1] != IGNORE_INDEX]
        row = kl["input_ids"][j][kl["attention_mask"][j].bool()]
        assert torch.equal(row, torch.cat([prompt, completion]))
        assert torch.equal(kl["labels"][j][kl["labels"][j] != IGNORE_INDEX], completion)
        other = batch["input_ids"][j - 1][batch["attention_mask"][j - 1].bool() & (batch["labels"][j - 1] == IGNORE_INDEX)]
        if data == "pairs":  # unpaired data may hold two answers to one prompt side by side (as in TRL)
            assert not torch.equal(prompt, other)  # mismatched: the completion answers another prompt


# ---------------------------------------------------------------- reward models: TRL's RewardTrainer

@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    return _build(tmp_path_factory.mktemp("reward"), "objective=reward")


@pytest.mark.parametrize(("center", "margin"), [(None, False), (0.01, True)])
def test_reward_model_equals_trls_reward_trainer_first_step(reward, center: float | None, margin: bool) -> None:
    """Loss and every metric TRL's ``RewardTrainer.compute_loss`` logs (``accuracy``, ``margin``,
    ``mean_reward``, ``min_reward``, ``max_reward``) on the same scores: its collator's layout is
    ours (chosen rows then rejected rows, right-padded, ``margin`` per pair)."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    parts, batch = reward
    batch = dict(batch)
    if margin:
        batch["margin"] = torch.tensor([0.5, 0.0, 2.0, -1.0])[: batch["index"].shape[0]]
    loss, ours = _ours(parts.module, batch, {"center_rewards_coefficient": center})
    module = parts.module
    module.on_validation_epoch_start()
    saved = module.objective.center_rewards_coefficient
    module.objective.center_rewards_coefficient = center
    try:
        with torch.no_grad():
            module.validation_step(batch, 0)
        val = {k: float(v) for k, v in module.val_metrics(module._val_items[0][1]).items()}
    finally:
        module.objective.center_rewards_coefficient = saved

    config = RewardConfig(output_dir=str(Path(parts.parts.run_dir) / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=batch["index"].shape[0], save_strategy="no",
                          center_rewards_coefficient=center)
    dummy = Dataset.from_list([{"chosen": "a b", "rejected": "c"}] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = RewardTrainer(model=copy.deepcopy(module.model), args=config, train_dataset=dummy,
                                processing_class=parts.chat.tokenizer)
        trainer.model.train()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if margin:
            inputs["margin"] = batch["margin"]
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, inputs))
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    assert abs(val["loss"] - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (val["loss"], trl_loss)
    _compare(ours, theirs, ("accuracy", "margin", "mean_reward"))
    _compare(val, theirs, ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"))
    assert 0.0 < theirs["accuracy"] < 1.0
    # TRL's num_tokens after this first step: the batch's non-padding tokens, what RewardModule counts
    # (its run totals: tests/train/test_reward.py)
    assert theirs["num_tokens"] == int(batch["attention_mask"].sum())
