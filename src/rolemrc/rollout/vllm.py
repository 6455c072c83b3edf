"""vLLM rollout engines for ``objective.rollout=vllm`` (``objective.vllm.mode``).

``ServerEngine`` (``server``): any vLLM OpenAI-compatible server. Before each step's rollout, rank 0
writes the policy's LoRA adapter to ``sync_dir`` (a folder the server reads) and loads it under a
new name with ``POST /v1/load_lora_adapter`` (the server runs with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), then unloads the previous step's
(``/v1/unload_lora_adapter``). Every rank then sends one ``POST /v1/completions`` per prompt,
naming that adapter: the prompt as token ids, ``n = num_generations``, the sampling keys, a seed
from the run's sampling RNG, ``stop_token_ids``, ``return_token_ids`` (vLLM >= 0.10.2) and
``logprobs: 0``, and trains on the ``token_ids`` it returns; the sampled tokens' log-probs
(``logprobs.token_logprobs``) are kept in ``sampled_logprobs`` for GRPO's importance-sampling
correction (``require_logprobs``: an answer without them is malformed). Requests go through :class:`rolemrc.api.ApiClient` (retries with
backoff on 429/5xx/timeouts/connection errors/malformed answers); a request that still fails stops
the run with :class:`RolloutError` (never a rollout from stale weights, never a zero reward).

``ColocateEngine`` (``colocate``): ``vllm.LLM`` in this process on the trainer's GPU
(``gpu_memory_utilization`` of it); before each rollout the policy's full weights (a LoRA adapter
merged in; FSDP2 shards gathered) are loaded into it with the model's own ``load_weights`` and its
prefix cache is reset. Not run in this repository's tests (vLLM needs a GPU and its own pins).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.errors import UserError
from rolemrc.rollout.engine import Sampling
from rolemrc.rollout.weights import adapter_weights, merged_weights, save_adapter

log = logging.getLogger(__name__)

VLLM_EXTRA_MISSING = (
    "objective.vllm.mode=colocate needs the `vllm` package in the training process, which is not installed "
    "here. There is no `rolemrc[vllm]` extra: vLLM pins its own torch and transformers (vllm 0.33: torch 2.14, "
    "transformers<5.21), which conflict with rolemrc's pins. On a GPU node, give it an environment of its own "
    "and install rolemrc into it without its pins (python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm "
    "&& .venv-vllm/bin/pip install -e . --no-deps), or use objective.vllm.mode=server (the vLLM server in its own "
    "environment, this run as it is), or objective.rollout=hf"
)


class RolloutError(UserError, RuntimeError):
    """The rollout engine could not sample or sync (the server is down, answers malformed, refuses an
    adapter): the run stops here instead of training on nothing or on stale weights."""


Broadcast = Callable[[Any], Any]  # rank 0's object, handed to every rank (identity on one process)


def check_rows(rows: list[list[int]], *, n: int, max_tokens: int, stop_ids: Sequence[int], vocab: int) -> None:
    """A prompt's ``n`` completions as we train on them: token ids in the vocabulary, each ending at a
    stop token or exactly ``max_tokens`` long (a shorter completion without a stop token would be
    trained with padding: refused, e.g. the server's --max-model-len cut it)."""
    if len(rows) != n:
        raise ValueError(f"asked for n={n} completions, got {len(rows)}")
    stops = set(stop_ids)
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in row):
            raise ValueError(f"completion {i}: token_ids missing or outside the vocabulary (0..{vocab - 1}); "
                             "the server must be vLLM >= 0.10.2 (return_token_ids) serving this tokenizer")
        if len(row) > max_tokens:
            raise ValueError(f"completion {i}: {len(row)} tokens, more than max_tokens={max_tokens}")
        if len(row) < max_tokens and not (row and row[-1] in stops):
            raise ValueError(f"completion {i}: {len(row)} tokens, ends without a stop token before "
                             f"max_tokens={max_tokens} (is the server's --max-model-len too small?)")


class ServerEngine:
    """``objective.vllm.mode=server`` (see the module docstring). ``rank``: this process's global
    rank (rank 0 syncs); ``broadcast``: rank 0's value to every rank; ``run_dir``: the default home
    of ``sync_dir``."""

    def __init__(self, objective: Any, *, stop_ids: Sequence[int], vocab: int, rank: int = 0,
                 broadcast: Broadcast = lambda x: x, run_dir: str | Path | None = None,
                 require_logprobs: bool = False) -> None:
        v = objective.vllm
        self.require_logprobs = require_logprobs
        self.sampled_logprobs: list[list[float]] | None = None  # the last generate's, NaN where vLLM gave none
        self.objective, self.cfg = objective, v
        self.stop_ids, self.vocab, self.rank, self.broadcast = list(stop_ids), int(vocab), rank, broadcast
        self.sync_dir = Path(v.sync_dir) if v.sync_dir else Path(run_dir or ".") / "vllm_adapters"
        self.prefix = f"rolemrc-{uuid.uuid4().hex[:8]}"  # rank 0's; adapter names are broadcast
        self.loaded: str | None = None  # the adapter the server holds for us (rank 0's view)
        self.model_name: str | None = None  # what completion requests name: the adapter of this step
        self.counts: Counter[str] = Counter()
        self.syncs = 0

    @classmethod
    def build(cls, objective: Any, **kwargs: Any) -> "ServerEngine":
        keys = ("stop_ids", "vocab", "rank", "broadcast", "run_dir", "require_logprobs")
        return cls(objective, **{k: kwargs[k] for k in keys if k in kwargs})

    # ---- sync --------------------------------------------------------------------------------
    def sync(self, model: nn.Module, step: int) -> None:
        """The policy's adapter, loaded into the server under a new name (every rank calls this: the
        adapter's shards are gathered on all of them); raises on every rank when rank 0's load failed."""
        weights = adapter_weights(model)
        err, name, failure = None, f"{self.prefix}-step{step}", None
        if self.rank == 0:
            try:
                self._load(model, weights, name)
            except Exception as e:  # told to every rank (they would wait for rank 0 forever), then raised
                err, failure = f"{e}" if isinstance(e, RolloutError) else f"objective.vllm: {type(e).__name__}: {e}", e
        err, name = self.broadcast((err, name))
        if failure is not None:
            raise failure
        if err:
            raise RolloutError(err)
        self.model_name = name
        self.syncs += 1

    def _load(self, model: nn.Module, weights: dict[str, torch.Tensor], name: str) -> None:
        folder = self.sync_dir / name
        save_adapter(model, weights, folder)
        previous = self.loaded
        out = self._run(self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())}))
        if not out.ok:
            raise RolloutError(f"objective.vllm: loading the policy's adapter into {self.cfg.base_url} failed "
                               f"({out.error}; {out.attempts} attempt(s)): start the server with --enable-lora "
                               f"--max-lora-rank >= model.peft.r and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, with "
                               f"objective.vllm.sync_dir ({self.sync_dir}) readable by it")
        self.loaded = name
        if previous is not None:
            gone = self._run(self._post("/unload_lora_adapter", {"lora_name": previous}))
            if not gone.ok:  # harmless for this run (a slot is kept on the server): said, not fatal
                log.warning("objective.vllm: unloading the previous adapter %s failed: %s", previous, gone.error)
            shutil.rmtree(self.sync_dir / previous, ignore_errors=True)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        client = self._client()
        try:
            return await client.post(path, body, tag=f"{path} {body.get('lora_name')}")
        finally:
            await client.close()

    # ---- generate ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int] | None,
                 sampling: Sampling | None = None) -> list[list[int]]:
        """``n`` completions per prompt (token ids, each prompt's next to each other), from the adapter
        synced last."""
        if self.model_name is None:
            raise RuntimeError("ServerEngine.generate before sync: the server's weights would be stale")
        seeds = seeds if seeds is not None else [0] * len(prompts)
        rows, self.sampled_logprobs = self._run(self._generate(prompts, n, seeds,
                                                               sampling or Sampling.of(self.objective)))
        return rows

    async def _generate(self, prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int],
                        sampling: Sampling) -> tuple[list[list[int]], list[list[float]]]:
        client = self._client()
        fields = sampling.vllm()
        fields.setdefault("top_k", -1)
        top_k = fields.pop("top_k")

        def check(choices: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[float]]]:
            rows = [c.get("token_ids") for c in choices]
            check_rows(rows, n=n, max_tokens=fields["max_tokens"], stop_ids=self.stop_ids, vocab=self.vocab)
            return rows, [sampled_logprobs(c.get("logprobs"), len(row), i, self.require_logprobs)
                          for i, (c, row) in enumerate(zip(choices, rows))]

        async def one(i: int) -> Any:
            body = {"model": self.model_name, "prompt": [int(t) for t in prompts[i]], "n": n, "seed": int(seeds[i]),
                    "logprobs": 0, **fields, "extra_body": {"top_k": top_k, "stop_token_ids": self.stop_ids, "return_token_ids": True,
                                             "skip_special_tokens": True}}
            return await client.completions(body, tag=f"prompt {i}", check=check)

        try:
            outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await client.close()
        failed = [(i, out) for i, out in enumerate(outs) if not out.ok]
        if failed:
            i, out = failed[0]
            raise RolloutError(f"objective.vllm: {len(failed)} of {len(outs)} completion requests to "
                               f"{self.cfg.base_url} failed (prompt {i}: {out.error}; {out.attempts} attempt(s), "
                               f"objective.vllm.max_attempts={self.cfg.max_attempts}): the run stops here")
        return ([row for out in outs for row in out.value[0]], [lp for out in outs for lp in out.value[1]])

    # ---- plumbing ----------------------------------------------------------------------------
    def _client(self) -> Any:
        from rolemrc.api import ApiClient

        v = self.cfg
        return ApiClient("objective.vllm", base_url=v.base_url, api_key_env=v.api_key_env, concurrency=v.concurrency,
                         timeout_s=v.timeout_s, max_attempts=v.max_attempts, backoff_s=v.backoff_s,
                         max_backoff_s=v.max_backoff_s, counts=self.counts)

    @staticmethod
    def _run(coro: Any) -> Any:
        """A coroutine run to its end from the (synchronous) training step."""
        return asyncio.run(coro)

    def close(self) -> None:
        """The adapter folders this run wrote (the server keeps what it loaded until it is unloaded or stops)."""
        if self.rank == 0 and self.loaded is not None:
            try:
                self._run(self._post("/unload_lora_adapter", {"lora_name": self.loaded}))
            except Exception as e:  # the run is over; a server gone by now is not an error of the run
                log.warning("objective.vllm: unloading %s at the end failed: %s", self.loaded, e)
            self.loaded = None


def sampled_logprobs(logprobs: Any, length: int, index: int, required: bool) -> list[float]:
    """The sampled tokens' log-probs of one completion as ``/v1/completions`` returns them with
    ``logprobs: 0`` (``logprobs.token_logprobs``, one per token; ``None`` -> NaN); all NaN where the
    answer has none, unless ``required`` (a malformed answer: the request is retried)."""
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if values is None:
        if required:
            raise ValueError(f"completion {index}: no logprobs.token_logprobs (asked with logprobs=0): "
                             "objective.vllm_importance_sampling_correction needs the sampled tokens' log-probs "
                             "(a vLLM server returns them; or set objective.vllm_importance_sampling_correction=false)")
        return [math.nan] * length
    if len(values) != length or not all(v is None or isinstance(v, (int, float)) for v in values):
        raise ValueError(f"completion {index}: logprobs.token_logprobs has {len(values)} entries for {length} tokens")
    return [math.nan if v is None else float(v) for v in values]


def require_vllm(missing: str = VLLM_EXTRA_MISSING, error: type[Exception] = RolloutError) -> Any:
    """The vllm module, or ``error(missing)`` (what to do to get it) where it is not installed."""
    try:
        import vllm
    except ImportError as err:
        raise error(missing) from err
    return vllm


def build_llm(vllm: Any, *, model: str, tokenizer: str | None, max_model_len: int, seed: int, **kwargs: Any) -> Any:
    """``vllm.LLM`` of ``model`` (the one place rolemrc builds it); ``kwargs``: its other arguments."""
    return vllm.LLM(model=model, tokenizer=tokenizer or model, max_model_len=max_model_len, seed=seed, **kwargs)


def llm_generate(vllm: Any, llm: Any, prompts: Sequence[Sequence[int]], sampling: Sampling, stop_ids: Sequence[int],
                 *, n: int | None = None, seeds: Sequence[int] | None = None, logprobs: bool = False,
                 **kwargs: Any) -> list[Any]:
    """vLLM's outputs for the prompts (token ids), one ``SamplingParams`` per prompt with its seed
    and ``n`` where seeds are given, one for all otherwise; ``logprobs``: each sampled token's log-prob
    too (``logprobs=0``); ``kwargs``: ``LLM.generate``'s others."""
    fields = dict(stop_token_ids=list(stop_ids), skip_special_tokens=True, **sampling.vllm())
    if logprobs:
        fields["logprobs"] = 0
    if seeds is None:
        params: Any = vllm.SamplingParams(**fields)
    else:
        params = [vllm.SamplingParams(n=n, seed=int(s), **fields) for s in seeds]
    return llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params, **kwargs)


class ColocateEngine:
    """``objective.vllm.mode=colocate`` (see the module docstring). ``model_path``: what
    ``vllm.LLM`` is built from (its architecture; its weights are replaced at the first sync)."""

    def __init__(self, objective: Any, *, model_path: str, tokenizer_path: str | None, stop_ids: Sequence[int],
                 max_model_len: int, seed: int, world_size: int = 1, require_logprobs: bool = False) -> None:
        vllm = require_vllm()
        if not torch.cuda.is_available():
            raise RolloutError("objective.vllm.mode=colocate runs vLLM on the trainer's GPU: no CUDA device here")
        v = objective.vllm
        # the engine in this process, so load_weights reaches its model without copying the weights elsewhere
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs: dict[str, Any] = dict(gpu_memory_utilization=float(v.gpu_memory_utilization), dtype=v.dtype,
                                      enable_sleep_mode=bool(v.enable_sleep_mode))
        if world_size > 1:  # one engine per rank, inside the trainer's process group (as torchrun launches it)
            kwargs["distributed_executor_backend"] = "external_launcher"
        # the sampled tokens' log-probs after temperature and the other processing, as the trainer scores them
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(dict(v.llm_kwargs))
        self.require_logprobs = require_logprobs
        self.sampled_logprobs: list[list[float]] | None = None  # the last generate's, NaN where vLLM gave none
        self.vllm, self.objective, self.stop_ids = vllm, objective, list(stop_ids)
        self.sampling = Sampling.of(objective)
        self.llm = build_llm(vllm, model=model_path, tokenizer=tokenizer_path, seed=int(seed),
                             max_model_len=int(v.max_model_len or max_model_len), **kwargs)
        self.sleeping = False
        self.syncs = 0

    @classmethod
    def build(cls, objective: Any, **kwargs: Any) -> "ColocateEngine":
        keys = ("model_path", "tokenizer_path", "stop_ids", "max_model_len", "seed", "world_size", "require_logprobs")
        return cls(objective, **{k: kwargs[k] for k in keys if k in kwargs})

    def sync(self, model: nn.Module, step: int) -> None:
        """The policy's full weights (LoRA merged, shards gathered) loaded into the engine's model."""
        weights = merged_weights(model)
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

        def load(m: nn.Module) -> None:  # runs on the engine's model (vLLM's classes take HF checkpoint names)
            m.load_weights(weights=weights.items())

        self.llm.apply_model(load)
        self.llm.reset_prefix_cache()  # cached KV of the old weights would leak into the new rollout
        self.syncs += 1

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int] | None,
                 sampling: Sampling | None = None) -> list[list[int]]:
        outs = llm_generate(self.vllm, self.llm, prompts, sampling or self.sampling, self.stop_ids, n=n,
                            seeds=seeds if seeds is not None else [0] * len(prompts), logprobs=True, use_tqdm=False)
        choices = [c for out in outs for c in sorted(out.outputs, key=lambda c: c.index)]
        rows = [list(c.token_ids) for c in choices]
        self.sampled_logprobs = []
        for i, c in enumerate(choices):  # per position {token id: Logprob}; the sampled token's entry
            per = getattr(c, "logprobs", None)
            if per is None and self.require_logprobs:
                raise RolloutError(f"objective.vllm: vLLM returned no log-probs for completion {i} (asked with "
                                   "logprobs=0): objective.vllm_importance_sampling_correction needs them")
            self.sampled_logprobs.append([math.nan] * len(rows[i]) if per is None else
                                         [float(d[t].logprob) if t in d else math.nan for d, t in zip(per, rows[i])])
        if self.objective.vllm.enable_sleep_mode:  # the KV cache and weights freed for the training step
            self.llm.sleep(level=2)
            self.sleeping = True
        return rows

    def close(self) -> None:
        self.llm = None
