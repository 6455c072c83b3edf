"""What every throughput benchmark shares: a random-init Llama-architecture model (``MODELS``:
the 8B-shaped proxy or the output-layer-heavy 128k-vocabulary model), synthetic RoleMRC-shaped
data, the precision, the allocator settings, and step timers that measure rolemrc (Lightning) and
TRL (transformers Trainer) the same way.

Timing: wall clock between the ends of consecutive optimizer steps (data loading, forward,
backward, optimizer all included), after ``warmup`` steps. Tokens: non-padding input tokens of
the policy's forward (what a padded row wastes is not counted). Samples: conversations (SFT) or
preference pairs (DPO).
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# stack.md: keep freed memory in the process (2-3x faster CPU steps); every contender runs with it.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736", "MALLOC_TOP_PAD_": "1073741824"}
# benchmarks/gpu.py: FlopCounterMode adds Python work to every op, which a GPU step's time would
# include; there it counts only the first ROLEMRC_BENCH_FLOP_STEPS steps (the warm-up), and the timed
# steps' FLOPs are their tokens x the counted steps' FLOPs per token. Unset: every step is counted.
FLOP_STEPS = int(os.environ.get("ROLEMRC_BENCH_FLOP_STEPS", "0")) or None


# The benchmark models (random init, Llama architecture, GQA 8/2 heads, hidden 512):
# - proxy: Llama-3.1-8B's FLOP shares at a CPU-sized width: the output layer is ~8% of the
#   weight FLOPs (4096 x 512 head vs 8 x 2.8M decoder weights; 8B: 525M of ~7.5B). What users train.
# - head_heavy: vocabulary 128,256 with 4 layers: the 128k-wide output layer is ~85% of the weight
#   FLOPs, so whoever computes it at every position pays most. The log-prob-memory case, labelled so.
MODELS: dict[str, dict[str, Any]] = {
    "proxy": {"vocab": 4096, "hidden": 512, "layers": 8, "intermediate": 1408, "heads": 8, "kv_heads": 2},
    "head_heavy": {"vocab": 128256, "hidden": 512, "layers": 4, "intermediate": 1408, "heads": 8, "kv_heads": 2},
    # benchmarks/gpu.py: Llama-3.2-1B / -3B layer shapes with the 128k vocabulary (untied head).
    "llama_1b": {"vocab": 128256, "hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8},
    "llama_3b": {"vocab": 128256, "hidden": 3072, "layers": 28, "intermediate": 8192, "heads": 24, "kv_heads": 8},
}
MODEL_LABELS = {"proxy": "8B-shaped proxy (vocab 4096, 8 layers: output layer ~8% of weight FLOPs, as in Llama-3.1-8B)",
                "head_heavy": "output-layer-heavy (vocab 128,256, 4 layers: output layer ~85% of weight FLOPs)",
                "llama_1b": "1.5B Llama (Llama-3.2-1B layers, vocab 128,256, untied head)",
                "llama_3b": "3.6B Llama (Llama-3.2-3B layers, vocab 128,256, untied head)"}


@dataclass
class Spec:
    """Model, data and run sizes shared by all contenders (see run_all.py for the defaults used)."""

    model: str = "proxy"
    vocab: int = 4096
    hidden: int = 512
    layers: int = 8
    intermediate: int = 1408
    heads: int = 8
    kv_heads: int = 2
    # fp32 by default: this CPU has no native bf16 matmul (stack.md), so bf16-mixed measures the
    # emulation, not the frameworks. Both sides always run the same precision.
    precision: str = "fp32"  # fp32 | bf16
    n_sft: int = 96
    n_pairs: int = 48
    prompt_tokens: tuple[int, int] = (800, 1800)
    reply_tokens: tuple[int, int] = (40, 80)
    sft_max_length: int = 4200  # the paper's SFT length (every row padded to it there)
    dpo_max_length: int = 3000  # the paper's DPO length, prompt cut to 3/4 of it
    dpo_max_prompt_length: int = 2250
    # Per optimizer step, the same for every contender. TRL's default per-device batch is 8; smaller
    # ones keep each contender's process to a few minutes on the shared 2-core machine.
    sft_batch: int = 3  # conversations (ours, TRL packing: packed 4200-token rows holding about as many, ~2.9 each)
    dpo_batch: int = 2  # preference pairs (KTO: as many desirable and undesirable examples; reward model)
    # Online RL (GRPO, RLOO): rl_prompts prompts a step, each sampled num_generations times, every
    # completion exactly completion_length tokens (benchmarks/rl_throughput.py: fixed-length rollouts).
    rl_prompts: int = 1
    num_generations: int = 4
    completion_length: int = 32
    # Extra Hydra overrides for rolemrc's runs (benchmarks/gpu.py: strategy=fsdp, accelerator, ...).
    ours_overrides: list[str] = field(default_factory=list)
    warmup: int = 1
    steps: int = 2
    seed: int = 0

    @staticmethod
    def for_model(model: str, **kwargs: Any) -> "Spec":
        if model not in MODELS:
            raise SystemExit(f"--model {model!r}: expected one of {', '.join(MODELS)}")
        return Spec(model=model, **MODELS[model], **kwargs)

    @property
    def lightning_precision(self) -> str:
        return {"fp32": "32-true", "bf16": "bf16-mixed"}[self.precision]

    @property
    def dpo_pairs_used(self) -> int:
        """Pairs the timed DPO runs train on: exactly one pass, so a precomputed reference costs
        what it would per pair in a real epoch (both sides precompute only these)."""
        return (self.warmup + self.steps) * self.dpo_batch

    @property
    def rl_prompts_used(self) -> int:
        """Prompts the timed RL runs sample from: exactly one pass."""
        return (self.warmup + self.steps) * self.rl_prompts

    @staticmethod
    def load(work: Path) -> "Spec":
        raw = json.loads((work / "spec.json").read_text())
        raw["prompt_tokens"], raw["reply_tokens"] = tuple(raw["prompt_tokens"]), tuple(raw["reply_tokens"])
        return Spec(**raw)


def set_env() -> None:
    """Environment every contender process gets. glibc reads ``MALLOC_*`` only at start-up, so a
    process started without them re-executes itself with them (same allocator for everyone)."""
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_MODE", "disabled")


# ---------------------------------------------------------------- model and data

def _sentences() -> list[str]:
    """Sentences of the shipped sample data: realistic text for the tiny tokenizer."""
    text = []
    for line in (ROOT / "src/rolemrc/assets/sample/sft.jsonl").read_text().splitlines():
        for msg in json.loads(line)["conversations"]:
            text.append(msg["content"])
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text)) if len(s.split()) > 3]


def _text(rng: random.Random, sentences: list[str], tokenizer: Any, target: int) -> str:
    """Sentences appended until ``target`` tokens (within one sentence)."""
    parts: list[str] = []
    n = 0
    while n < target:
        s = rng.choice(sentences)
        parts.append(s)
        n += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
    return " ".join(parts)


def _reply(rng: random.Random, sentences: list[str], tokenizer: Any, target: int) -> str:
    ids = tokenizer(_text(rng, sentences, tokenizer, target + 10), add_special_tokens=False)["input_ids"][:target]
    return tokenizer.decode(ids).strip()


def prepare(work: Path, spec: Spec) -> dict[str, Any]:
    """Write ``work/model`` (HF folder: weights + tokenizer), ``work/sft.jsonl``, ``work/pairs.jsonl``
    and ``work/spec.json``; return token statistics of the data as rolemrc encodes it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rolemrc.data.readers import read_examples
    from rolemrc.data.templates import ChatFormat

    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ROOT / "src/rolemrc/assets/tokenizers/tiny-llama3")
    model_dir = work / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    tok.save_pretrained(model_dir)

    rng = random.Random(spec.seed)
    sentences = _sentences()

    def prompt() -> list[dict[str, str]]:
        system = ("You are Captain Mira Okafor, keeper of the Hollow Point lighthouse. Speech style: short, "
                  "salty sentences. Knowledge boundary: the sea, ships, weather; nothing else.\n\nPassages:\n")
        system += _text(rng, sentences, tok, rng.randint(*spec.prompt_tokens) - 40)
        return [{"role": "System", "content": system},
                {"role": "User", "content": "Looking at the passages, what happened at the harbour that night?"}]

    with (work / "sft.jsonl").open("w") as fh:
        for _ in range(spec.n_sft):
            conv = prompt() + [{"role": "Assistant", "content": _reply(rng, sentences, tok, rng.randint(*spec.reply_tokens))}]
            fh.write(json.dumps({"conversations": conv}) + "\n")
    with (work / "pairs.jsonl").open("w") as fh:
        for _ in range(max(spec.n_pairs, spec.dpo_pairs_used, spec.rl_prompts_used)):  # at least one pass of the timed runs
            fh.write(json.dumps({"prompt": prompt(),
                                 "chosen": _reply(rng, sentences, tok, rng.randint(*spec.reply_tokens)),
                                 "rejected": _reply(rng, sentences, tok, rng.randint(*spec.reply_tokens))}) + "\n")
    used = (work / "pairs.jsonl").read_text().splitlines()[: spec.dpo_pairs_used]
    (work / "pairs_used.jsonl").write_text("\n".join(used) + "\n")
    prompts = [json.dumps({"prompt": json.loads(line)["prompt"]}) for line in
               (work / "pairs.jsonl").read_text().splitlines()[: spec.rl_prompts_used]]
    (work / "prompts_used.jsonl").write_text("\n".join(prompts) + "\n")  # online RL: the pairs' prompts
    (work / "spec.json").write_text(json.dumps(asdict(spec), indent=2))

    chat = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    stats: dict[str, Any] = {}
    sft, _ = read_examples([_source(work / "sft.jsonl")], "sft", "raise", 0)
    lengths = [len(chat.encode_conversation(ex.messages).input_ids) for ex in sft]
    replies = [chat.encode_conversation(ex.messages).n_trained for ex in sft]
    pairs, _ = read_examples([_source(work / "pairs.jsonl")], "pairs", "raise", 0)
    encoded = [chat.encode_pair(p.prompt, p.chosen, p.rejected, 10**7, 10**6) for p in pairs]
    stats["sft"] = _describe(lengths) | {"reply_tokens": _describe(replies)}
    stats["pairs"] = {"prompt_tokens": _describe([len(e.prompt_ids) for e in encoded]),
                      "response_tokens": _describe([len(e.chosen_ids) for e in encoded] +
                                                   [len(e.rejected_ids) for e in encoded])}
    stats["model"] = {"name": spec.model, "label": MODEL_LABELS[spec.model], "arch": "llama", "parameters": n_params, "non_embedding_parameters":
                      n_params - 2 * spec.vocab * spec.hidden, **{k: getattr(spec, k) for k in
                      ("vocab", "hidden", "layers", "intermediate", "heads", "kv_heads")}}
    return stats


def _source(path: Path) -> dict[str, Any]:
    return {"path": str(path), "weight": 1.0}


def _describe(values: list[int]) -> dict[str, float]:
    return {"mean": round(sum(values) / len(values), 1), "min": min(values), "max": max(values), "n": len(values)}


# ---------------------------------------------------------------- rolemrc runs

def compose(overrides: list[str], run_dir: Path) -> Any:
    """``conf/train.yaml`` with ``overrides``, as ``python train.py ...`` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from rolemrc.config import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    return cfg


def rolemrc_overrides(work: Path, spec: Spec, objective: list[str], data: list[str]) -> list[str]:
    """What every rolemrc contender runs: the benchmark model, ``objective`` and ``data`` overrides,
    no validation, the spec's precision and run length, no logger, callbacks or export."""
    return [f"model.path={work / 'model'}", "model.name=bench", *objective, *data, "data.val_fraction=0",
            f"trainer.precision={spec.lightning_precision}", f"trainer.max_steps={spec.warmup + spec.steps}",
            "trainer.enable_progress_bar=false", "logger=none", "callbacks=none", "export.enabled=false",
            f"seed={spec.seed}", *spec.ours_overrides]


def run_rolemrc(overrides: list[str], *callbacks: Any) -> None:
    """``python train.py <overrides>`` in this process, with ``callbacks`` added (the step timer)."""
    import tempfile

    from rolemrc.run.train import run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(overrides, Path(tmp))
        for callback in callbacks:
            add_callback(callback)
        run(cfg)


def trl_args(config_class: Any, spec: Spec, output_dir: str, batch: int, **settings: Any) -> Any:
    """A TRL config (``SFTConfig``, ``DPOConfig``, ...) at its defaults except what every TRL
    contender shares: ``batch`` per device, the spec's run length, seed and precision, no reports,
    no saving; ``settings`` on top (the contender's variant, the objective's loss settings)."""
    import torch

    return config_class(output_dir=output_dir, per_device_train_batch_size=batch,
                        max_steps=spec.warmup + spec.steps, report_to="none", save_strategy="no", seed=spec.seed,
                        disable_tqdm=True, use_cpu=not torch.cuda.is_available(), bf16=spec.precision == "bf16",
                        **settings)


def trl_pairs(work: Path) -> list[dict[str, Any]]:
    """The used pairs in TRL's conversational preference format (its chat template applies)."""
    records = []
    for line in (work / "pairs_used.jsonl").read_text().splitlines():
        r = json.loads(line)
        records.append({"prompt": trl_messages(r["prompt"]), "chosen": [{"role": "assistant", "content": r["chosen"]}],
                        "rejected": [{"role": "assistant", "content": r["rejected"]}]})
    return records


def trl_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """rolemrc's messages (roles System/User/Assistant) with TRL's lower-case roles."""
    return [{"role": m["role"].lower(), "content": m["content"]} for m in messages]


def flop_counter() -> Any:
    """``torch.utils.flop_counter.FlopCounterMode`` counting model FLOPs (matmuls and attention,
    forward and backward). torch 2.13 has no formula for the CPU flash-attention kernels sdpa takes
    here (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), so they get torch's own
    sdpa formulas (full [T x T] scores, causal or not, as for every other attention kernel)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward})


class FlopSpan:
    """FLOPs counted between :meth:`start` and :meth:`stop` (a step, a reference pass)."""

    def __init__(self) -> None:
        self.counter: Any = None

    def start(self) -> None:
        self.counter = flop_counter()
        self.counter.__enter__()

    def stop(self) -> float:
        if self.counter is None:
            return 0.0
        self.counter.__exit__(None, None, None)
        flops, self.counter = float(self.counter.get_total_flops()), None
        return flops


def matmul_peak_gflops(size: int = 2048, repeats: int = 10) -> float:
    """This CPU's fp32 matmul rate: the best of ``repeats`` ``[size x size] @ [size x size]``
    products with torch's default threads (the rate the contenders' matmuls can reach)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


class _Steps:
    """Step-end timestamps with the tokens and samples of each step; summary after warm-up."""

    def __init__(self) -> None:
        self.records: list[tuple[float, float, float, float, float]] = []  # time, tokens, samples, slots, attn pairs
        self.flops: list[float] = []  # model FLOPs of each step (FlopCounterMode: forward, backward, reference)

    def add(self, tokens: float, samples: float, slots: float, pairs: float = 0.0, flops: float = 0.0) -> None:
        self.records.append((time.perf_counter(), tokens, samples, slots, pairs))
        self.flops.append(flops)

    def summary(self, warmup: int) -> dict[str, Any]:
        if len(self.records) <= warmup:
            raise RuntimeError(f"only {len(self.records)} steps recorded, {warmup} of them warm-up")
        start = self.records[warmup - 1][0] if warmup else None
        measured = self.records[warmup:]
        if start is None:
            raise ValueError("warmup must be >= 1: the first step has no start time")
        seconds = measured[-1][0] - start
        tokens = sum(r[1] for r in measured)
        samples = sum(r[2] for r in measured)
        slots = sum(r[3] for r in measured)
        pairs = sum(r[4] for r in measured)
        times = [b[0] - a[0] for a, b in zip(self.records[warmup - 1 :], measured)]
        step_flops = self.flops[warmup:]
        counted = "every timed step"
        if FLOP_STEPS is not None and FLOP_STEPS <= warmup:  # counted on the warm-up steps only
            per_token = sum(self.flops[:FLOP_STEPS]) / max(sum(r[1] for r in self.records[:FLOP_STEPS]), 1.0)
            step_flops = [per_token * r[1] for r in measured]
            counted = f"the first {FLOP_STEPS} (warm-up) steps, per token"
        flops = sum(step_flops)
        return {
            "flops": flops,  # model FLOPs of the timed steps
            "flops_counted_on": counted,
            "flops_per_step": flops / len(measured),
            "step_flops": step_flops,
            "steps": len(measured),
            "seconds": round(seconds, 3),
            "step_seconds": [round(t, 3) for t in times],
            "tokens": tokens,
            "samples": samples,
            "attended_pairs": pairs,  # causal (query, key) pairs inside each sequence: the attention FLOPs
            "padding_fraction": round(1 - tokens / max(slots, 1), 4),
            "tokens_per_s": tokens / seconds,
            "samples_per_s": samples / seconds,
        }


def lightning_timer() -> Any:
    """A Lightning callback recording every training step (tokens from the batch itself)."""
    import lightning as L

    from rolemrc.callbacks.throughput import batch_counts

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.steps = _Steps()
            self.fit_start = self.train_start = 0.0
            self.span = FlopSpan()
            self.precompute_flops = 0.0

        def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.fit_start = time.perf_counter()
            self.span.start()  # the module's on_fit_start (a precomputed reference pass) runs after this

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            self.precompute_flops = self.span.stop()
            self.train_start = time.perf_counter()  # after the module's on_fit_start (reference precompute)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if FLOP_STEPS is None or len(self.steps.records) < FLOP_STEPS:
                self.span.start()

        def precompute_seconds(self) -> float:
            return round(self.train_start - self.fit_start, 3)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            flops = self.span.stop()  # forward, backward (reference forward too), optimizer step
            real, _, samples, slots, pairs = batch_counts(batch).tolist()
            self.steps.add(real, samples, slots, pairs, flops)

    return StepTimer()


def add_callback(callback: Any) -> None:
    """Make the next rolemrc training run (``rolemrc.run.train.run``) use ``callback`` too."""
    import rolemrc.run.build as build

    original = build.build_callbacks
    build.build_callbacks = lambda cfg, **kw: [*original(cfg, **kw), callback]


def hf_timer(model: Any, pairs: bool) -> Any:
    """A transformers TrainerCallback recording every optimizer step; tokens are counted from the
    policy model's own forward inputs (a pre-hook), so nothing about the batches is assumed."""
    import torch
    from transformers import TrainerCallback

    class HFStepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps = _Steps()
            self.pending = [0.0, 0.0, 0.0, 0.0]
            self.span = FlopSpan()

        def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
            if FLOP_STEPS is None or len(self.steps.records) < FLOP_STEPS:
                self.span.start()

        def hook(self, module, args, kwargs) -> None:  # noqa: ANN001
            if not module.training:  # reference forwards (eval mode / no grad) are not counted
                return
            if not torch.is_grad_enabled():  # e.g. TRL's precompute_ref_log_probs pass
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            mask = kwargs.get("attention_mask")
            real = float(mask.sum()) if mask is not None else float(ids.numel())
            rows = ids.shape[0]
            pos = kwargs.get("position_ids")
            if mask is None and pos is not None and rows == 1:  # padding-free: sequences restart at 0
                starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[-1]]
                lengths = torch.tensor([b - a for a, b in zip(starts, starts[1:])], dtype=torch.float64)
                rows = len(lengths)
            elif mask is not None and mask.dim() == 2:
                lengths = mask.sum(-1).double()
            else:
                lengths = torch.full((ids.shape[0],), float(ids.shape[-1]), dtype=torch.float64)
            self.pending[0] += real
            self.pending[1] += rows / 2 if pairs else rows
            self.pending[2] += float(ids.numel())
            self.pending[3] += float((lengths * (lengths + 1) / 2).sum())

        def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
            self.steps.add(*self.pending, flops=self.span.stop())
            self.pending = [0.0, 0.0, 0.0, 0.0]

    timer = HFStepTimer()
    model.register_forward_pre_hook(timer.hook, with_kwargs=True)
    return timer


def peak_rss_mib() -> float:
    """This process's peak resident set (Linux: ru_maxrss in KiB). Every contender runs alone in
    its own process with the same allocator settings, so the figures compare."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def write_result(path: Path, result: dict[str, Any]) -> None:
    result["peak_rss_mib"] = peak_rss_mib()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        result["device_name"] = torch.cuda.get_device_name()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "step_seconds"}))
