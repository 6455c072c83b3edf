"""GRPO: online RL on prompts (``objective=grpo``, data kind ``prompts``), as TRL 1.16's
GRPOTrainer computes it.

Per optimizer step (:meth:`GRPOModule.step_loss`, the one function training and the memory
simulation run):

1. **rollout**, once per step at its first micro-batch (:meth:`GRPOModule._step_rollouts`; the
   step sampler's ``step_ahead`` hands that micro-batch the ``B x accumulate_grad_batches`` prompts
   of the step's micro-batches on this rank, as TRL generates its generation batch of
   ``steps_per_generation`` micro-batches): each prompt repeated ``num_generations`` (``G``)
   times, completions sampled with transformers ``generate`` from the policy's current weights
   (eval mode, no gradient, KV cache; ``temperature`` / ``top_p`` / ``top_k``; stops at eos or the
   chat's end-of-turn token, at most ``max_completion_length`` tokens), from a sampling RNG of its
   own (:class:`~rolemrc.rollout.sampler.SamplingRNG`: seeded from the run's seed and rank, saved in every checkpoint, so a
   resumed run samples what the uninterrupted one samples). Completions are decoded without
   special tokens and scored by the :class:`~rolemrc.rewards.RewardSet` built once from
   ``objective.rewards`` (judge caches under ``<run_dir>/judge_cache``); the rewards become
   group-normalised advantages (:func:`~rolemrc.objectives.grpo.group_advantages`). The step's
   rollouts are buffered, one part per micro-batch;
2. **loss**, per micro-batch from the buffer: per-token log-probs of the completion tokens under
   the policy (with gradient) and, when ``beta > 0``, under the reference (DPO's ``copy`` or
   ``adapter``, no gradient), at the logits divided by ``temperature`` as TRL scores them, into
   :func:`~rolemrc.objectives.grpo.grpo_loss` with the step's global normalisers (exact however
   the step is cut into micro-batches and ranks): ``grpo`` and ``dr_grpo`` divide by the step's
   completions (``step_prompts x G``), ``dapo`` by the step's completion tokens (summed over the
   step's micro-batches at the rollout, then over ranks: TRL's ``num_items_in_batch``); ``bnpo``
   the micro-batch's own token mean (TRL's definition).

With ``num_iterations=1`` old log-probs are not needed: the ratio is 1 and the gradient the plain
policy gradient, as TRL's. With ``num_iterations > 1`` the step sampler reads each step's
micro-batches that many times in a row (``step_use``); the rollouts are kept
(:class:`RolloutReuse`, in the run state), the first use records its per-token log-probs and the
later uses train on the same rollouts with those as old log-probs (clipped ratio).
``scale_rewards=batch`` divides by the std over the step's completions on every rank (TRL's
generation batch, gathered from every process).

Logged per optimizer step under TRL's names and with TRL's meanings (``train/`` prefixed), over
every rank: ``reward``, ``reward_std``, ``rewards/<name>/mean|std``, ``frac_reward_zero_std``,
``num_tokens`` (prompt + completion tokens of the run's rollouts so far), ``completions/mean_length|
min_length|max_length|clipped_ratio``, ``completions/mean_terminated_length|min_terminated_length|
max_terminated_length``, and per micro-batch then averaged over the step's micro-batches (as TRL's log
does) ``entropy``, ``clip_ratio/*`` (clipped loss types; ``cispo_clip_ratio`` for cispo,
``vespo/phi_seq_mean`` for vespo, none for sapo), ``kl`` (``beta > 0``); plus ``completion_tokens_per_s`` (sampled
tokens per second of ``generate``). Validation (``data.prompts_val`` or the held-out
``val_fraction``) samples as training does (``num_generations_eval`` completions per prompt, default
``num_generations``, the same sampling settings and rewards, a fixed seed per batch), so ``val/reward``
means what ``train/reward`` means; also ``val/reward_std``, ``val/rewards/<name>/mean`` and
``val/completions/mean_length|clipped_ratio``. ``summary_notes`` says what each is the mean of.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.config import TrainStep, objective_settings
from rolemrc.env import make_env
from rolemrc.env.rollout import ENV_ENDS
from rolemrc.env.sampler import ConversationSampler
from rolemrc.models.forward import policy_hidden
from rolemrc.models.loading import decoder_and_head, eval_mode
from rolemrc.models.precision import PrecisionPolicy
from rolemrc.modules.base import PolicyModule, TokensSeen
from rolemrc.modules.reference import Reference
from rolemrc.objectives.grpo import (
    GroupAdvantages,
    adaptive_entropy_coef,
    applied_entropy_coef,
    entropy_term,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    nanstd,
    normalized_sum_advantages,
    vllm_importance_weights,
    vllm_sampling_stats,
)
from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.rewards import RewardSet, build_rewards, disagreement_rate
from rolemrc.rewards.combine import RewardScores
from rolemrc.rewards.turns import DialogueScores, score_dialogues
from rolemrc.rollout import HFEngine, RolloutError, Sampling, SamplingRNG, TurnSampler, make_engine
from rolemrc.rollout.hf import pad_id_of, stop_token_ids
from rolemrc.rollout.sampler import completion_mask

log = logging.getLogger(__name__)

REUSE_KEY = "grpo_rollouts"  # top-level checkpoint entry: a generation batch still to be reused


class RolloutReuse:
    """``num_iterations > 1``: the step's rollouts (one part per micro-batch, with the old
    log-probs recorded at their first use) kept for the following ``num_iterations - 1`` steps,
    and how many uses they had; in every checkpoint taken while uses remain (a
    :func:`run_state_parts` part, each rank's its own), so a run resumed mid-reuse trains on the same rollouts."""

    per_rank = True  # each rank keeps its own prompts' rollouts

    def __init__(self, num_iterations: int) -> None:
        self.num_iterations = num_iterations
        self.parts: list[dict[str, Any]] | None = None
        self.uses = 0
        self.metrics: dict[str, float] = {}  # their rollout metrics, logged again at each reuse

    def state_dict(self) -> dict[str, Any]:
        if self.parts is None or self.uses >= self.num_iterations:
            return {}
        parts = [{k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in p.items()
                  if k != "rollout_stats"} for p in self.parts]
        return {REUSE_KEY: {"parts": parts, "uses": self.uses, "metrics": dict(self.metrics)}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(REUSE_KEY)
        self.parts, self.uses = (state["parts"], int(state["uses"])) if state else (None, 0)
        self.metrics = dict(state.get("metrics", {})) if state else {}


TOKENS_KEY = "grpo_num_tokens"  # top-level checkpoint entry: TRL's num_tokens so far
ENTROPY_KEY = "grpo_entropy_control"  # top-level checkpoint entry: the entropy bonus's coefficient


class EntropyControl:
    """The entropy bonus's coefficient (``entropy_coef``) and, for adaptive control, the token-mean
    entropy of the last optimizer step (``inf`` before the first: no bonus yet, as TRL); in every
    checkpoint (a :func:`run_state_parts` part), so a resumed run applies what the uninterrupted one does."""

    per_rank = False  # pooled over every rank: one state

    def __init__(self, coef: float) -> None:
        self.coef, self.last_entropy = float(coef), math.inf

    def state_dict(self) -> dict[str, Any]:
        return {ENTROPY_KEY: {"entropy_coef": self.coef, "last_entropy": self.last_entropy}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(ENTROPY_KEY)
        if state:
            self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])


def _extra_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A reward set's metrics besides the means and stds (judge ``missing`` counts, disagreement rates)."""
    return {k: v for k, v in metrics.items() if k.startswith("rewards/") and not k.endswith(("/mean", "/std"))}


def conversation_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The step's conversations (every rank's): ``turns/mean``, ``turns/max``, ``ends/<reason>`` (how
    many ended so: the rollout's reasons always, the environment's when seen), ``noncanonical_replies``
    (replies sampled otherwise than the template tokenises their text) and ``rewards/<name>/turn_<k>``
    (the mean of each per-turn reward over the replies at turn ``k``)."""
    turns = torch.cat([s["turns"] for s in stats]).double()
    out = {"turns/mean": turns.mean().item(), "turns/max": turns.max().item(),
           "noncanonical_replies": float(sum(s["noncanonical"] for s in stats))}
    ends = dict.fromkeys(ENV_ENDS, 0)
    for s in stats:
        for reason in s["ends"]:
            ends[reason] = ends.get(reason, 0) + 1
    out.update({f"ends/{reason}": float(n) for reason, n in sorted(ends.items())})
    values = torch.cat([s["turn_values"] for s in stats])
    index = torch.cat([s["turn_index"] for s in stats])
    for k, name in enumerate(stats[0]["names"]):
        column = values[:, k]
        if bool(torch.isnan(column).all()):  # scored per conversation (or never applied): no by-turn figure
            continue
        for turn in sorted(set(index.tolist())):
            out[f"rewards/{name}/turn_{turn}"] = torch.nanmean(column[index == turn]).item()
    return out


class GRPOModule(PolicyModule):
    """``objective``: the grpo node (:class:`~rolemrc.config.GRPOObjectiveConfig`); ``reference``:
    DPO's copy / adapter (:func:`rolemrc.modules.reference.make_reference`), ``None`` when
    ``beta == 0``; ``chat``: the tokenizer and chat format (default: the trainer's datamodule's);
    ``rewards``: a ready :class:`RewardSet` (default: built from ``objective.rewards`` at first use);
    ``env``: the ``env:`` settings (:class:`~rolemrc.config.EnvConfig`, ``max_tokens`` resolved) for
    multi-turn rollouts (the conversation rollout kind), None for one completion per prompt."""

    # the step's passes without gradient besides the rollout: the memory simulation runs each as a module call
    no_grad_passes = ("reference_token_logps",)

    def __init__(self, model: nn.Module, objective: Any, optim: Any, policy: PrecisionPolicy,
                 reference: Reference | None = None, sharding: Any = None, packed_attention: str = "auto",
                 chat: Any = None, rewards: RewardSet | None = None, env: Any = None) -> None:
        super().__init__(model, objective, optim, policy, sharding, packed_attention)
        if objective.beta > 0 and reference is None:
            raise ValueError(f"objective.beta={objective.beta} needs a reference (objective.reference=copy|adapter)")
        self.reference = reference if objective.beta > 0 else None
        self._check_loss_options(objective)
        self.entropy_control = self._entropy_control(objective)
        self._chat = chat
        self._rewards = rewards
        self._own_rewards = rewards is None
        self.env_settings = env if env is not None and env.name != "none" else None
        self.sampling_rng = SamplingRNG()  # the rollout's random stream (every rollout kind draws from it)
        self._sampler: Any = None  # the rollout kind: one turn (TurnSampler) or conversations (env), see sampler
        self._step_stats: list[dict[str, Any]] = []  # the step's rollout statistics (one per step and rank)
        self._loss_stats: list[dict[str, Any]] = []  # the step's micro-batches' loss metrics and token counts
        self._rollout_buffer: list[dict[str, Any]] = []  # the step's rollouts not trained yet, one per micro-batch
        self.reuse = RolloutReuse(int(objective.num_iterations))
        self.tokens_seen = TokensSeen(TOKENS_KEY)
        self._val_names: list[str] = []
        self.summary_notes: dict[str, str] = {}  # what the run summary's reward figures are means of
        self._engine: Any = None  # objective.rollout=vllm: rolemrc.rollout's engine, built at first use

    def _check_loss_options(self, objective: Any) -> None:
        """Warn of loss options meant with others (TRL warns of the same settings); RLOO has none."""
        level, loss_type = objective.importance_sampling_level, objective.loss_type
        if loss_type == "luspo" and level != "sequence":
            log.warning("objective.loss_type=luspo is meant with objective.importance_sampling_level=sequence (LUSPO)")
        if loss_type == "vespo" and level != "token":
            log.warning("objective.loss_type=vespo computes its sequence weights itself: "
                        "objective.importance_sampling_level=token is meant")
        if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            log.warning("objective.importance_sampling_level=sequence with loss_type=%s sums per-token terms, weighting "
                        "each sequence by its length; GSPO's setup is objective.loss_type=grpo", loss_type)

    def _entropy_control(self, objective: Any) -> EntropyControl | None:
        """The entropy bonus's state (``entropy_coef != 0`` or ``use_adaptive_entropy``), else None; RLOO has none."""
        if objective.entropy_coef == 0.0 and not objective.use_adaptive_entropy:
            return None
        return EntropyControl(objective.entropy_coef)

    # ---- parts ------------------------------------------------------------------------------
    def run_state_parts(self) -> tuple[Any, ...]:
        """The sampling RNG travels with every checkpoint (a resumed run samples the same rollouts),
        and so do rollouts still to be reused (``num_iterations > 1``), the tokens seen (``num_tokens``) and a
        synced reference (``sync_ref_model``)."""
        return ((self.sampling_rng, self.reuse, self.tokens_seen) + ((self.reference,) if self.reference else ())
                + ((self.entropy_control,) if self.entropy_control is not None else ()))

    @property
    def chat(self) -> Any:
        if self._chat is None:
            self._chat = self.trainer.datamodule.chat
        return self._chat

    def _run_dir(self, name: str) -> Path | None:
        """``<run_dir>/<name>`` (a cache folder of the run), None without a trainer."""
        root = getattr(self._trainer, "default_root_dir", None) if self._trainer is not None else None
        return Path(root) / name if root else None

    @property
    def rewards(self) -> RewardSet:
        if self._rewards is None:
            self._rewards = build_rewards(dict(self.objective.rewards), cache_dir=self._run_dir("judge_cache"),
                                          prefix="objective.rewards")
        return self._rewards

    @property
    def sampler(self) -> Any:
        """The rollout kind (built at first use): :class:`~rolemrc.rollout.TurnSampler` (one completion per
        prompt), or with ``env`` :class:`~rolemrc.env.sampler.ConversationSampler` (whole conversations);
        both ``sample_hf(generate, batch, seed)`` and ``sample_engine(engine, model, step, batch, seed,
        pad_id)``, drawing from :attr:`sampling_rng`."""
        if self._sampler is None:
            n, env = int(self.objective.num_generations), self.env_settings
            self._sampler = TurnSampler(n) if env is None else ConversationSampler(
                n, make_env(env, cache_dir=self._run_dir("env_cache")), self.chat, stop_ids=self.stop_ids, max_turns=int(env.max_turns),
                max_tokens=env.max_tokens)
            self._sampler.rng = self.sampling_rng
        return self._sampler

    def teardown(self, stage: str) -> None:
        if isinstance(self._sampler, ConversationSampler):
            self._sampler.env.close()
            self._sampler = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._rewards is not None and self._own_rewards:  # built here: closed, and built again if used again
            self._rewards.close()
            self._rewards = None

    # ---- rollout ----------------------------------------------------------------------------
    def _sampling_seed(self) -> int:
        rank = self.trainer.global_rank if self._trainer is not None else 0
        return (torch.initial_seed() + 1_000_003 * (rank + 1)) % (2**63)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
        """New token ids ``[N, C]`` after each (left-padded) prompt row, padded after the stop token
        (``rolemrc.rollout.hf``: sampled with the objective's settings, or greedy)."""
        # FSDP2: every rank's forward gathers the shards with the others', so every rank runs the same
        # number of decoding steps (until the last rank's completions end: transformers' synced_gpus)
        synced = self.device_mesh is not None and self._trainer is not None and self.trainer.world_size > 1
        engine = HFEngine(stop_ids=self.stop_ids, pad_id=pad_id_of(self.chat.tokenizer),
                          sampling=Sampling.of(self.objective), synced_gpus=synced)
        engine.sync(self.model, 0)
        return engine.generate_ids(prompt_ids, prompt_mask, None if sample else engine.sampling.greedy())

    @property
    def stop_ids(self) -> list[int]:
        return stop_token_ids(self.chat.tokenizer, self.chat.eot)

    def completions_from(self, new_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """``(completion_ids [N, C], completion_mask [N, C], is_truncated [N])`` and the decoded texts:
        each completion up to and including its first stop token (TRL's mask), truncated when it has none."""
        mask, truncated = completion_mask(new_ids, self.stop_ids)
        texts = self.chat.tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(new_ids, mask)],
                                                 skip_special_tokens=True)
        return mask, truncated, texts

    def rollout(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Sample, score and lay out the batch's completions (see the module docstring); adds to
        ``batch`` (in place, so callbacks count the sequences trained): ``input_ids``,
        ``attention_mask``, ``labels`` (the completion tokens; -100 elsewhere), ``position_ids``,
        ``advantages`` ``[N]`` and the statistics logged at the step's end. Returns ``batch``."""
        o = self.objective
        if o.rollout != "hf":  # another engine of rolemrc.rollout.ENGINES (vLLM: objective.vllm, server or colocated)
            sampled, seconds = self.sampler.sample_engine(
                self.rollout_engine, self.model, int(self.global_step) if self._trainer is not None else 0,
                batch, self._sampling_seed(), pad_id_of(self.chat.tokenizer))
        else:  # the policy samples (self.generate)
            sampled, seconds = self.sampler.sample_hf(self.generate, batch, self._sampling_seed())
        scored = self.score(batch, sampled, seconds)
        logprobs = self.rollout_engine.sampled_logprobs if o.rollout != "hf" else None
        if logprobs is not None and self.env_settings is None:  # one turn: vLLM's log-probs of the sampled tokens
            scored["sampling_logps"] = self._sampling_logps(logprobs, batch["prompt_ids"].shape[1],
                                                            scored["input_ids"].shape[1])
        return scored

    def _sampling_logps(self, rows: list[list[float]], prompt_width: int, width: int) -> torch.Tensor:
        """vLLM's log-probs of the sampled tokens laid out as :meth:`token_logps` lays out the
        trainer's (``[N, T]``, the value at the position that predicts the token; NaN elsewhere)."""
        out = torch.full((len(rows), width), math.nan, dtype=torch.float32)
        for i, row in enumerate(rows):
            values = torch.tensor(row[:width - prompt_width], dtype=torch.float32)
            out[i, prompt_width - 1:prompt_width - 1 + values.numel()] = values
        return out.to(self.device)

    def _vllm_correction(self) -> bool:
        """Whether the loss weights vLLM's rollouts by TRL's importance-sampling correction (RLOO: never,
        TRL's RLOOConfig has none)."""
        return self.objective.rollout == "vllm" and bool(self.objective.vllm_importance_sampling_correction)

    @property
    def rollout_engine(self) -> Any:
        """The engine ``objective.rollout`` names (built at first use; ``rolemrc.rollout.make_engine``)."""
        if self._engine is None:
            trainer = self._trainer
            multi = trainer is not None and trainer.world_size > 1
            data = getattr(getattr(trainer, "datamodule", None), "cfg", None) if trainer is not None else None
            prompt_len = int(getattr(data, "max_prompt_length", 0) or 0)
            base = getattr(self.model, "get_base_model", lambda: self.model)()
            longest = prompt_len + int(self.objective.max_completion_length)
            if self.env_settings is not None:  # a turn continues the conversation so far (< env.max_tokens)
                longest = max(longest, int(self.env_settings.max_tokens or 0) + int(self.objective.max_completion_length))
            self._engine = make_engine(
                self.objective, stop_ids=self.stop_ids, vocab=int(base.config.vocab_size), rank=self.global_rank,
                broadcast=(lambda obj: trainer.strategy.broadcast(obj, src=0)) if multi else (lambda obj: obj),
                run_dir=getattr(trainer, "default_root_dir", None) if trainer is not None else None,
                model_path=str(base.config._name_or_path), tokenizer_path=self.chat.tokenizer.name_or_path,
                max_model_len=longest, seed=torch.initial_seed(),
                world_size=trainer.world_size if trainer is not None else 1,
                require_logprobs=self._vllm_correction() and self.env_settings is None)
        return self._engine

    def score(self, batch: dict[str, Any], new_ids: Any, seconds: float = float("nan")) -> dict[str, Any]:
        """The rest of :meth:`rollout` from the sampled ``new_ids`` ``[B x G, C]`` (with ``env``: the
        conversations, :meth:`score_conversations`): rewards, advantages, layout."""
        if self.env_settings is not None:
            return self.score_conversations(batch, new_ids, seconds)
        o = self.objective
        g = o.num_generations
        _, _, texts = self.completions_from(new_ids)
        prompts = [p for p in batch["prompts"] for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch["columns"].items()}
        scores = self.rewards(prompts, texts, columns)
        # float64: identical rewards give a std of exactly 0 (float32 sums leave ~1e-8, which
        # frac_reward_zero_std would not count as zero); the advantages are cast to float32 after
        adv = self._advantages(scores.rewards.to(new_ids.device), scores.per_reward.to(new_ids.device), scores.names)
        laid = self.sampler.lay_out(new_ids, batch, stop_ids=self.stop_ids, mask_cut=o.mask_truncated_completions)
        batch.update({k: laid[k] for k in ("input_ids", "attention_mask", "labels", "position_ids")})
        batch.update({
            "advantages": adv.advantages.float(),
            "rollout_stats": {
                "names": scores.names, "per_reward": scores.per_reward.cpu(), "rewards": scores.rewards.cpu(),
                "is_std_zero": adv.is_std_zero.cpu(), "lengths": laid["model_tokens"].cpu(),
                "truncated": laid["cut"].cpu(), "prompt_tokens": int(batch["prompt_mask"].sum()) * g,
                "extra": _extra_metrics(scores.metrics),
                "seconds": seconds, "texts": texts,
            },
        })
        return batch

    def _dialogue_scores(self, convs: list[Any], columns: dict[str, list[Any]]) -> DialogueScores:
        """:func:`~rolemrc.rewards.turns.score_dialogues` of ``convs`` with the ``env`` settings' aggregation.
        A conversation whose user failed (an API fault: ``Conversation.failed``) is not scored (NaN: advantage
        0, and :func:`~rolemrc.env.sampler.lay_out` trains none of it); every one failing stops the run."""
        env = self.env_settings
        keep = [i for i, c in enumerate(convs) if not c.failed]
        if not keep:
            errors = sorted({c.error for c in convs if c.error})[:2]
            raise RolloutError(f"the environment's user failed in all {len(convs)} conversations of the step "
                               f"({convs[0].reason}{': ' + '; '.join(errors) if errors else ''}): nothing to score")
        got = score_dialogues(self.rewards, [convs[i].messages for i in keep], [convs[i].turns for i in keep],
                              {k: [v[i] for i in keep] for k, v in columns.items()}, how=env.turn_rewards,
                              whole=list(env.conversation_rewards))
        if len(keep) == len(convs):
            return got
        scores, rows = got.scores, torch.tensor(keep)
        per = torch.full((len(convs), len(scores.names)), float("nan"), dtype=torch.float64)
        total = torch.full((len(convs),), float("nan"), dtype=torch.float64)
        per[rows], total[rows] = scores.per_reward, scores.rewards
        return DialogueScores(RewardScores(scores.names, per, total, scores.metrics), got.turn_values, got.turn_index)

    def score_conversations(self, batch: dict[str, Any], convs: list[Any], seconds: float = float("nan")) -> dict[
            str, Any]:
        """:meth:`score` of ``B x G`` conversations (each seed's next to each other): each scored as
        :mod:`rolemrc.rewards.turns` says (per turn, aggregated, or over the whole conversation), the
        advantages per conversation, the layout of :func:`~rolemrc.env.sampler.lay_out` (the completion:
        everything after the opening prompt, attended to; the loss on the role-player's tokens only)."""
        o = self.objective
        g, device = o.num_generations, batch["prompt_ids"].device
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch["columns"].items()}
        dialogue = self._dialogue_scores(convs, columns)
        scores = dialogue.scores
        adv = self._advantages(scores.rewards.to(device), scores.per_reward.to(device), scores.names)
        laid = self.sampler.lay_out(convs, batch, mask_cut=o.mask_truncated_completions)
        batch.update({k: laid[k].to(device) for k in ("input_ids", "attention_mask", "labels", "position_ids")})
        batch.update({
            "advantages": adv.advantages.float(),
            "rollout_stats": {
                "names": scores.names, "per_reward": scores.per_reward.cpu(), "rewards": scores.rewards.cpu(),
                "is_std_zero": adv.is_std_zero.cpu(), "lengths": laid["model_tokens"], "truncated": laid["cut"],
                "prompt_tokens": int(batch["prompt_mask"].sum()) * g, "extra": _extra_metrics(scores.metrics),
                "seconds": seconds, "texts": [c.reply_texts() for c in convs],
                "turns": torch.tensor([c.turns for c in convs]), "ends": [c.reason for c in convs],
                "noncanonical": sum(c.noncanonical for c in convs),
                "turn_values": dialogue.turn_values, "turn_index": dialogue.turn_index,
            },
        })
        return batch

    def _advantages(self, rewards: torch.Tensor, per_reward: torch.Tensor | None = None,
                    names: list[str] | None = None) -> GroupAdvantages:
        """:func:`group_advantages` of this rank's rewards ``[N]`` (whole groups), or with
        ``multi_objective_aggregation=normalize_then_sum`` :func:`normalized_sum_advantages` of its
        per-reward scores ``[N, K]`` (``names``: their rewards, for the weights). ``scale_rewards=batch``
        and ``normalize_then_sum`` normalise over the step's completions on EVERY rank, as TRL, which
        gathers its generation batch's rewards from all processes, normalises them and keeps its
        slice (group means and stds need no other rank: a group is never split across ranks here)."""
        o = self.objective
        world = self.trainer.world_size if self._trainer is not None else 1
        by_reward = o.multi_objective_aggregation == "normalize_then_sum"
        if by_reward:
            if per_reward is None or names is None:
                raise ValueError("multi_objective_aggregation=normalize_then_sum needs each reward's scores")
            weights = torch.tensor([self.rewards.weights[name] for name in names], dtype=torch.float64)
            values = per_reward
        else:
            values = rewards

        def advantages(x: torch.Tensor) -> GroupAdvantages:
            if by_reward:
                return normalized_sum_advantages(x, weights.to(x.device), o.num_generations)
            return group_advantages(x, o.num_generations, o.scale_rewards)

        if world == 1 or (str(o.scale_rewards) != "batch" and not by_reward):
            return advantages(values)
        import torch.distributed as dist

        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, values.cpu())
        start = sum(len(p) for p in parts[:self.trainer.global_rank])
        adv = advantages(torch.cat(parts).to(values.device))
        mine = slice(start, start + len(values))
        return GroupAdvantages(adv.advantages[mine], adv.std[mine], adv.is_std_zero[mine])

    # ---- the memory simulation (python -m rolemrc.memory ... --simulate) ----------------------
    memory_note = ("objective=grpo: simulated are the rollout (transformers generate of the step's data.batch_size x "
                   "accumulate_grad_batches x num_generations completions at once, every one max_completion_length "
                   "tokens after a max_prompt_length prompt: its prefill and its last decoding step, KV cache "
                   "included; with a multi-turn env, the last turn's generate after the longest conversation "
                   "before it: env.max_turns replies, env.user.max_tokens per user turn, capped at env.max_tokens) "
                   "and the loss step on data.batch_size x num_generations of them (policy and, "
                   "beta > 0, reference passes; the step's other rollouts, and with num_iterations > 1 their old "
                   "log-probs, held); not simulated: generate under FSDP2 with synced_gpus (the same memory, "
                   "plus one flag per step), the reward models and judges (not on the device), "
                   "objective.rollout engines other than hf")

    @staticmethod
    def memory_rollout(step: TrainStep, batch_size: int) -> dict[str, Any] | None:
        """The step's rollout for the memory simulation (:func:`rolemrc.sizing.simulate._rollout_phase`):
        the prompts of every micro-batch of the step at once (``_step_rollouts``), each
        ``num_generations`` times, as :meth:`generate` samples them; None where another engine
        samples (``objective.rollout=vllm``: not on the trainer's memory as simulated)."""
        o = step.objective
        if o.get("rollout", "hf") != "hf":
            return None
        n = batch_size * int(step.trainer.accumulate_grad_batches) * int(o.num_generations)
        # with a multi-turn env: the last reply's generate, after the longest conversation before it
        before = objective_settings(o).conversation_tokens(step.data, step.env) - int(o.max_completion_length)
        return {"sequences": n, "prompt": before, "completion": int(o.max_completion_length), "sampling": Sampling.of(o)}

    @staticmethod
    def memory_resident(step: TrainStep, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the step keeps on the device beside the micro-batch it trains: the rollouts of its
        other micro-batches (views of the step's rolled tensors keep all of them: ``input_ids``,
        ``attention_mask``, ``labels``, ``position_ids``, ``advantages``) and, with
        ``num_iterations > 1``, the old log-probs of every micro-batch (``[rows, T]`` float32)."""
        n, width = batch["input_ids"].shape
        others = n * (int(step.trainer.accumulate_grad_batches) - 1)
        kept = {k: torch.empty((others, width), dtype=torch.long)
                for k in ("input_ids", "attention_mask", "labels", "position_ids")}
        kept["advantages"] = torch.empty(others)
        if int(step.objective.num_iterations) > 1:
            kept["old_logps"] = torch.empty((n * int(step.trainer.accumulate_grad_batches), width))
        return kept

    @staticmethod
    def memory_batch(step: TrainStep, batch_size: int, vocab: int, length: int | None = None) -> dict[str, torch.Tensor]:
        """A rollout batch of the longest shape the config allows (or of ``length`` tokens), as
        :meth:`score` lays it out: ``batch_size x num_generations`` rows, the completion labelled;
        with a multi-turn ``env``, whole conversations (``conversation_tokens``): ``env.max_turns``
        replies labelled, a user turn of ``env.user.max_tokens`` between each two not."""
        g = int(step.objective.num_generations)
        prompt, reply = int(step.data.max_prompt_length), int(step.objective.max_completion_length)
        env = step.env
        turns = 1 if env is None or env.name == "none" else int(env.max_turns)
        width = objective_settings(step.objective).conversation_tokens(step.data, env)
        user = int(env.user.max_tokens) if turns > 1 else 0
        if length is not None:
            prompt, reply, turns, width = max(1, length // 2), max(1, length - length // 2), 1, length
        n, tok = batch_size * g, min(5, vocab - 1)
        ids = torch.full((n, width), tok, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        start = min(prompt, width - 1)
        for _ in range(turns):  # the replies trained, the user turns between them context
            labels[:, start:start + reply] = tok
            start += reply + user
        return {"input_ids": ids, "labels": labels, "advantages": torch.ones(n),
                "index": torch.arange(batch_size), "step_prompts": torch.tensor(float(batch_size), dtype=torch.float64)}

    def memory_mask_counts(self, batch: dict[str, torch.Tensor]) -> dict[tuple[int, ...], int]:
        """The head's mask over one row per position (:meth:`token_logps`), and grpo_loss's
        per-sequence mask (sequences with a token: every simulated row has some)."""
        labels = self.trained_labels(batch)
        n, width = labels.shape
        return {(n * width, 1): int((labels != IGNORE_INDEX).sum()), (n,): n}

    # ---- log-probs --------------------------------------------------------------------------
    def token_logps(self, model: nn.Module, batch: dict[str, Any],
                    entropy: bool = False, entropy_grad: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per-position log-probs ``[N, T]`` of the next token where it is a trained completion token
        (0 elsewhere), at the logits divided by ``temperature`` (TRL scores sampled tokens so), that
        mask ``[N, T]`` and, ``entropy``, the entropy ``[N, T]`` of that next-token distribution (TRL's
        ``entropy``; with gradient only when ``entropy_grad``: the entropy bonus), else ``None``. The head is called as a module (FSDP2 gathers
        it) on one row per position, so its per-row sums are the per-token values."""
        decoder, head = decoder_and_head(model)
        head.chunk_size = self.objective.logprob_chunk_size
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        hidden = policy_hidden(model, decoder, inputs, False, self.packed_attention)
        t = float(self.objective.temperature)
        if t != 1.0:
            if getattr(head, "bias", None) is not None:
                raise NotImplementedError("objective.temperature != 1 with an lm_head that has a bias")
            hidden = hidden / t
        labels = self.trained_labels(batch)
        n, width = labels.shape
        out = head(hidden.reshape(n * width, 1, hidden.shape[-1]), labels=labels.reshape(n * width, 1),
                   **({"entropy": True, "entropy_grad": entropy_grad} if entropy else {}))
        ent = out.entropy.view(n, width) if entropy else None
        return out.logps.view(n, width), labels != IGNORE_INDEX, ent

    def reference_token_logps(self, batch: dict[str, Any], stage: str = "train") -> torch.Tensor:
        """The reference's per-position log-probs ``[N, T]`` (no gradient)."""
        assert self.reference is not None
        with torch.no_grad():
            if self.reference.mode == "adapter":
                with eval_mode(self.model), self.model.disable_adapter():
                    return self.token_logps(self.model, batch)[0]
            return self.token_logps(self.reference.models()[0], batch)[0]

    # ---- the step ---------------------------------------------------------------------------
    def _pooled_entropies(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``: this micro-batch's completion-token entropies on every rank, flat,
        NaN elsewhere (TRL gathers them from every process for the quantile)."""
        local = torch.where(mask, entropy.float(), torch.full_like(entropy, float("nan"), dtype=torch.float32))
        local = local.reshape(-1)
        if self._trainer is None or self.trainer.world_size == 1:
            return local
        sizes = self.all_gather(torch.tensor([local.numel()], device=local.device))
        padded = torch.full((int(sizes.max()),), float("nan"), device=local.device)
        padded[:local.numel()] = local
        return self.all_gather(padded).reshape(-1)

    def _num_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        """dapo's normaliser for a micro-batch handed in with its rollouts (the memory simulation,
        tests): its completion tokens summed over ranks, x the accumulation."""
        total = mask.sum().double()
        trainer = self._trainer
        if trainer is None:
            return total
        if trainer.world_size > 1:
            total = trainer.strategy.reduce(total, reduce_op="sum")
        return total * trainer.accumulate_grad_batches

    def _step_rollouts(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The rollouts of the whole optimizer step on this rank, one dict per micro-batch: the
        step's prompts (``step_batch``, the first micro-batch of a step carries them; a batch
        without them is its own step) sampled and scored at once, their completion tokens summed
        over ranks (``step_completion_tokens``: dapo's normaliser)."""
        step = batch.get("step_batch")
        sizes = list(batch.get("step_sizes") or [])
        if step is None:
            step = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "index", "prompts", "columns")}
            sizes = [int(batch["index"].shape[0])]
        rolled = self.rollout(dict(step))
        total = (rolled["labels"] != IGNORE_INDEX).sum().double()
        if self._trainer is not None and self.trainer.world_size > 1:
            total = self.trainer.strategy.reduce(total, reduce_op="sum")
        g, parts, start = self.objective.num_generations, [], 0
        for size in sizes:
            rows = slice(start * g, (start + size) * g)
            attention = rolled["attention_mask"][rows]
            left = int(attention.any(dim=0).int().argmax())  # left padding no row of this part needs
            part = {k: rolled[k][rows, left:] for k in ("input_ids", "attention_mask", "labels", "position_ids",
                                                          "sampling_logps") if k in rolled}
            part.update(advantages=rolled["advantages"][rows], index=step["index"][start:start + size],
                        step_completion_tokens=total)
            parts.append(part)
            start += size
        parts[0]["rollout_stats"] = rolled["rollout_stats"]  # the step's: logged once
        return parts

    def _take_rollouts(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Lay this micro-batch's share of the step's rollouts into ``batch`` (in place, so callbacks
        count the sequences trained), generating the step's at its first micro-batch, or, on a
        reuse (``step_use > 0``, ``num_iterations > 1``), taking the kept ones with their old
        log-probs. Returns the part (its first use records its old log-probs there)."""
        if "step_batch" in batch or not self._rollout_buffer:
            use, reuse = int(batch.get("step_use", 0)), self.reuse
            if use > 0 and reuse.parts is not None and reuse.uses == use:
                device = batch["index"].device
                self._rollout_buffer = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()
                                         if k != "rollout_stats"} for p in reuse.parts]  # logged at the first use
            else:
                if use > 0:  # not expected: a checkpoint holds the rollouts it is in the middle of reusing
                    log.warning("GRPO: use %d of a rollout batch that is not kept (%s): sampling a new one",
                                use, "none kept" if reuse.parts is None else f"{reuse.uses} uses kept")
                parts = self._step_rollouts(batch)
                self._rollout_buffer = list(parts)  # popped; the kept list (the same parts) is not
                reuse.parts, reuse.uses = (parts if reuse.num_iterations > 1 else None), 0
        part = self._rollout_buffer.pop(0)
        if not torch.equal(part["index"].cpu(), batch["index"].cpu()):
            raise RuntimeError(f"GRPO: the micro-batch's prompts {batch['index'].tolist()} are not the ones rolled "
                               f"out for it ({part['index'].tolist()}): the step's prompts came out of order")
        batch.update({k: v for k, v in part.items() if k != "index"})
        if not self._rollout_buffer and self.reuse.parts is not None:
            self.reuse.uses += 1  # the step's last micro-batch: one more use of its rollouts
        return part

    def step_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's GRPO loss (takes its rollouts first unless
        ``batch`` already holds ``advantages``: the memory simulation and tests hand rollouts in)."""
        o = self.objective
        rolled_here = "advantages" not in batch
        part = self._take_rollouts(batch) if rolled_here else None
        control = self.entropy_control
        logps, mask, entropy = self.token_logps(self.model, batch, entropy=True, entropy_grad=control is not None)
        if part is not None and self.reuse.num_iterations > 1 and "old_logps" not in part:
            part["old_logps"] = logps.detach()  # the first use's: the policy that sampled them (TRL records these)
        ref = self.reference_token_logps(batch) if self.reference is not None else None
        sampling, is_ratio, sampling_stats = batch.get("sampling_logps"), batch.get("is_ratio"), None
        if sampling is not None and self._vllm_correction() and is_ratio is None:  # first use: once per rollout
            old = batch["old_logps"] if "old_logps" in batch else logps.detach()
            is_ratio = vllm_importance_weights(old, sampling, mask, mode=o.vllm_importance_sampling_mode,
                                               clip_min=o.vllm_importance_sampling_clip_min,
                                               clip_max=o.vllm_importance_sampling_clip_max)
            sampling_stats = vllm_sampling_stats(old, sampling, mask, is_ratio)
            batch["is_ratio"] = is_ratio
            if part is not None:
                part["is_ratio"] = is_ratio  # kept with the rollouts for their reuse, as TRL computes it once
        n = batch["input_ids"].shape[0]
        step_sequences = batch["step_prompts"] * o.num_generations if "step_prompts" in batch else n
        num_tokens = batch["step_completion_tokens"] if "step_completion_tokens" in batch else self._num_tokens(mask)
        token_mask = None
        if o.top_entropy_quantile < 1.0:  # the quantile over every rank's completion tokens, as TRL's
            token_mask = high_entropy_mask(entropy.detach(), mask, o.top_entropy_quantile,  # type: ignore[union-attr]
                                           pooled=self._pooled_entropies(entropy.detach(), mask))  # type: ignore[union-attr]
        out = grpo_loss(logps, batch["advantages"], mask, old_per_token_logps=batch.get("old_logps"),
                        ref_per_token_logps=ref, beta=o.beta, use_bias_correction_kl=o.use_bias_correction_kl,
                        epsilon=o.epsilon, epsilon_high=o.epsilon_high, loss_type=o.loss_type,
                        max_completion_length=o.max_completion_length, delta=o.delta,
                        num_sequences=step_sequences, num_tokens=num_tokens,
                        importance_sampling_level=o.importance_sampling_level,
                        sapo_temperature_pos=o.sapo_temperature_pos, sapo_temperature_neg=o.sapo_temperature_neg,
                        vespo_k_pos=o.vespo_k_pos, vespo_lambda_pos=o.vespo_lambda_pos, vespo_k_neg=o.vespo_k_neg,
                        vespo_lambda_neg=o.vespo_lambda_neg, token_mask=token_mask,
                        off_policy_mask_threshold=o.off_policy_mask_threshold, sampling_per_token_logps=sampling,
                        importance_sampling_ratio=is_ratio)
        loss = out.loss
        accumulation = self.trainer.accumulate_grad_batches * self.trainer.world_size if self._trainer is not None else 1
        if o.loss_type == "bnpo":  # the local token mean, divided as TRL's trainer
            loss = loss / accumulation
        extra: dict[str, Any] = {}
        if control is not None:  # TRL's bonus: the token mean, scaled for accumulation (and ranks) only
            term = entropy_term(entropy, mask, token_mask)  # type: ignore[arg-type]
            coef = applied_entropy_coef(control.coef, control.last_entropy, adaptive=o.use_adaptive_entropy,
                                        target=o.entropy_target)
            loss = loss - coef * term.mean / accumulation
            extra = {"policy_loss": self._trl_policy_loss(out.loss, n, step_sequences),
                     "entropy_window": (term.total, term.tokens)}
        if sampling_stats is not None:
            extra["sampling"] = sampling_stats
        self._record_stats(batch, rolled_here, out, mask, entropy, extra)
        return loss, {}

    def _trl_policy_loss(self, loss: torch.Tensor, n: int, step_sequences: Any) -> torch.Tensor:
        """TRL's ``policy_loss`` of this micro-batch on this rank (logged with the entropy bonus): the loss
        before the bonus as TRL's ``_compute_loss`` scales it (per-sequence types: this micro-batch's mean;
        dapo, cispo, vespo: its share of the step's tokens x the ranks; bnpo: its token mean)."""
        o, world = self.objective, self.trainer.world_size if self._trainer is not None else 1
        if o.loss_type in ("grpo", "sapo", "dr_grpo", "luspo"):
            return loss.detach() * step_sequences / max(n, 1)
        if o.loss_type in ("dapo", "cispo", "vespo"):
            return loss.detach() * world
        return loss.detach()

    def _record_stats(self, batch: dict[str, Any], rolled_here: bool, out: Any, mask: torch.Tensor,
                      entropy: torch.Tensor, extra: dict[str, Any] | None = None) -> None:
        """Keep this micro-batch's rollout stats and loss metrics for the step's log (weights: tokens, or
        sequences where the ratios are per sequence: GSPO's, RLOO's); ``extra``: the entropy bonus's
        ``policy_loss`` (a plain mean over ranks, as TRL's) and its entropy sum and token count."""
        stats = batch.get("rollout_stats")
        if stats is not None:
            self._step_stats.append(stats)
        if rolled_here or stats is not None:
            tokens = float(mask.sum())
            metrics = {k: float(v) for k, v in out.metrics.items()}
            metrics["entropy"] = float((entropy.detach() * mask).sum()) / max(tokens, 1.0)  # type: ignore[operator]
            weights = {k: float(v) for k, v in out.weights.items()}
            entry: dict[str, Any] = {"tokens": tokens, "weights": weights, "metrics": metrics}
            if "policy_loss" in (extra or {}):
                metrics["policy_loss"], weights["policy_loss"] = float(extra["policy_loss"]), 1.0
                entry["entropy_window"] = tuple(float(x) for x in extra["entropy_window"])
            if "sampling" in (extra or {}):  # vLLM's correction: logged with the step's rollout metrics
                entry["sampling"] = {k: float(v) for k, v in extra["sampling"].items()}
            self._loss_stats.append(entry)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if bool(batch["step_end"]):
            self._log_rollouts()
        return loss

    def _log_rollouts(self) -> None:
        """TRL's metrics of the step: the rollout ones over the step's completions (every micro-batch,
        every rank), the loss ones (``entropy``, ``clip_ratio/*``, ``kl``) as TRL logs them: each
        micro-batch's over every rank (token means; ``_min``/``_max`` over every rank's sequences),
        then their mean over the step's micro-batches (TRL's log averages what each ``_compute_loss``
        call appended since the last log)."""
        stats, self._step_stats = self._step_stats, []
        losses, self._loss_stats = self._loss_stats, []
        per_rank = [losses]
        if self.trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * self.trainer.world_size
            dist.all_gather_object(gathered, ([{k: v for k, v in s.items() if k != "texts"} for s in stats], losses))
            stats = [s for part, _ in gathered for s in part]
            per_rank = [part for _, part in gathered]
        if stats:
            metrics = self._rollout_metrics(stats)
            rewards = torch.cat([s["rewards"] for s in stats])
            what = "conversations" if self.env_settings is not None else "completions"
            self.summary_notes["train/reward"] = (f"last step: {rewards.numel()} sampled {what}, "
                                                  f"{int((~torch.isnan(rewards)).sum())} scored")
            self.tokens_seen.count += int(sum(s["prompt_tokens"] + int(s["lengths"].sum()) for s in stats))
            metrics.update(self._sampling_metrics(per_rank))
            self.reuse.metrics = dict(metrics)
        else:  # a reuse step: its rollouts' metrics again (a resumed run has them from the checkpoint)
            metrics = dict(self.reuse.metrics) if self.reuse.parts is not None else {}
        metrics["num_tokens"] = float(self.tokens_seen.count)
        metrics.update(self._loss_metrics(per_rank))
        if self.entropy_control is not None:
            metrics["entropy_coef"] = self._update_entropy_control(per_rank)
        for key, value in metrics.items():  # already over every rank: no sync
            # num_tokens in float64: Lightning stores a plain number in float32, exact only up to 2**24
            logged = torch.tensor(float(value), dtype=torch.float64) if key == "num_tokens" else float(value)
            self.log(f"train/{key}", logged, batch_size=1, on_step=True, on_epoch=False, sync_dist=False)

    @staticmethod
    def _sampling_metrics(per_rank: list[list[dict[str, Any]]]) -> dict[str, float]:
        """TRL's ``sampling/*`` of vLLM's correction: each rank's over its rollouts (every micro-batch's
        first use), then the mean of the ranks' means and the extremes over ranks (0 where a rank has none)."""
        ranks = [[e["sampling"] for e in part if "sampling" in e] for part in per_rank]
        if not any(ranks):
            return {}
        values: dict[str, list[float]] = {"delta_mean": [], "delta_max": [], "ratio_min": [], "ratio_mean": [],
                                          "ratio_max": []}
        for entries in ranks:
            def total(key: str) -> float:
                return sum(e[key] for e in entries)

            def pick(key: str, fn: Any) -> float:
                kept = [e[key] for e in entries if not math.isnan(e[key])]
                return fn(kept) if kept else 0.0

            values["delta_mean"].append(total("delta_sum") / total("delta_count") if total("delta_count") else 0.0)
            values["delta_max"].append(pick("delta_max", max))
            values["ratio_mean"].append(total("ratio_sum") / total("ratio_count") if total("ratio_count") else 0.0)
            values["ratio_min"].append(pick("ratio_min", min))
            values["ratio_max"].append(pick("ratio_max", max))
        return {"sampling/sampling_logp_difference/mean": sum(values["delta_mean"]) / len(ranks),
                "sampling/sampling_logp_difference/max": max(values["delta_max"]),
                "sampling/importance_sampling_ratio/min": min(values["ratio_min"]),
                "sampling/importance_sampling_ratio/mean": sum(values["ratio_mean"]) / len(ranks),
                "sampling/importance_sampling_ratio/max": max(values["ratio_max"])}

    def _update_entropy_control(self, per_rank: list[list[dict[str, Any]]]) -> float:
        """After the optimizer step: adaptive control (Skywork-OR1, as TRL) moves the coefficient by the
        step's token-mean entropy over every micro-batch and rank (the tokens the bonus acts on) and keeps
        that entropy for the next step's gate. Returns the coefficient (TRL logs it as ``entropy_coef``)."""
        control, o = self.entropy_control, self.objective
        assert control is not None
        if o.use_adaptive_entropy:
            windows = [e["entropy_window"] for part in per_rank for e in part if "entropy_window" in e]
            entropy = sum(w[0] for w in windows) / max(sum(w[1] for w in windows), 1.0)
            control.coef = adaptive_entropy_coef(control.coef, entropy, target=o.entropy_target,
                                                 delta=o.entropy_coef_delta, coef_min=o.entropy_coef_min,
                                                 coef_max=o.entropy_coef_max)
            control.last_entropy = entropy
        return control.coef

    @staticmethod
    def _loss_metrics(per_rank: list[list[dict[str, Any]]]) -> dict[str, float]:
        """``per_rank[r][j]``: rank ``r``'s ``j``-th micro-batch of the step (its completion tokens and
        its local metrics) -> TRL's logged values (see :meth:`_log_rollouts`)."""
        micro = list(zip(*per_rank))  # [j][r]
        keys = micro[0][0]["metrics"].keys() if micro and micro[0] else ()
        out: dict[str, float] = {}
        for key in keys:
            values = []
            for ranks in micro:
                local = [r["metrics"][key] for r in ranks]
                if key.endswith(("_min", "_max")):  # TRL's nanmin / nanmax over the gathered sequences
                    kept = [v for v in local if not math.isnan(v)]
                    values.append((min(kept) if key.endswith("_min") else max(kept)) if kept else float("nan"))
                else:  # TRL's global_masked_mean: weighted by tokens (or sequences) over ranks (0 with none)
                    tokens = [r.get("weights", {}).get(key, r["tokens"]) for r in ranks]
                    values.append(sum(v * w for v, w in zip(local, tokens)) / max(sum(tokens), 1.0))
            kept = [v for v in values if not math.isnan(v)]  # TRL's log skips NaN entries
            out[key] = sum(kept) / len(kept) if kept else float("nan")
        return out

    @staticmethod
    def _rollout_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
        """TRL's reward and completion metrics over the step's rollouts (every rank's)."""
        names = stats[0]["names"]
        rewards = torch.cat([s["rewards"] for s in stats]).double()
        per = torch.cat([s["per_reward"] for s in stats]).double()
        lengths = torch.cat([s["lengths"] for s in stats]).double()
        truncated = torch.cat([s["truncated"] for s in stats]).bool()
        metrics: dict[str, float] = {
            "reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
            "frac_reward_zero_std": torch.cat([s["is_std_zero"] for s in stats]).double().mean().item(),
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.double().mean().item(),
        }
        # TRL: the lengths of the completions that ended with a stop token (all 0 when none did)
        ended = lengths[~truncated] if bool((~truncated).any()) else lengths.new_zeros(1)
        metrics.update({"completions/mean_terminated_length": ended.mean().item(),
                        "completions/min_terminated_length": ended.min().item(),
                        "completions/max_terminated_length": ended.max().item()})
        for k, name in enumerate(names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(per[:, k]).item()
            metrics[f"rewards/{name}/std"] = nanstd(per[:, k]).item()
        pairs = {f"rewards/disagreement/{j}_vs_{v}": (a, b) for a, j in enumerate(names) for b, v in enumerate(names)}
        for key in stats[0]["extra"]:
            if key in pairs:  # the share over every rank's completions both scored, not a mean of shares
                a, b = pairs[key]
                rate, _ = disagreement_rate(*([None if math.isnan(x) else x for x in per[:, c].tolist()] for c in (a, b)))
                metrics[key] = float("nan") if rate is None else rate
                continue
            values = [s["extra"][key] for s in stats if not math.isnan(s["extra"][key])]
            summed = key.endswith("/missing")
            metrics[key] = (sum(values) if summed else sum(values) / len(values)) if values else float("nan")
        seconds = sum(s["seconds"] for s in stats)
        metrics["completion_tokens_per_s"] = lengths.sum().item() / seconds if seconds > 0 else float("nan")
        if "turns" in stats[0]:
            metrics.update(conversation_metrics(stats))
        return metrics

    # ---- validation: sampled as training samples -------------------------------------------
    @property
    def val_generations(self) -> int:
        """Completions sampled per validation prompt: ``num_generations_eval``, else ``num_generations`` (TRL's)."""
        n = self.objective.num_generations_eval
        return int(n) if n is not None else int(self.objective.num_generations)

    def _val_seed(self, index: torch.Tensor) -> int:
        """The seed of a validation batch's sampling: the run's seed and the batch's first prompt, so every
        validation samples with the same random numbers (one validation compares with the next), whatever
        the rank; the training sampler's stream and the global one are left as they were."""
        first = int(index[0]) if index.numel() else 0
        return (torch.initial_seed() + 2_000_003 * (first + 1) + 999_983) % (2**63)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """``val_generations`` completions per prompt, sampled as training samples them (``temperature``,
        ``top_p``, ``top_k``, ``max_completion_length``, the same stop tokens) and scored by the same
        rewards, so ``val/reward`` means what ``train/reward`` means, on held-out prompts."""
        g = self.val_generations
        if self.env_settings is not None:
            return self._validate_conversations(batch, g)
        prompt_ids = batch["prompt_ids"].repeat_interleave(g, dim=0)
        prompt_mask = batch["prompt_mask"].repeat_interleave(g, dim=0)
        device = prompt_ids.device
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else "cpu"):
            torch.manual_seed(self._val_seed(batch["index"]))
            new_ids = self.generate(prompt_ids, prompt_mask, sample=True)
        mask, truncated, texts = self.completions_from(new_ids)
        prompts = [p for p in batch["prompts"] for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch["columns"].items()}
        scores = self.rewards(prompts, texts, columns)
        self._val_names = scores.names
        n, k = batch["index"].shape[0], len(scores.names)
        values = torch.cat([scores.rewards.view(n, g), scores.per_reward.reshape(n, g * k),
                            mask.sum(dim=1).double().cpu().view(n, g), truncated.double().cpu().view(n, g)], dim=1)
        self.collect_val(batch["index"], values.to(self.device))

    def _validate_conversations(self, batch: dict[str, Any], g: int) -> None:
        """:meth:`validation_step` with ``env``: ``g`` conversations per seed, rolled out as training rolls
        them, from a stream seeded by :meth:`_val_seed` (the training stream is left as it was)."""
        sampler = ConversationSampler(g, self.sampler.env, self.chat, stop_ids=self.stop_ids,
                                      max_turns=self.sampler.max_turns, max_tokens=self.sampler.max_tokens)
        convs, _ = sampler.sample_hf(self.generate, batch, self._val_seed(batch["index"]))
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch["columns"].items()}
        scores = self._dialogue_scores(convs, columns).scores
        self._val_names = scores.names
        n, k = batch["index"].shape[0], len(scores.names)
        lengths = torch.tensor([sum(c.completion[1]) for c in convs], dtype=torch.float64)
        cut = torch.tensor([float(c.cut) for c in convs], dtype=torch.float64)
        values = torch.cat([scores.rewards.view(n, g), scores.per_reward.reshape(n, g * k), lengths.view(n, g),
                            cut.view(n, g)], dim=1)
        self.collect_val(batch["index"], values.to(self.device))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Over every validation completion (each prompt counted once): ``reward``, ``reward_std``,
        ``rewards/<name>/mean``, ``completions/mean_length`` and ``completions/clipped_ratio``, as
        training logs them for its rollouts; the run summary's note says what ``val/reward`` is the mean of."""
        g, k = self.val_generations, len(self._val_names)
        rewards = values[:, :g].reshape(-1)
        per = values[:, g:g + g * k].reshape(-1, k)
        lengths = values[:, g + g * k:g + g * k + g].reshape(-1)
        truncated = values[:, g + g * k + g:].reshape(-1)
        out = {"reward": torch.nanmean(rewards), "reward_std": nanstd(rewards)}
        for j, name in enumerate(self._val_names):
            out[f"rewards/{name}/mean"] = torch.nanmean(per[:, j])
        out["completions/mean_length"] = lengths.mean()
        out["completions/clipped_ratio"] = truncated.mean()
        scored = int((~torch.isnan(rewards)).sum())
        what = "conversations" if self.env_settings is not None else "completions"
        self.summary_notes["val/reward"] = (f"{values.shape[0]} validation prompts x {g} {what} sampled as in "
                                            f"training, {scored} scored")
        return out
