"""Per-rank memory of one training step of a run, simulated on this CPU without allocating it.

    python -m rolemrc.memory experiment=rolemrc_llama_sft --simulate          # the paper recipe, 4 ranks
    python -m rolemrc.memory experiment=rolemrc_llama_dpo trainer.devices=8 --simulate --json

:func:`simulate` builds the run's own parts the way training does, on the meta device: the model
(:func:`rolemrc.models.loading.load_model`: dtype, attention, activation checkpointing, LoRA, the
log-prob head), the objective's module (with the module builder the caller hands it: the run's
:func:`rolemrc.run.build.build_module`: precision policy, the DPO reference copy or adapter), the FSDP2 units (:func:`rolemrc.models.sharding.shard_model`, over
a ``trainer.devices x trainer.num_nodes`` mesh of a fake process group), then materialises it
under ``FakeTensorMode`` (tensors with shapes and dtypes, no storage) and runs one optimizer step
(forward, backward, AdamW) on a micro-batch of the run's shape, made by the run's own collator:
``data.batch_size`` rows of ``data.max_length`` tokens (DPO: prompt ``data.max_prompt_length``,
chosen and rejected responses filling the rest; packing: packs of ``max_length`` tokens).
``torch.distributed._tools`` trackers (``FSDPMemTracker`` under FSDP, ``MemTracker`` otherwise)
record the per-rank peak by category. An objective that samples its own data (GRPO: its
``memory_rollout``) has a second phase, tracked first: its rollout, transformers ``generate`` run
under the same fake tensors and tracker (:func:`_rollout_phase`: the prefill and the last
decoding step, where its memory peaks); the peak is the larger phase's (``Simulation.phase``).

What it counts and what it does not:

- every position of the micro-batch is full (no padding) and every response position is trained
  (SFT: every token): the longest rows the config allows, an upper bound for the lm_head's share;
- AdamW runs its ``foreach`` implementation (torch's default for CUDA tensors), whose temporaries
  are part of the peak;
- not counted: the CUDA context and NCCL buffers, the caching allocator's fragmentation, kernels'
  workspaces (cuBLAS, flash-attention): :data:`HEADROOM` of the device is left for them;
- 4-bit QLoRA cannot be simulated (bitsandbytes quantizes real tensors); the formula of
  :mod:`rolemrc.sizing.formula` serves it.

The simulator imports no part of the run: the caller hands it the module builder (``build(step,
model, run_dir=...) -> LightningModule``) and the world size (``trainer.devices x trainer.num_nodes`` as the run
counts them). The fake process group is global state of ``torch.distributed``: :func:`simulate`
tears it down before returning, and a training run's setup simulates in a child process
(:func:`rolemrc.sizing.decide.simulate_in_subprocess`, ``python -m rolemrc.sizing.simulate
<spec.json>``: the builder travels by its import name), so its own process group is never touched.
This module is imported only where a simulation runs (``--simulate``, the child process).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf, open_dict
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from rolemrc import ASSETS
from rolemrc.config import TrainStep, checkpointing_setting, plain, register, source_group
from rolemrc.data.collate import STEP_TOTALS, collator, row_totals
from rolemrc.models.loading import eval_mode, load_model, load_tokenizer
from rolemrc.models.precision import cast_trainable
from rolemrc.models.sharding import shard_model
from rolemrc.modules.reference import Reference
from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.rollout.hf import hf_generate
from rolemrc.sizing.result import GIB, HEADROOM, Simulation, SimulationUnavailable, step_peak

log = logging.getLogger(__name__)
# What the run hands the simulator to build the objective's module: ``build(step, model, run_dir=...)``,
# the run's :func:`rolemrc.run.build.build_module`.
ModuleBuilder = Callable[[Any, torch.nn.Module], Any]


# ---------------------------------------------------------------- the run's architecture

def architecture_config(model_cfg: Any) -> dict[str, Any]:
    """The model's ``config.json`` as a dict: ``model.path``'s own when it is a local folder, else
    ``model.architecture`` (a folder, or a shipped one under ``rolemrc/assets/architectures``), else
    the tiny model's ``init`` (random-init models). Raises :class:`SimulationUnavailable` otherwise."""
    path = None if OmegaConf.is_missing(model_cfg, "path") else model_cfg.path
    if path is not None and (Path(path).expanduser() / "config.json").is_file():
        return json.loads((Path(path).expanduser() / "config.json").read_text())
    arch = model_cfg.get("architecture")
    if arch:
        folder = Path(arch).expanduser()
        if not (folder / "config.json").is_file():
            folder = Path(ASSETS) / "architectures" / arch
        if not (folder / "config.json").is_file():
            raise SimulationUnavailable(f"model.architecture={arch}: no config.json there nor in "
                                        f"rolemrc/assets/architectures")
        return json.loads((folder / "config.json").read_text())
    if path is None:
        return {"model_type": model_cfg.arch, **plain(model_cfg.init)}
    raise SimulationUnavailable(f"model.path={path} is not a local folder with a config.json and model.architecture "
                                "is not set: no shapes to simulate")


class _Vocabulary:
    """What :func:`~rolemrc.models.loading.load_model` reads of a tokenizer to size a random-init
    model, from the architecture's ``config.json`` (the hub models' tokenizers are not needed)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.vocab_size = spec["vocab_size"]
        eos = spec.get("eos_token_id")
        self.bos_token_id = spec.get("bos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.pad_token_id = spec.get("pad_token_id", self.eos_token_id)

    def __len__(self) -> int:
        return self.vocab_size


def _sim_model_cfg(step: TrainStep, checkpointing: bool) -> tuple[Any, Any]:
    """(model config that builds the run's architecture from its config, without weights; the
    tokenizer or its stand-in)."""
    spec = architecture_config(step.model)
    m = copy.deepcopy(step.model)
    with open_dict(m):
        if spec is not None and ("vocab_size" in spec or OmegaConf.is_missing(m, "path") or m.path is not None):
            init = {k: v for k, v in spec.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                                "transformers_version", "dtype")}
            m.init = init
            m.arch = spec.get("model_type", m.arch)
        m.path = None
        m.gradient_checkpointing = checkpointing
        m.kernels = "none"  # GPU kernels (Triton) do not run on fake CPU tensors
    if "vocab_size" in spec:
        tokenizer: Any = _Vocabulary(spec)
    else:  # a tiny random-init model sized by its shipped tokenizer, as training sizes it
        tokenizer = load_tokenizer(step.model)
    return m, tokenizer


# ---------------------------------------------------------------- the micro-batch

def _rows(step: TrainStep, batch_size: int, vocab: int, length: int | None = None) -> list[Any]:
    """``batch_size`` encoded rows (SFT) or pairs of the longest shape the config allows (or of
    ``length`` tokens)."""
    full = int(step.data.max_length)
    length = length or full
    tok = min(5, vocab - 1)
    if not step.entry.pairs:
        return [{"input_ids": [tok] * length, "labels": [tok] * length, "index": i} for i in range(batch_size)]
    prompt = int(step.data.get("max_prompt_length") or full // 2) * length // full
    response = max(1, length - prompt)
    if _unpaired(step):  # one row per example (KTO on data.unpaired), desirable and not alternating
        return [{"prompt_ids": [tok] * prompt, "completion_ids": [tok] * response, "label": i % 2 == 0, "index": i}
                for i in range(batch_size)]
    return [{"prompt_ids": [tok] * prompt, "chosen_ids": [tok] * response, "rejected_ids": [tok] * response,
             "index": i} for i in range(batch_size)]


def _batch(step: TrainStep, module: Any, batch_size: int, vocab: int, length: int | None = None) -> dict[str, torch.Tensor]:
    """The micro-batch as the run's collator makes it, with the step totals the losses divide by."""
    own = module.memory_batch(step, batch_size, vocab, length)  # an objective that lays out its own (GRPO's rollouts)
    if own is not None:
        return own
    rows = _rows(step, batch_size, vocab, length)
    kind = "unpaired" if _unpaired(step) else "pairs" if step.entry.pairs else "sft"
    share = kind == "pairs" and bool(step.objective.get("share_prompt", False))
    batch = collator(kind, 0, bool(step.data.get("packing")), share)(rows)
    # Packed rows (and shared-prompt pairs) run as full causal rows: the per-piece kernels read the
    # piece boundaries back from the tensor (values fake tensors have not) and hold no more memory
    # than one causal row (model.packed_attention=mask, a [T x T] additive mask, would hold more).
    batch.pop("segments", None)
    # Full rows: an all-ones attention mask, which transformers drops for causal attention anyway
    # (checking it reads tensor values, which fake tensors have not).
    if "attention_mask" in batch and bool(batch["attention_mask"].all()):
        del batch["attention_mask"]
    for name, total in zip(STEP_TOTALS[kind], map(sum, zip(*(row_totals(r) for r in rows)))):
        batch[f"step_{name}"] = torch.tensor(float(total), dtype=torch.float64)
    return batch


class _KnownMasks(torch.utils._python_dispatch.TorchDispatchMode):
    """Fake tensors have no values, so a boolean-mask index (the log-prob head gathers the trained
    positions: ``hidden[labels != -100]``) has no known size. The micro-batch is built here, so the
    count of trained positions is known: masks of that shape index as that many positions."""

    def __init__(self, counts: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        self.counts = counts
        self.stop = False  # the answer to a boolean read: True once generate's decoding budget is spent (_Budget)

    def _positions(self, mask: torch.Tensor) -> list[torch.Tensor]:
        shape = tuple(mask.shape)
        if shape not in self.counts:
            raise SimulationUnavailable(f"a boolean mask of shape {shape} indexes a tensor in the step; only the "
                                        f"trained-position masks {sorted(self.counts)} have a known size")
        flat = torch.empty((self.counts[shape], len(shape)), dtype=torch.long, device=mask.device)
        return list(flat.unbind(1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default:
            return torch.stack(self._positions(args[0]), dim=1)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.bool:
            # A boolean read back is an input check (``bool((labels >= vocab).any())``), which the
            # micro-batch built here passes, or generate's "every sequence finished?", which only
            # its token budget ends (:class:`_Budget`): no sequence stops early.
            return self.stop
        if func is torch.ops.aten.index.Tensor:
            src, indices = args
            if any(i is not None and i.dtype == torch.bool for i in indices):
                flat: list[Any] = []
                for i in indices:
                    flat.extend(self._positions(i) if i is not None and i.dtype == torch.bool else [i])
                return func(src, flat)
        return func(*args, **kwargs)


def _mask_counts(module: Any, batch: dict[str, torch.Tensor]) -> dict[tuple[int, ...], int]:
    """The scored positions of the module's step (its ``trained_labels``: an objective that scores
    more than the responses, ORPO's prompt NLL, says so there)."""
    labels = module.trained_labels(batch)
    counts = {tuple(labels.shape): int((labels != IGNORE_INDEX).sum())}
    return {**counts, **module.memory_mask_counts(batch)}  # other masks of known size in its step


# ---------------------------------------------------------------- the step

def _unpaired(step: TrainStep) -> bool:
    """Whether the run's rows are single examples (data kind unpaired with ``data.unpaired`` given)."""
    return source_group(step.entry.data, step.data) == "unpaired"


def _simulated_reference(module: Any) -> None:
    """The step's passes without gradient (the module's ``no_grad_passes``: a reference's, KTO's KL
    rows') as the step will run them: a precomputed reference's is a table lookup (zeros of the
    log-probs' shape: no weights, no forward); the others run as module calls (:class:`_Call`)."""
    precomputed = module.reference is not None and module.reference.mode == "precomputed"
    for name in module.no_grad_passes:
        # in the instance's __dict__: nn.Module.__setattr__ would register it as a submodule instead
        module.__dict__[name] = (_lookup if precomputed and name == "reference_logps"
                                 else _Call(getattr(module, name)))


def _lookup(batch: dict[str, torch.Tensor], stage: str = "train") -> torch.Tensor:
    """A precomputed table's reference log-probs of a batch's pairs (zeros: no weights, no forward)."""
    return torch.zeros(2 * batch["index"].shape[0], dtype=torch.float32, device=batch["input_ids"].device)


class _TableStandIn(Reference):
    """A precomputed reference in the simulation: no table, no weights; its lookups (KTO's KL
    columns after a batch's rows) are zeros, two columns per row."""

    mode = "precomputed"

    def logps(self, module: Any, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        return torch.zeros(2 * batch["input_ids"].shape[0], dtype=torch.float32, device=batch["input_ids"].device)


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    kind, _, mode = str(precision).partition("-")
    if mode == "mixed" and kind in ("bf16", "16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if kind == "bf16" else torch.float16)
    return contextlib.nullcontext()


def _build(step: TrainStep, checkpointing: bool, build: ModuleBuilder, device: str = "meta") -> tuple[Any, Any]:
    """(the run's module on ``device`` (meta; cpu for a real validation step), built by ``build``;
    its vocabulary size)."""
    if step.model.quantization.load_in_4bit:
        raise SimulationUnavailable("4-bit QLoRA cannot be simulated (bitsandbytes quantizes real tensors)")
    model_cfg, tokenizer = _sim_model_cfg(step, checkpointing)
    with torch.device(device):
        model = load_model(model_cfg, tokenizer, head=step.entry.head)  # a reward model: its score head
    objective = copy.deepcopy(step.objective)
    precomputed = step.entry.reference and step.objective.reference == "precomputed"
    if precomputed:
        with open_dict(objective):
            objective.reference = "adapter" if step.model.peft.enabled else "copy"
    # build_module names a precomputed reference's cache folder after the run folder; nothing is
    # written (the simulation holds no precomputed reference) and no run folder exists.
    module = build(replace(step, model=model_cfg, objective=objective), model, run_dir=tempfile.gettempdir())
    if precomputed:
        module.reference = _TableStandIn()  # no reference weights held
    _simulated_reference(module)
    return module, len(tokenizer)


def _configure(module: Any, mesh: Any) -> None:
    """What ``configure_model`` does (DPO: the copy stored in the frozen dtype; trainable weights
    fp32 masters; FSDP2 units), on meta tensors."""
    ref = module.ref_model
    if ref is not None and next(ref.parameters()).dtype != module.policy.frozen:
        ref.to(dtype=module.policy.frozen)
    for m in module.models_to_shard():
        if mesh is None:
            cast_trainable(m, module.policy.master)
        else:
            shard_model(m, {"data_parallel": mesh}, module.sharding, module.policy.master)


def _optimizer(module: Any) -> torch.optim.Optimizer:
    o = module.optim
    params = [p for p in module.model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                             foreach=True)


class _Call(torch.nn.Module):
    """A function (``generate``, a reference forward) as a module call: the trackers take a second
    forward of the same top-level unit in one step (the adapter reference reuses the policy's) as
    the next iteration unless it runs inside another module's forward."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.__dict__["fn"] = fn  # not a submodule: nothing to register

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _budget(length: int, known: _KnownMasks | None) -> Any:
    """A stopping criterion of ``generate`` that ends it at ``length`` tokens under fake tensors:
    the loop's "every sequence finished?" reads a value fake tensors have not, so ``known`` answers
    it, True once the sequences reach ``length``. It stops nothing itself (real tensors: generate's
    own max-length check ends the loop at the same length)."""
    class Budget(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if known is not None:
                known.stop = input_ids.shape[1] >= length
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Budget()


def kv_cache_bytes(model_config: Any, sequences: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a ``DynamicCache`` holding ``tokens`` positions of ``sequences`` rows: per layer a
    key and a value tensor ``[sequences, kv_heads, tokens, head_dim]`` of ``dtype``."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * sequences * kv * tokens * head_dim * torch.finfo(dtype).bits // 8


def _rollout_phase(module: Any, spec: dict[str, Any], precision: str, known: _KnownMasks | None) -> dict[str, Any]:
    """An objective's rollout (its ``memory_rollout`` spec: ``sequences`` rows of ``prompt`` tokens,
    ``completion`` new tokens, ``sampling``: a :class:`rolemrc.rollout.Sampling`), as transformers ``generate`` runs it
    (eval mode, no gradient, the run's autocast, KV cache), at the two steps where its memory
    peaks: the prefill (the prompts' forward and their cache) and the last decoding step (the cache
    of ``prompt + completion - 2`` positions grown by one, the step's logits and sampling); the
    steps between hold less (a shorter cache, the same one-token transients). Every sequence runs
    to ``completion`` tokens (none stops early). Returns the cache's layout."""
    model, n, prompt, completion = module.model, spec["sequences"], spec["prompt"], spec["completion"]
    config = model.config
    eos = config.eos_token_id if config.eos_token_id is not None else 0
    pad = eos[0] if isinstance(eos, list) else eos
    tok = min(5, config.get_text_config().vocab_size - 1)

    def run(length: int, cache: Any = None) -> Any:
        ids = torch.full((n, length), tok, dtype=torch.long)
        try:
            return hf_generate(model, ids, torch.ones_like(ids), replace(spec["sampling"], max_new_tokens=1),
                               pad_id=pad, stop_ids=eos, past_key_values=cache, return_dict_in_generate=True,
                               stopping_criteria=StoppingCriteriaList([_budget(length + 1, known)]))
        finally:
            if known is not None:
                known.stop = False

    def both() -> list[tuple[tuple[int, ...], torch.dtype]]:
        out = run(prompt)  # the prefill
        layers = [(tuple(layer.keys.shape), layer.keys.dtype) for layer in out.past_key_values.layers]
        del out
        if completion > 1:  # the last decoding step, on the cache the earlier ones left
            cache = DynamicCache()
            for i, (shape, dtype) in enumerate(layers):
                full = (*shape[:2], prompt + completion - 2, *shape[3:])
                cache.update(torch.zeros(full, dtype=dtype), torch.zeros(full, dtype=dtype), i)
            out = run(prompt + completion - 1, cache)
            del out, cache
        return layers

    with torch.no_grad(), eval_mode(model), _autocast(precision):
        layers = _Call(both)()  # one module call around both: the trackers' single iteration
    dtype = layers[0][1]
    return {"sequences": n, "prompt_tokens": prompt, "completion_tokens": completion,
            "kv_cache_bytes": kv_cache_bytes(config, n, prompt + completion - 1, dtype), "kv_dtype": str(dtype)}


class _NoHook:
    """A stand-in hook handle (nothing to remove)."""

    def remove(self) -> None:
        pass


def _tracker(module: Any, optimizer: torch.optim.Optimizer, fsdp: bool) -> Any:
    class TrainableMemTracker(MemTracker):
        """MemTracker with its gradient hooks on trainable parameters only: torch's registers one on
        every parameter of each module it enters, which raises on a frozen one (a reference copy,
        LoRA's base weights). A frozen parameter gets a no-op handle, so torch hooks it no more."""

        def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                             install_grad_hooks: bool = True) -> tuple[int, int]:
            if install_grad_hooks:
                for p in module.parameters():
                    if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    if not fsdp:
        tracker = TrainableMemTracker()
        tracker.track_external(*module.models_to_shard(), optimizer)
        return tracker

    class RunTracker(FSDPMemTracker):
        """FSDPMemTracker over every FSDP unit of the run: rolemrc shards the decoder layers, the
        embeddings, the decoder and the head (and a DPO reference copy) as separate roots, with no
        unit at the top; the tracker instruments the FSDP modules under ``_root_mod``."""

        def __init__(self, roots: list[torch.nn.Module]) -> None:
            first = next(m for r in roots for m in r.modules() if isinstance(m, FSDPModule))
            super().__init__(first, optimizer)
            self._root_mod = torch.nn.ModuleList(roots)

    return RunTracker(module.models_to_shard())


def _one_step(module: Any, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], precision: str,
              after_backward: Any = None) -> None:
    with _autocast(precision):  # the loss as the module's training_step computes it, without the trainer's logging
        loss = module.step_loss(batch)[0]
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(step: TrainStep, *, checkpointing: bool, batch_size: int, world: int, fake: bool,
             build: ModuleBuilder) -> Simulation:
    """Build the run (its module by ``build``) under an initialised process group of ``world``
    ranks (fake or real) and track one optimizer step. ``fake``: under ``FakeTensorMode`` (no
    memory allocated)."""
    fsdp = step.strategy.name == "fsdp"
    mesh = None
    if fsdp:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))  # before fake mode
    module, vocab = _build(step, checkpointing, build, "meta" if fake else "cpu")
    module.model.train()
    for m in module.models_to_shard()[1:]:
        m.eval()
    # a tiny step first: AdamW's states exist in the tracked step; each batch as the trainer hands
    # it to the module (its on_before_batch_transfer: KTO's KL rows are built there)
    warm = module.on_before_batch_transfer(_batch(step, module, 1, vocab, 16), 0)
    batch = module.on_before_batch_transfer(_batch(step, module, batch_size, vocab), 0)
    counts = {**_mask_counts(module, warm), **_mask_counts(module, batch)}
    _configure(module, mesh)
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # to_empty reads the meta tensors
            for m in module.models_to_shard():  # meta tensors -> storage-less fake ones on the CPU
                m.to_empty(device="cpu")
            warm = {k: mode.from_tensor(v) for k, v in warm.items()}
            batch = {k: mode.from_tensor(v) for k, v in batch.items()}
            with _KnownMasks(counts) as known:
                return _track(step, module, warm, batch, fsdp, world, checkpointing, "fake", batch_size, known)
    return _track(step, module, warm, batch, fsdp, world, checkpointing, dist.get_backend() if world > 1 else "",
                  batch_size)


def _peak(tracker: Any) -> tuple[Any, int, dict[str, int]]:
    """(the tracked device, its peak bytes, the peak's bytes by category)."""
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(d for d in peak if peak[d].get("Total", 0) > 0), next(iter(peak)))
    snap = {getattr(k, "value", k): int(v) for k, v in peak[device].items()}
    return device, snap.pop("Total"), snap


def _track(step: TrainStep, module: Any, warm: dict, batch: dict, fsdp: bool, world: int, checkpointing: bool,
           kind: str, batch_size: int, known: _KnownMasks | None = None) -> Simulation:
    """The tracked phases of one optimizer step after a warm-up step (AdamW's states exist, the
    gradients are freed as the trainer's ``zero_grad`` leaves them): an objective's rollout first
    (its ``memory_rollout``: GRPO's ``generate``), then the step itself (forward, backward, AdamW),
    with the tensors the objective keeps through the step (its ``memory_resident``) allocated
    first. The peak is the larger phase's."""
    optimizer = _optimizer(module)
    _one_step(module, optimizer, warm, step.trainer.precision)
    phases: dict[str, dict[str, Any]] = {}
    rollout: dict[str, Any] = {}
    spec = module.memory_rollout(step, batch_size)  # None: no rollout (or not on this device: vLLM)
    if spec is not None:
        tracker = _tracker(module, optimizer, fsdp)
        with tracker:
            rollout = _rollout_phase(module, spec, step.trainer.precision, known)
        _, total, snap = _peak(tracker)
        phases["rollout"] = {"peak_bytes": total, "by_category": snap}
    tracker = _tracker(module, optimizer, fsdp)
    if fsdp:
        tracker.track_inputs((batch,))
    seen: dict[str, Any] = {}
    with tracker:
        kept = module.memory_resident(step, batch)  # noqa: F841 (held through the step)
        _one_step(module, optimizer, batch, step.trainer.precision,
                  after_backward=lambda: seen.update(tracker.get_tracker_snapshot("current")))
        del kept
    device, total, snap = _peak(tracker)
    phases["step"] = {"peak_bytes": total, "by_category": snap}
    phase = max(phases, key=lambda name: phases[name]["peak_bytes"])
    after = {getattr(k, "value", k): int(v) for k, v in seen.get(device, {}).items()}
    rows = batch["input_ids"].shape[0]
    return Simulation(ranks=world, peak_bytes=phases[phase]["peak_bytes"], by_category=phases[phase]["by_category"],
                      checkpointing=checkpointing, rows=rows, tokens=int(batch["input_ids"].numel()),
                      strategy=step.strategy.name, tracker="FSDPMemTracker" if fsdp else "MemTracker",
                      after_backward=after, kind=kind, note=module.memory_note,
                      phase=phase, phases=phases if spec is not None else {}, rollout=rollout)


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks (this process is rank 0), destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's testing package: only here

    if dist.is_initialized():
        raise SimulationUnavailable("a process group is already initialised in this process: simulate in a "
                                    "fresh process (simulate_in_subprocess)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate(step: TrainStep, *, checkpointing: bool, build: ModuleBuilder, world: int,
             batch_size: int | None = None) -> Simulation:
    """One optimizer step of the run ``step`` (a composed training config) at micro-batch
    ``batch_size`` (default ``data.batch_size``), with activation checkpointing on or off,
    simulated on ``world`` fake ranks (the run's ``trainer.devices x trainer.num_nodes``), its
    module built by ``build`` (the run's ``build_module``); per-rank peak."""
    batch_size = int(batch_size or step.data.batch_size)
    with fake_process_group(world):
        return run_step(step, checkpointing=checkpointing, batch_size=batch_size, world=world, fake=True, build=build)


def report(step: TrainStep, *, build: ModuleBuilder, world: int) -> dict[str, Any]:
    """The simulated per-rank peak of the run ``step`` (:func:`simulate`) at its configured
    activation checkpointing; for ``auto`` both with and without it, the choice being what setup
    would make (off where the peak without it fits). Keys: ``ranks``, ``peak_gib``,
    ``by_category`` (GiB, the tracker's names), ``gradient_checkpointing`` (``on``/``off`` peaks in
    GiB, null where not simulated), ``fits``, and what the step was."""
    device_gb = float(step.runtime.device_memory_gb)
    limit = HEADROOM * device_gb * GIB
    setting = checkpointing_setting(step.model.gradient_checkpointing)
    sims = {}
    for on in ((False, True) if setting == "auto" else (bool(setting),)):
        sims[on] = simulate(step, checkpointing=on, build=build, world=world)
    if setting == "auto":  # the step decides: a rollout (generate) keeps no activations to checkpoint
        chosen = False if step_peak(sims[False]) <= limit else True
    else:
        chosen = bool(setting)
    sim = sims[chosen]
    return {
        "ranks": sim.ranks,
        "peak_gib": round(sim.peak_gib, 3),
        "by_category": {k: round(v / GIB, 3) for k, v in sim.by_category.items()},
        "gradient_checkpointing": {"on": round(sims[True].peak_gib, 3) if True in sims else None,
                                   "off": round(sims[False].peak_gib, 3) if False in sims else None},
        "fits": sim.peak_bytes <= limit,
        "checkpointing": "on" if chosen else "off",
        "setting": str(setting).lower(),
        "device_memory_gb": device_gb,
        "headroom": HEADROOM,
        "strategy": sim.strategy,
        "note": sim.note,
        "micro_batch": {"rows": sim.rows, "tokens": sim.tokens},
        "tracker": sim.tracker,
        # an objective with a rollout (GRPO): each phase's peak, and which sets the run's
        "phase": sim.phase,
        "phases": {name: {"peak_gib": round(p["peak_bytes"] / GIB, 3),
                          "by_category": {k: round(v / GIB, 3) for k, v in p["by_category"].items()}}
                   for name, p in sim.phases.items()},
        "rollout": {**sim.rollout, **({"kv_cache_gib": round(sim.rollout["kv_cache_bytes"] / GIB, 3)}
                                      if "kv_cache_bytes" in sim.rollout else {})},
    }


# ---------------------------------------------------------------- in a child process

def resolve_builder(name: str) -> ModuleBuilder:
    """``"package.module:function"`` (:func:`rolemrc.sizing.decide.builder_name`) -> the builder."""
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _child(argv: list[str]) -> int:
    """``<spec.json>``: simulate and print the result as JSON. ``--real <spec.json> <out.json>``: one
    rank of the same step really run (gloo; ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` set by the launcher), rank 0 writing its tracked result: what the simulation is
    validated against (tests/test_memory_sim.py). The spec names the module builder by its import
    name (``build``) and the world size (``world``) the run handed."""
    register()
    real = argv[0] == "--real"
    spec = json.loads(Path(argv[1 if real else 0]).read_text())
    step = TrainStep.of(OmegaConf.create(spec["step"]))
    build = resolve_builder(spec["build"])
    if not real:
        sim = simulate(step, checkpointing=spec["checkpointing"], build=build, world=int(spec["world"]),
                       batch_size=spec["batch_size"])
        print(json.dumps(asdict(sim)))
        return 0
    dist.init_process_group("gloo")
    try:
        sim = run_step(step, checkpointing=spec["checkpointing"], batch_size=int(spec["batch_size"] or step.data.batch_size),
                       world=dist.get_world_size(), fake=False, build=build)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:
        Path(argv[2]).write_text(json.dumps(asdict(sim)))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
