"""The objectives' settings: :class:`ObjectiveConfig` (every objective's keys, and the hooks the run
and sizing call with their defaults), each objective's schema and the registry ``OBJECTIVES``
(re-exported by ``rolemrc.config``). Imports no torch: a module is named by its import path."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from rolemrc.errors import ConfigError
from rolemrc.registry import Registry


@dataclass
class ObjectiveConfig:
    """Keys every objective has. Each option of the ``objective`` group has its own schema
    (``sft_schema``, ``dpo_schema`` in its defaults), so ``objective=sft objective.beta=0.1``
    fails at compose time naming ``beta``."""

    name: str = MISSING  # a key of OBJECTIVES: sft | dpo | simpo | orpo | kto | grpo | rloo | reward
    logprob_chunk_size: int = 1024  # rows of the lm_head computed at once

    # ---- the contract: what the run and sizing ask of an objective's settings (defaults here)
    @property
    def needs_reference(self) -> bool:
        """Whether the run builds the reference its registry entry takes (GRPO: only with ``beta > 0``)."""
        return True

    def micro_batch_tokens(self, data: Any, env: Any = None) -> int | None:
        """Tokens of a training micro-batch for the memory formula; None: the data's rows. ``env``:
        the run's ``env:`` settings (an online objective's rollouts may be whole conversations)."""
        return None

    def rollout_shape(self, data: Any, trainer: Any, env: Any = None) -> tuple[int, int, int] | None:
        """(sequences, prompt tokens, completion tokens) of a step's rollout on the device; None: none."""
        return None

    @property
    def rolls_conversations(self) -> bool:
        """Whether the objective trains on conversations with an environment (``env=<name>``, not none)."""
        return False

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""


@dataclass
class SFTObjectiveConfig(ObjectiveConfig):
    """``objective=sft``: next-token loss on the assistant turns."""

    name: str = "sft"


@dataclass
class DPOObjectiveConfig(ObjectiveConfig):
    """``objective=dpo``: preference pairs against a frozen reference."""

    name: str = "dpo"
    # One of rolemrc.objectives.dpo.LOSS_TYPES (TRL 1.16's DPO loss types), or a list of them
    # combined with loss_weights (TRL's MPO), e.g. [sigmoid, bco_pair] with [0.8, 0.2].
    loss_type: Any = "sigmoid"
    loss_weights: Optional[list[float]] = None  # None: 1 per loss type
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid (cDPO), robust, exo_pair (needs > 0), aot, aot_unpaired
    discopop_tau: float = 0.05  # discopop's temperature (the DiscoPOP paper's and TRL's default)
    sft_weight: float = 0.0  # optional NLL term on the chosen response
    reference: str = "copy"  # copy | adapter | precomputed
    reference_cache_dir: Optional[str] = None  # precomputed: defaults to <run_dir>/ref_cache
    # TR-DPO (TRL's names and defaults): every ref_model_sync_steps optimizer steps the reference copy
    # becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; needs reference=copy, no LoRA
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    share_prompt: bool = False  # prompt, chosen, rejected in one sequence (perf issue)

    def __post_init__(self) -> None:
        """Checked whenever the node becomes this dataclass (``check_train_config`` does that
        before anything loads), so a bad value is named at once, not at the first training step."""
        # Here, not at module level: the loss functions import torch, which what reads this
        # module without training (synthesize.py, data readers) need not pay for at start.
        from rolemrc.objectives.dpo import LOSS_TYPE_ALIASES, LOSS_TYPES, check_settings, loss_terms

        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type or [])
        if not types:
            raise ConfigError("objective.loss_type names no loss")
        for t in types:
            one_of("objective.loss_type", LOSS_TYPE_ALIASES.get(t, t), LOSS_TYPES)
        one_of("objective.reference", self.reference, REFERENCE_MODES)
        check_sync_ref(self)
        try:
            names = [t for t, _ in loss_terms(types, self.loss_weights)]
        except ValueError as e:
            raise ConfigError(f"objective.loss_type/loss_weights: {e}") from None
        try:
            check_settings(self.beta, names, self.label_smoothing, self.discopop_tau, key="objective.")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.sft_weight < 0:
            raise ConfigError(f"objective.sft_weight must be >= 0, got {self.sft_weight}")


REFERENCE_MODES = ("copy", "adapter", "precomputed")


def check_sync_ref(objective: Any) -> None:
    """``sync_ref_model`` (TR-DPO) mixes the policy into a reference copy: its numbers, and a
    reference there is to mix (LoRA runs are refused in :func:`check_choices`)."""
    if not 0.0 <= objective.ref_model_mixup_alpha <= 1.0:
        raise ConfigError(f"objective.ref_model_mixup_alpha must be in [0, 1] (the policy's share of the synced "
                          f"reference; TR-DPO: 0.6), got {objective.ref_model_mixup_alpha}")
    if objective.ref_model_sync_steps < 1:
        raise ConfigError(f"objective.ref_model_sync_steps must be >= 1 (optimizer steps between syncs), "
                          f"got {objective.ref_model_sync_steps}")
    if not objective.sync_ref_model:
        return
    if objective.reference != "copy":
        why = ("the precomputed log-probs are fixed before training" if objective.reference == "precomputed"
               else "the adapter reference is the policy's own base weights, with nothing to mix into")
        raise ConfigError(f"objective.sync_ref_model=true needs objective.reference=copy, got "
                          f"{objective.reference} ({why}): set objective.reference=copy or "
                          f"objective.sync_ref_model=false")
    if objective.beta == 0:
        raise ConfigError("objective.sync_ref_model=true with objective.beta=0: no reference is used, so there is "
                          "nothing to sync; set objective.beta > 0 or objective.sync_ref_model=false")


@dataclass
class PairObjectiveConfig(ObjectiveConfig):
    """Keys of a reference-free objective over preference pairs (SimPO, ORPO, a user's own)."""

    beta: float = 0.1

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")


@dataclass
class SimPOObjectiveConfig(PairObjectiveConfig):
    """``objective=simpo``: reference-free pairs over length-normalised log-probs (TRL's CPO
    ``loss_type=simpo``); no reference model."""

    name: str = "simpo"
    beta: float = 2.0  # reward scale (SimPO paper: 2.0-2.5; TRL CPO's beta)
    gamma: float = 1.0  # target reward margin (TRL CPO's simpo_gamma; the paper's gamma)
    label_smoothing: float = 0.0  # conservative loss (TRL CPO's label_smoothing)
    sft_weight: float = 0.0  # NLL on the chosen responses (TRL CPO's cpo_alpha; SimPO: 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_weight < 0:
            raise ConfigError(f"objective.sft_weight must be >= 0, got {self.sft_weight}")


@dataclass
class ORPOObjectiveConfig(PairObjectiveConfig):
    """``objective=orpo``: NLL on the chosen sequences + ``beta`` x the log odds ratio,
    reference-free (TRL's ORPOTrainer); no reference model."""

    name: str = "orpo"
    beta: float = 0.1  # the paper's lambda (TRL ORPOConfig's beta)
    nll_on_prompt: bool = True  # the NLL over prompt + response, as TRL and the authors' code (needs data.packing=false)

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if self.nll_on_prompt and cfg.data.packing:
            raise ConfigError("objective.nll_on_prompt=true (ORPO's NLL over prompt + response) needs unpacked "
                              "pairs: set data.packing=false or objective.nll_on_prompt=false")


@dataclass
class KTOObjectiveConfig(ObjectiveConfig):
    """``objective=kto``: desirable / undesirable examples against a reference (TRL's KTOTrainer):
    the unpaired examples of ``data.unpaired`` when given, else each pair of ``data.pairs`` split into
    one desirable (chosen) and one undesirable (rejected) example."""

    name: str = "kto"
    loss_type: str = "kto"  # kto | apo_zero_unpaired (TRL KTOConfig's loss_type)
    beta: float = 0.1
    desirable_weight: float = 1.0  # TRL's desirable_weight (the paper's lambda_D)
    undesirable_weight: float = 1.0  # TRL's undesirable_weight (the paper's lambda_U)
    reference: str = "copy"  # copy | adapter | precomputed (kto: each example's KL row fixed, as in TRL, is in the table)

    def __post_init__(self) -> None:
        from rolemrc.objectives.kto import KTO_LOSS_TYPES

        one_of("objective.loss_type", self.loss_type, KTO_LOSS_TYPES)
        one_of("objective.reference", self.reference, REFERENCE_MODES)
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"objective.{key} must be > 0, got {getattr(self, key)}")

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=kto needs unpacked examples (its KL term re-pairs prompts and completions): "
                              "set data.packing=false")
        if self.loss_type == "kto" and int(cfg.data.batch_size) < 2:
            raise ConfigError(f"objective=kto needs data.batch_size >= 2, got {cfg.data.batch_size}: with one item per "
                              "micro-batch its KL rows pair a prompt with its own completion (TRL refuses a batch of 1 "
                              "too); or objective.loss_type=apo_zero_unpaired (no KL term)")
        if cfg.data.get("unpaired_val") and not cfg.data.get("unpaired"):
            raise ConfigError("data.unpaired_val is set but data.unpaired is empty: objective=kto trains on "
                              "data.unpaired when given, else on data.pairs split (validated on data.pairs_val)")


@dataclass
class RewardObjectiveConfig(ObjectiveConfig):
    """``objective=reward``: a reward model (the policy's architecture with a one-score
    sequence-classification head) trained on preference pairs with the Bradley-Terry loss, as TRL
    1.16's RewardTrainer; its export is what GRPO's ``reward_model`` reward loads."""

    name: str = "reward"
    # c x mean((r_chosen + r_rejected)^2) added to the loss (TRL RewardConfig's center_rewards_coefficient;
    # null: none, TRL's default; Eisenstein et al. 2023 use 0.01)
    center_rewards_coefficient: Optional[float] = None
    disable_dropout: bool = True  # TRL RewardConfig's disable_dropout: dropout off in the trained model

    def __post_init__(self) -> None:
        c = self.center_rewards_coefficient
        if c is not None and not c >= 0:
            raise ConfigError(f"objective.center_rewards_coefficient must be >= 0 or null, got {c}")

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=reward scores each chosen and rejected sequence at its last token: "
                              "set data.packing=false")
        if cfg.model.quantization.load_in_4bit:
            raise ConfigError("objective=reward does not support model.quantization.load_in_4bit (QLoRA): "
                              "train it in full or with LoRA (model.peft.enabled=true)")


def _default_rewards() -> dict[str, Any]:
    return {"verifier": {"type": "verifier"}}


VLLM_MODES = ("server", "colocate")
# GRPO's rollout engines (rolemrc.rollout.ENGINES): name -> "package.module:Class", imported when built, so configs
# read without torch. objective.rollout names one; the vLLM ones (VLLM_MODES) are rollout=vllm, vllm.mode the name.
ENGINES: Registry[str] = Registry("rollout engine", doc="GRPO's rollout engines, by objective.rollout "
                                  "(hf) or, for objective.rollout=vllm, objective.vllm.mode")
ENGINES.register("hf", "rolemrc.rollout.hf:HFEngine", doc="transformers generate in this process")
ENGINES.register("server", "rolemrc.rollout.vllm:ServerEngine",
                 doc="a vLLM OpenAI-compatible server, weights synced each step")
ENGINES.register("colocate", "rolemrc.rollout.vllm:ColocateEngine",
                 doc="vllm.LLM in this process, weights loaded each step")


@dataclass
class GRPOVLLMConfig:
    """``objective.vllm``: where ``objective.rollout=vllm`` samples (docs/rl.md, ``rolemrc.rollout``).
    ``server``: any vLLM OpenAI-compatible endpoint, token ids in and out through ``/v1/completions``,
    the LoRA adapter synced each step through ``/v1/load_lora_adapter``; ``colocate``: an in-process
    ``vllm.LLM`` on the trainer's GPU, the policy's full (LoRA-merged) weights loaded each step."""

    mode: str = "server"  # server | colocate
    # server: the endpoint (http://host:8000/v1); every request names the adapter synced for its step
    base_url: Optional[str] = None
    api_key_env: Optional[str] = None  # server: variable holding the key (never the key); None: none sent
    sync_dir: Optional[str] = None  # server: adapters written here, read by the server; None: <run_dir>/vllm_adapters
    concurrency: int = 8  # server: requests in flight (one per prompt, n = num_generations)
    timeout_s: float = 600.0  # server: seconds one request may take
    max_attempts: int = 5  # server: per request; 429/5xx/timeouts/connection errors/malformed answers are retried
    backoff_s: float = 1.0  # server: first retry's wait (exponential, full jitter; at least Retry-After)
    max_backoff_s: float = 60.0  # server: the longest wait between attempts
    gpu_memory_utilization: float = 0.3  # colocate: vLLM's share of the trainer's GPU (weights + KV cache)
    max_model_len: Optional[int] = None  # colocate: None = data.max_prompt_length + objective.max_completion_length
    dtype: str = "auto"  # colocate: vllm.LLM's dtype
    enable_sleep_mode: bool = False  # colocate: free vLLM's KV cache and weights between rollouts (sleep level 2)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)  # colocate: more vllm.LLM(...) arguments

    def __post_init__(self) -> None:
        one_of("objective.vllm.mode", self.mode, VLLM_MODES)
        if self.concurrency < 1 or self.max_attempts < 1:
            raise ConfigError("objective.vllm.concurrency and objective.vllm.max_attempts must be >= 1")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"objective.vllm.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")

    def check_run(self, cfg: Any) -> None:
        """Weight sync that cannot work for this run is refused here, never rolled out from stale weights."""
        peft = bool(cfg.model.peft.enabled)
        if self.mode == "server":
            if not self.base_url:
                raise ConfigError("objective.rollout=vllm with objective.vllm.mode=server needs objective.vllm.base_url "
                                  "(the vLLM server's OpenAI-compatible URL, e.g. http://host:8000/v1)")
            if not peft:
                raise ConfigError("objective.vllm.mode=server syncs the policy as a LoRA adapter each step "
                                  "(POST /v1/load_lora_adapter): a full fine-tune cannot be synced to a plain endpoint. "
                                  "Set model.peft.enabled=true, or objective.vllm.mode=colocate (vLLM on the trainer's GPU)")
        elif not cfg.model.get("path"):
            raise ConfigError("objective.vllm.mode=colocate builds vllm.LLM from model.path (the policy's weights are "
                              "loaded into it before every rollout): model.path is not set")


@dataclass
class PromptsObjectiveConfig(ObjectiveConfig):
    """The keys and rules every prompts objective (grpo, rloo) shares: ``num_generations`` completions
    sampled per prompt by ``rollout``'s engine (``temperature``, ``top_p``, ``top_k``,
    ``max_completion_length``), scored by ``rewards``; the reference (``beta > 0``) and its sync."""

    beta: float = 0.0  # KL coefficient to the reference; 0 builds no reference
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: epsilon (DAPO's clip-higher: e.g. 0.28)
    num_iterations: int = 1  # TRL's mu: each step's rollouts train this many optimizer steps (old log-probs)
    num_generations: int = 8  # completions per prompt (G)
    num_generations_eval: Optional[int] = None  # completions sampled per validation prompt (None: num_generations)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_completion_length: int = 256  # TRL: 512
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss
    reference: str = "copy"  # copy | adapter (needs model.peft.enabled); built only when beta > 0
    # TR-DPO's reference sync (TRL's names and defaults): every ref_model_sync_steps optimizer steps the
    # reference copy becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; needs beta > 0, copy
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    # name -> reward spec as rolemrc.rewards.build_rewards takes it: {type: verifier|judge, weight, ...}
    # or {_target_: dotted.path, weight, **kwargs}
    rewards: dict[str, Any] = field(default_factory=_default_rewards)
    rollout: str = "hf"  # hf (transformers generate) | vllm (objective.vllm: a server or colocated, GPU)
    vllm: GRPOVLLMConfig = field(default_factory=GRPOVLLMConfig)

    def check_shared_keys(self) -> None:
        """The shared keys' rules (each objective's ``__post_init__`` runs them beside its own): the
        reference, the rollout, the sampling keys and the reward set."""
        one_of("objective.reference", self.reference, ("copy", "adapter"))
        # the values objective.rollout takes: the engines' names, the vLLM ones as vllm
        one_of("objective.rollout", self.rollout, tuple(dict.fromkeys("vllm" if n in VLLM_MODES else n for n in ENGINES)))
        if self.beta < 0:
            raise ConfigError(f"objective.beta must be >= 0, got {self.beta}")
        check_sync_ref(self)
        if self.num_iterations < 1:
            raise ConfigError(f"objective.num_iterations must be >= 1 (optimizer steps per rollout batch), "
                              f"got {self.num_iterations}")
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"objective.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"objective.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_completion_length < 1:
            raise ConfigError(f"objective.max_completion_length must be >= 1, got {self.max_completion_length}")
        if not self.rewards:
            raise ConfigError("objective.rewards is empty: name at least one reward, e.g. {verifier: {type: verifier}}")
        for name, spec in self.rewards.items():
            if not isinstance(spec, dict) or not ("type" in spec or "_target_" in spec):
                raise ConfigError(f"objective.rewards.{name} must be a mapping with type (verifier | judge) "
                                  f"or _target_, got {spec!r}")

    def conversation_tokens(self, data: Any, env: Any = None) -> int:
        """Tokens of the longest rollout the config allows: one completion after the prompt
        (``data.max_prompt_length + max_completion_length``), or with a multi-turn environment
        (``env.name`` not none) the whole conversation: the opening prompt, ``env.max_turns`` replies
        of ``max_completion_length`` and a user turn of ``env.user.max_tokens`` between each two,
        capped at ``env.max_tokens`` (null: ``data.max_length``)."""
        prompt, reply = int(data.max_prompt_length), self.max_completion_length
        if env is None or env.name == "none":
            return prompt + reply
        turns = int(env.max_turns)
        cap = int(env.max_tokens) if env.max_tokens is not None else int(data.max_length)
        return max(reply + 1, min(cap, prompt + turns * reply + (turns - 1) * int(env.user.max_tokens)))

    def micro_batch_tokens(self, data: Any, env: Any = None) -> int:
        """Tokens of a training micro-batch (the memory formula's): ``data.batch_size x num_generations``
        rollouts of :meth:`conversation_tokens` each."""
        return int(data.batch_size) * self.num_generations * self.conversation_tokens(data, env)

    def rollout_shape(self, data: Any, trainer: Any, env: Any = None) -> tuple[int, int, int] | None:
        """(sequences, prompt tokens, completion tokens) of a step's rollout, sampled at once: the
        step's ``data.batch_size x accumulate_grad_batches`` prompts, ``num_generations`` each; with a
        multi-turn ``env``, its largest ``generate`` call: the last reply's, after the whole
        conversation before it (:meth:`conversation_tokens` less one reply; each turn's prompt is the
        conversation so far). None where ``generate`` does not sample them (``rollout=vllm``)."""
        if self.rollout != "hf":
            return None
        sequences = int(data.batch_size) * int(trainer.accumulate_grad_batches) * self.num_generations
        return sequences, self.conversation_tokens(data, env) - self.max_completion_length, self.max_completion_length

    @property
    def needs_reference(self) -> bool:
        """Whether the run builds a reference (``beta > 0``: the KL term needs its log-probs)."""
        return self.beta > 0

    @property
    def rolls_conversations(self) -> bool:
        """Groups of whole conversations per seed with ``env=<name>`` (docs/multiturn.md)."""
        return True

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        env = cfg.get("env")
        if env is not None and env.name != "none":
            unknown = [n for n in env.get("conversation_rewards") or [] if n not in self.rewards]
            if unknown:
                raise ConfigError(f"env.conversation_rewards names {unknown[0]!r}, not a reward of objective.rewards "
                                  f"({', '.join(self.rewards)})")
        if cfg.data.packing:
            raise ConfigError(f"objective={self.name} samples its completions: data.packing=true does not apply, "
                              "set data.packing=false")
        if self.rollout == "vllm":
            vllm = self.vllm if isinstance(self.vllm, GRPOVLLMConfig) else GRPOVLLMConfig(**self.vllm)
            vllm.check_run(cfg)
        if not cfg.data.get("prompts"):
            raise ConfigError(f"objective={self.name} samples completions for data.prompts, which "
                              f"data={cfg.data.get('name')} "
                              "leaves empty: add data.prompts=[{path: <prompts.jsonl>}] (RoleMRC test items, "
                              "{prompt: [...]} records or conversations)")


@dataclass
class GRPOObjectiveConfig(PromptsObjectiveConfig):
    """``objective=grpo``: online RL on prompts (data kind ``prompts``): ``num_generations``
    completions sampled per prompt, scored by ``rewards``, group-normalised advantages, TRL 1.16's
    clipped surrogate (:func:`rolemrc.objectives.grpo.grpo_loss`). Key names and defaults are TRL
    ``GRPOConfig``'s, except ``max_completion_length`` (TRL: 512). ``data.batch_size`` counts
    prompts: a micro-batch is ``batch_size x num_generations`` completions (TRL's
    ``per_device_train_batch_size`` counts completions)."""

    name: str = "grpo"
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (TRL's default) | cispo | sapo | luspo | vespo
    use_bias_correction_kl: bool = True  # the KL term x the importance ratio (TRL's default; DeepSeek-V3.2)
    delta: Optional[float] = None  # two-sided clipping: cap of the unclipped ratio (> 1 + epsilon)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: one ratio per sequence)
    sapo_temperature_pos: float = 1.0  # loss_type=sapo: the gate's temperature where the advantage is > 0
    sapo_temperature_neg: float = 1.05  # loss_type=sapo: ... where it is <= 0
    vespo_k_pos: float = 2.0  # loss_type=vespo: the Gamma weight's power, advantage >= 0
    vespo_lambda_pos: float = 3.0  # loss_type=vespo: its decay, advantage >= 0
    vespo_k_neg: float = 3.0  # loss_type=vespo: the power, advantage < 0
    vespo_lambda_neg: float = 2.0  # loss_type=vespo: the decay, advantage < 0
    top_entropy_quantile: float = 1.0  # rho: the policy term on the top-rho tokens by entropy only (1: all)
    off_policy_mask_threshold: Optional[float] = None  # drop negative-advantage sequences drifted past it (None: off)
    # the entropy bonus: loss - coef x the token mean of the entropies (0: off); adaptive (Skywork-OR1): the
    # coefficient applies only while the last step's entropy is <= entropy_target, and moves by delta each step
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    scale_rewards: str = "group"  # group | batch | none
    # sum_then_normalize (TRL's default) | normalize_then_sum (GDPO: each reward normalised in its group, summed,
    # then normalised over the step's completions; scale_rewards then plays no part)
    multi_objective_aggregation: str = "sum_then_normalize"
    # rollout=vllm: weight each token's (or sequence's) policy term by exp(trainer's - vLLM's log-probs) of the
    # sampled tokens, truncated or masked to [clip_min, clip_max] (TRL's names and defaults)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"  # token_truncate | token_mask | sequence_truncate | sequence_mask
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    vllm_importance_sampling_clip_min: Optional[float] = None

    def __post_init__(self) -> None:
        from rolemrc.objectives.grpo import (
            GRPO_LOSS_TYPES,
            IMPORTANCE_SAMPLING_LEVELS,
            MULTI_OBJECTIVE_AGGREGATIONS,
            SCALE_REWARDS,
            VLLM_IMPORTANCE_SAMPLING_MODES,
        )

        one_of("objective.loss_type", self.loss_type, GRPO_LOSS_TYPES)
        one_of("objective.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        one_of("objective.multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"objective.{key} must be > 0 (the sapo gate divides by it), got {getattr(self, key)}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ConfigError(f"objective.top_entropy_quantile must be in [0, 1] (1: every token), "
                              f"got {self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ConfigError(f"objective.off_policy_mask_threshold must be > 0 (e.g. 0.5) or null (off), "
                              f"got {self.off_policy_mask_threshold}")
        if self.use_adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            raise ConfigError(f"objective.entropy_coef_min ({self.entropy_coef_min}) must be <= objective."
                              f"entropy_coef_max ({self.entropy_coef_max}): the adaptive coefficient's bounds")
        if self.entropy_coef_delta < 0:
            raise ConfigError(f"objective.entropy_coef_delta must be >= 0 (the adaptive coefficient's step), "
                              f"got {self.entropy_coef_delta}")
        self._check_vllm_correction(VLLM_IMPORTANCE_SAMPLING_MODES)
        one_of("objective.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        self.check_shared_keys()
        if self.epsilon < 0:
            raise ConfigError(f"objective.epsilon must be >= 0, got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError(f"objective.epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.delta is not None and not self.delta > 0:
            raise ConfigError(f"objective.delta must be > 0 (TRL recommends > 1 + epsilon), got {self.delta}")
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations must be >= 2 (a group needs two completions to compare), "
                              f"got {self.num_generations}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ConfigError(f"objective.num_generations_eval must be >= 1 (completions sampled per validation "
                              f"prompt; null: num_generations), got {self.num_generations_eval}")

    def _check_vllm_correction(self, modes: tuple[str, ...]) -> None:
        """The vLLM importance-sampling keys (TRL's checks)."""
        one_of("objective.vllm_importance_sampling_mode", self.vllm_importance_sampling_mode, modes)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and not low < high:
            raise ConfigError(f"objective.vllm_importance_sampling_clip_min ({low}) must be less than "
                              f"objective.vllm_importance_sampling_clip_max ({high})")
        if not (self.rollout == "vllm" and self.vllm_importance_sampling_correction):
            return
        mode = self.vllm_importance_sampling_mode
        if mode.endswith("truncate") and low is None and high is None:
            raise ConfigError(f"objective.vllm_importance_sampling_mode={mode} clips the weights: set "
                              "objective.vllm_importance_sampling_clip_max (e.g. 3.0) or _clip_min")
        if self.loss_type == "vespo" and not mode.startswith("token"):
            raise ConfigError(f"objective.loss_type=vespo takes the vLLM correction's per-token weights: set "
                              f"objective.vllm_importance_sampling_mode=token_truncate or token_mask (got {mode}), "
                              "or objective.vllm_importance_sampling_correction=false")


@dataclass
class RLOOObjectiveConfig(PromptsObjectiveConfig):
    """``objective=rloo``: online RL on prompts as GRPO (the same rollout, rewards, reuse and keys
    for sampling), with REINFORCE Leave-One-Out advantages (each reward minus the mean of its
    prompt's other completions), the KL to the reference taken out of the reward per sequence, and
    a clipped surrogate with one importance ratio per sequence
    (:mod:`rolemrc.objectives.rloo`). Key names and defaults are TRL 1.16 ``RLOOConfig``'s, except
    ``max_completion_length`` (TRL: 512). ``data.batch_size`` counts prompts, as GRPO's."""

    name: str = "rloo"
    beta: float = 0.05  # KL coefficient, taken out of the reward (per sequence); 0 builds no reference
    epsilon_high: Optional[float] = None  # None: epsilon
    num_generations: int = 2  # completions per prompt (at least 2: the leave-one-out baseline)
    normalize_advantages: bool = False  # divide the advantages by their std over the step's completions
    reward_clip_range: Optional[list[float]] = None  # [min, max]: rewards clipped before the KL (None: off)

    def __post_init__(self) -> None:
        self.check_shared_keys()
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"objective.epsilon and objective.epsilon_high must be >= 0, "
                              f"got {self.epsilon}, {self.epsilon_high}")
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations must be >= 2 (the leave-one-out baseline needs another "
                              f"completion of the prompt), got {self.num_generations}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ConfigError(f"objective.num_generations_eval must be >= 1, got {self.num_generations_eval}")
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or not float(clip[0]) <= float(clip[1])):
            raise ConfigError(f"objective.reward_clip_range must be [min, max] with min <= max, or null, got {clip!r}")


def one_of(key: str, value: Any, options: tuple[str, ...]) -> None:
    """Refuse ``value`` of ``key`` unless it is one of ``options`` (a ConfigError naming the key)."""
    if value not in options:
        raise ConfigError(f"{key} must be one of {', '.join(options)}, got {value!r}")


@dataclass(frozen=True)
class Objective:
    """One entry of the objective registry: what ``objective=<name>`` means to the builder."""

    schema: type[ObjectiveConfig]  # its config keys (registered as ``<name>_schema``)
    module: str  # "package.module:Class", the LightningModule that trains it (imported when built)
    # The data it trains on: one of DATA_KINDS, read from ``data.<data>`` (and ``data.<data>_val``):
    # sft (conversations), pairs (preference pairs), prompts (prompts it samples completions for),
    # unpaired (prompt + completion + desirable label; data.pairs split when data.unpaired is empty).
    data: str
    reference: bool = False  # its module takes a reference (``objective.reference``: copy | adapter | precomputed)
    # The model it trains: lm (a causal LM) | score (the same architecture with a one-score
    # sequence-classification head: AutoModelForSequenceClassification, num_labels=1)
    head: str = "lm"

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS:
            raise ValueError(f"Objective.data must be one of {', '.join(DATA_KINDS)}, got {self.data!r}")
        if self.head not in MODEL_HEADS:
            raise ValueError(f"Objective.head must be one of {', '.join(MODEL_HEADS)}, got {self.head!r}")

    @property
    def pairs(self) -> bool:
        """Whether its rows are prompt + response, as preference pairs lay them out (``data.pairs``;
        ``unpaired`` too: pairs split, or single examples, which a pair's shape bounds)."""
        return self.data in ("pairs", "unpaired")


MODEL_HEADS: tuple[str, ...] = ("lm", "score")  # rolemrc.models.loading.load_model(head=...)
# What an objective can train on; each kind's sources are data.<kind> and data.<kind>_val.
DATA_KINDS: tuple[str, ...] = ("sft", "pairs", "prompts", "unpaired")


def source_group(kind: str, data: Any) -> str:
    """The ``data.<group>`` (and ``<group>_val``) a data kind reads: its own, except ``unpaired``
    when ``data.unpaired`` is empty: then ``pairs``, each pair split into two examples."""
    if kind == "unpaired" and not getattr(data, "unpaired", None):
        return "pairs"
    return kind


# The objective registry: a new objective is its schema, its module and one entry here
# (or ``OBJECTIVES.register(name, Objective(...))`` from a plug-in imported before the config is read).
OBJECTIVES: Registry[Objective] = Registry("objective.name", doc="training objectives (objective=<name>)")
for _name, _o in {
    "sft": Objective(SFTObjectiveConfig, "rolemrc.modules.sft:SFTModule", data="sft"),
    "dpo": Objective(DPOObjectiveConfig, "rolemrc.modules.dpo:DPOModule", data="pairs", reference=True),
    "simpo": Objective(SimPOObjectiveConfig, "rolemrc.modules.simpo:SimPOModule", data="pairs"),
    "orpo": Objective(ORPOObjectiveConfig, "rolemrc.modules.orpo:ORPOModule", data="pairs"),
    "kto": Objective(KTOObjectiveConfig, "rolemrc.modules.kto:KTOModule", data="unpaired", reference=True),
    "grpo": Objective(GRPOObjectiveConfig, "rolemrc.modules.grpo:GRPOModule", data="prompts", reference=True),
    "rloo": Objective(RLOOObjectiveConfig, "rolemrc.modules.rloo:RLOOModule", data="prompts", reference=True),
    "reward": Objective(RewardObjectiveConfig, "rolemrc.modules.reward:RewardModule", data="pairs", head="score"),
}.items():
    OBJECTIVES.register(_name, _o, doc=f"data: {_o.data}" + (", a reference model" if _o.reference else ""))


def model_head(cfg: Any) -> str:
    """The head of the model a training config trains (its objective's registry entry: ``lm`` or
    ``score``); ``lm`` for a config without an objective."""
    objective = cfg.get("objective") if hasattr(cfg, "get") else getattr(cfg, "objective", None)
    entry = OBJECTIVES.get(objective.name, None) if objective is not None else None
    return entry.head if entry is not None else "lm"


OBJECTIVE_SCHEMAS: dict[str, type[ObjectiveConfig]] = {name: o.schema for name, o in OBJECTIVES.items()}
