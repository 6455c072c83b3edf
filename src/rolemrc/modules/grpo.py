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
   group-normalised advantages (:func:`~rolemrc.objectives.grpo.group_advantages`): the
   :class:`~rolemrc.modules.scoring.Scorer` part. The step's rollouts are buffered, one part per
   micro-batch (:class:`~rolemrc.rollout.reuse.RolloutReuse`);
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
micro-batches that many times in a row (``step_use``); the rollouts are kept (``RolloutReuse``, in
the run state), the first use records its per-token log-probs and the later uses train on the same
rollouts with those as old log-probs (clipped ratio).
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

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.config import TrainStep, objective_settings
from rolemrc.env import make_env
from rolemrc.env.sampler import ConversationSampler
from rolemrc.models.forward import policy_hidden
from rolemrc.models.loading import decoder_and_head, eval_mode
from rolemrc.models.precision import PrecisionPolicy
from rolemrc.modules.base import PolicyModule, TokensSeen
from rolemrc.modules.entropy import EntropyControl
from rolemrc.modules.reference import Reference
from rolemrc.modules.scoring import Scorer, gather_objects, repeated, rollout_metrics, sampling_metrics
from rolemrc.objectives.grpo import (GroupAdvantages, applied_entropy_coef, entropy_term, grpo_loss, high_entropy_mask,
                                     nanstd, vllm_importance_weights, vllm_sampling_stats)
from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.rewards import RewardSet, build_rewards
from rolemrc.rewards.combine import RewardScores
from rolemrc.rollout import HFEngine, Sampling, SamplingRNG, TurnSampler, make_engine
from rolemrc.rollout.hf import pad_id_of, stop_token_ids
from rolemrc.rollout.reuse import RolloutReuse
from rolemrc.rollout.sampler import completion_mask

log = logging.getLogger(__name__)

TOKENS_KEY = "grpo_num_tokens"  # top-level checkpoint entry: TRL's num_tokens so far
LAYOUT = ("input_ids", "attention_mask", "labels", "position_ids")  # a rollout's tensors the loss reads


class GRPOModule(PolicyModule):
    """``objective``: the grpo node (:class:`~rolemrc.config.GRPOObjectiveConfig`); ``reference``:
    DPO's copy / adapter (:func:`rolemrc.modules.reference.make_reference`), ``None`` when
    ``beta == 0``; ``chat``: the tokenizer and chat format (default: the trainer's datamodule's);
    ``rewards``: a ready :class:`RewardSet` (default: built from ``objective.rewards`` at first use);
    ``env``: the ``env:`` settings (:class:`~rolemrc.config.EnvConfig`, ``max_tokens`` resolved) for
    multi-turn rollouts (the conversation rollout kind), None for one completion per prompt."""

    # the step's passes without gradient besides the rollout: the memory simulation runs each as a module call
    no_grad_passes = ("reference_token_logps",)
    # GRPO's loss and its options (the entropy bonus, vLLM's importance-sampling correction); RLOO: its own loss
    grpo_loss = True
    scorer_class: type[Scorer] = Scorer  # RLOO: the leave-one-out advantages
    row_keys: tuple[str, ...] = ("advantages",)  # a rollout's [N] values split with its rows (RLOO: old log-probs)

    def __init__(self, model: nn.Module, objective: Any, optim: Any, policy: PrecisionPolicy,
                 reference: Reference | None = None, sharding: Any = None, packed_attention: str = "auto",
                 chat: Any = None, rewards: RewardSet | None = None, env: Any = None) -> None:
        super().__init__(model, objective, optim, policy, sharding, packed_attention)
        if objective.beta > 0 and reference is None:
            raise ValueError(f"objective.beta={objective.beta} needs a reference (objective.reference=copy|adapter)")
        self.reference = reference if objective.beta > 0 else None
        if self.grpo_loss:
            self._check_loss_options(objective)
        self.entropy_control = EntropyControl.of(objective) if self.grpo_loss else None
        self._chat = chat
        self._rewards = rewards
        self._own_rewards = rewards is None
        self.env_settings = env if env is not None and env.name != "none" else None
        self.sampling_rng = SamplingRNG()  # the rollout's random stream (every rollout kind draws from it)
        self._sampler: Any = None  # the rollout kind: one turn (TurnSampler) or conversations (env), see sampler
        self._step_stats: list[dict[str, Any]] = []  # the step's rollout statistics (one per step and rank)
        self._loss_stats: list[dict[str, Any]] = []  # the step's micro-batches' loss metrics and token counts
        self.reuse = RolloutReuse(int(objective.num_iterations))  # the step's rollouts, kept for num_iterations
        self.tokens_seen = TokensSeen(TOKENS_KEY)
        self._val_names: list[str] = []
        self.summary_notes: dict[str, str] = {}  # what the run summary's reward figures are means of
        self._engine: Any = None  # objective.rollout=vllm: rolemrc.rollout's engine, built at first use

    def _check_loss_options(self, objective: Any) -> None:
        """Warn of loss options meant with others (TRL warns of the same settings)."""
        level, loss_type = objective.importance_sampling_level, objective.loss_type
        if loss_type == "luspo" and level != "sequence":
            log.warning("objective.loss_type=luspo is meant with objective.importance_sampling_level=sequence (LUSPO)")
        if loss_type == "vespo" and level != "token":
            log.warning("objective.loss_type=vespo computes its sequence weights itself: "
                        "objective.importance_sampling_level=token is meant")
        if level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            log.warning("objective.importance_sampling_level=sequence with loss_type=%s sums per-token terms, weighting "
                        "each sequence by its length; GSPO's setup is objective.loss_type=grpo", loss_type)

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
    def scorer(self) -> Scorer:
        """The rollouts' scoring part (:mod:`rolemrc.modules.scoring`): :attr:`rewards`, over every rank."""
        trainer = self._trainer
        return self.scorer_class(self.objective, self.rewards, self.env_settings,
                                 world=trainer.world_size if trainer is not None else 1,
                                 rank=trainer.global_rank if trainer is not None else 0)

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
        o = self.objective
        return self.grpo_loss and o.rollout == "vllm" and bool(o.vllm_importance_sampling_correction)

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
        conversations, :meth:`score_conversations`): rewards, layout, advantages (:attr:`scorer`)."""
        if self.env_settings is not None:
            return self.score_conversations(batch, new_ids, seconds)
        _, _, texts = self.completions_from(new_ids)
        prompts, columns = repeated(batch, self.objective.num_generations)
        scores = self.scorer.completions(prompts, texts, columns)
        laid = self.sampler.lay_out(new_ids, batch, stop_ids=self.stop_ids,
                                    mask_cut=self.objective.mask_truncated_completions)
        return self._scored(batch, laid, scores, seconds, texts=texts)

    def score_conversations(self, batch: dict[str, Any], convs: list[Any], seconds: float = float("nan")) -> dict[
            str, Any]:
        """:meth:`score` of ``B x G`` conversations (each seed's next to each other): each scored as
        :mod:`rolemrc.rewards.turns` says (per turn, aggregated, or over the whole conversation), the
        advantages per conversation, the layout of :func:`~rolemrc.env.sampler.lay_out` (the completion:
        everything after the opening prompt, attended to; the loss on the role-player's tokens only)."""
        dialogue = self.scorer.conversations(convs, repeated(batch, self.objective.num_generations)[1])
        laid = self.sampler.lay_out(convs, batch, mask_cut=self.objective.mask_truncated_completions)
        return self._scored(batch, laid, dialogue.scores, seconds, texts=[c.reply_texts() for c in convs],
                            turns=torch.tensor([c.turns for c in convs]), ends=[c.reason for c in convs],
                            noncanonical=sum(c.noncanonical for c in convs), turn_values=dialogue.turn_values,
                            turn_index=dialogue.turn_index)

    def _scored(self, batch: dict[str, Any], laid: dict[str, torch.Tensor], scores: RewardScores, seconds: float,
                **more: Any) -> dict[str, Any]:
        """``batch`` with the rollout's layout, its advantages ``[N]`` and its statistics (logged at the step's end)."""
        device = batch["prompt_ids"].device
        batch.update({k: laid[k].to(device) for k in LAYOUT})
        stats = self.scorer.stats(scores, laid, int(batch["prompt_mask"].sum()) * self.objective.num_generations,
                                  seconds, **more)
        adv = self._advantages(scores, batch, stats)
        batch.update(advantages=adv.advantages.float(), rollout_stats={**stats, "is_std_zero": adv.is_std_zero.cpu()})
        return batch

    def _advantages(self, scores: RewardScores, batch: dict[str, Any], stats: dict[str, Any]) -> GroupAdvantages:
        """The laid-out ``batch``'s advantages (:meth:`Scorer.advantages`); RLOO takes its KL pass first."""
        return self.scorer.advantages(scores, batch["prompt_ids"].device)

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
            part.update({k: rolled[k][rows] for k in self.row_keys if k in rolled})
            part.update(index=step["index"][start:start + size], step_completion_tokens=total)
            parts.append(part)
            start += size
        parts[0]["rollout_stats"] = rolled["rollout_stats"]  # the step's: logged once
        return parts

    def step_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's GRPO loss (takes its rollouts first unless
        ``batch`` already holds ``advantages``: the memory simulation and tests hand rollouts in)."""
        o = self.objective
        rolled_here = "advantages" not in batch
        part = self.reuse.take(batch, self._step_rollouts) if rolled_here else None
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
            gathered = gather_objects(([{k: v for k, v in s.items() if k != "texts"} for s in stats], losses),
                                      self.trainer.world_size)
            stats = [s for part, _ in gathered for s in part]
            per_rank = [part for _, part in gathered]
        if stats:
            metrics = rollout_metrics(stats)
            rewards = torch.cat([s["rewards"] for s in stats])
            what = "conversations" if self.env_settings is not None else "completions"
            self.summary_notes["train/reward"] = (f"last step: {rewards.numel()} sampled {what}, "
                                                  f"{int((~torch.isnan(rewards)).sum())} scored")
            self.tokens_seen.count += int(sum(s["prompt_tokens"] + int(s["lengths"].sum()) for s in stats))
            metrics.update(sampling_metrics(per_rank))
            self.reuse.metrics = dict(metrics)
        else:  # a reuse step: its rollouts' metrics again (a resumed run has them from the checkpoint)
            metrics = dict(self.reuse.metrics) if self.reuse.parts is not None else {}
        metrics["num_tokens"] = float(self.tokens_seen.count)
        metrics.update(self._loss_metrics(per_rank))
        if self.entropy_control is not None:
            metrics["entropy_coef"] = self.entropy_control.update(per_rank)
        for key, value in metrics.items():  # already over every rank: no sync
            # num_tokens in float64: Lightning stores a plain number in float32, exact only up to 2**24
            logged = torch.tensor(float(value), dtype=torch.float64) if key == "num_tokens" else float(value)
            self.log(f"train/{key}", logged, batch_size=1, on_step=True, on_epoch=False, sync_dist=False)

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
        """``val_generations`` completions (with ``env``: conversations) per prompt, sampled as training samples
        them (``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, the same stop tokens, the same
        rollout kind) from a stream seeded by :meth:`_val_seed` (the training stream is left as it was) and
        scored by the same rewards, so ``val/reward`` means what ``train/reward`` means, on held-out prompts."""
        g, seed = self.val_generations, self._val_seed(batch["index"])
        prompts, columns = repeated(batch, g)
        sampler = copy.copy(self.sampler)  # the rollout kind, g per prompt, from a stream of its own
        sampler.n, sampler.rng = g, SamplingRNG()
        sampled, _ = sampler.sample_hf(self.generate, batch, seed)
        if self.env_settings is None:
            mask, cut, texts = self.completions_from(sampled)
            scores, lengths = self.scorer.completions(prompts, texts, columns), mask.sum(dim=1)
        else:
            scores = self.scorer.conversations(sampled, columns).scores
            lengths, cut = torch.tensor([sum(c.completion[1]) for c in sampled]), torch.tensor([c.cut for c in sampled])
        self._val_names = scores.names
        n, k = batch["index"].shape[0], len(scores.names)
        values = torch.cat([scores.rewards.view(n, g), scores.per_reward.reshape(n, g * k),
                            lengths.double().cpu().view(n, g), cut.double().cpu().view(n, g)], dim=1)
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
