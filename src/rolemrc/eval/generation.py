"""Generation backends for evaluation: greedy replies to test prompts, written as they finish.

Prompts are token ids from :meth:`rolemrc.data.templates.ChatFormat.encode_prompt` (the one
place that renders chat templates), so evaluation sees exactly the layout training used.

- ``hf``: transformers ``generate``, greedy, batched with LEFT padding (the new tokens of
  every row then start at the same column), prompts sorted longest first so a batch holds
  prompts of similar length and little padding is computed.
- ``vllm``: optional (GPU nodes, its own environment: vllm pins another torch/transformers),
  imported only when asked for.

Every finished batch is appended to ``generations.jsonl`` (flushed and fsynced), one line per
item: ``{"id", "task", "reply", "n_tokens", "stopped"}``. A rerun skips items already in the
file; a last line torn by a kill mid-write is cut off and regenerated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from rolemrc.data.schemas import TestItem

log = logging.getLogger(__name__)

Message = dict[str, str]
# restraint(model) -> a context manager active while the model generates (neuron restraint).
Restraint = Callable[[Any], ContextManager[Any]]

VLLM_MISSING = (
    "generation.backend=vllm needs the `vllm` package, which is not installed here. vllm pins its "
    "own torch/transformers versions that conflict with this stack: install it in a separate "
    "environment on a GPU node (python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm && "
    ".venv-vllm/bin/pip install -e . --no-deps) and run evaluate.py from there, or use "
    "generation.backend=hf."
)


def item_id(index: int, task: str, question: Sequence[Mapping[str, str]]) -> str:
    """Stable id of a test item: its position plus a hash of its task and conversation.

    The hash makes a rerun on a changed test file regenerate instead of reusing replies to
    different questions that happen to sit at the same position.
    """
    blob = json.dumps([task, [[m["role"], m["content"]] for m in question]], ensure_ascii=False)
    return f"{index:05d}-{hashlib.sha1(blob.encode('utf-8')).hexdigest()[:10]}"


@dataclass
class GenItem:
    """One prompt to answer."""

    id: str
    task: str
    prompt_ids: list[int]


@dataclass
class Generation:
    """One line of ``generations.jsonl``. ``n_tokens`` counts the new tokens including the
    stop token; ``stopped`` is False when the reply was cut at ``max_new_tokens``."""

    id: str
    task: str
    reply: str
    n_tokens: int
    stopped: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


@dataclass
class GenerationRun:
    """Replies in item order, and how many were made now vs read back from the file."""

    generations: list[Generation]
    n_new: int
    n_resumed: int

    @property
    def replies(self) -> list[str]:
        return [g.reply for g in self.generations]


# ---------------------------------------------------------------- the resumable file


class GenerationStore:
    """``generations.jsonl``: append-only, durable per batch, readable after a kill."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Generation]:
        """Finished generations by id. A torn last line (no newline: killed mid-write) is
        truncated away so the next append starts on a clean line; any other unreadable line
        is an error (the file was damaged some other way)."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # 0 when there is no complete line
        if end < len(data):
            log.warning("%s: dropping a torn last line (%d bytes; interrupted write)", self.path, len(data) - end)
            with self.path.open("r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        out: dict[str, Generation] = {}
        for lineno, raw in enumerate(data[:end].splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                gen = Generation(**json.loads(raw))
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(
                    f"{self.path}:{lineno}: unreadable generation line ({err}); delete the line or the file "
                    "to regenerate those items"
                ) from err
            out[gen.id] = gen
        return out

    def append(self, generations: Iterable[Generation]) -> None:
        """Write lines in one call, then flush and fsync: after this returns they survive a kill."""
        text = "".join(g.to_json() + "\n" for g in generations)
        if not text:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def check_settings(out_dir: str | Path, settings: Mapping[str, Any]) -> None:
    """Refuse to resume into a folder whose generations were made with other settings
    (another model, length limit, restraint...): mixing them would corrupt the scores."""
    path = Path(out_dir) / "generation_settings.json"
    settings = json.loads(json.dumps(dict(settings)))  # normalise tuples etc. for comparison
    if path.exists() and (Path(out_dir) / "generations.jsonl").exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = {k: (old.get(k), settings.get(k)) for k in set(old) | set(settings) if old.get(k) != settings.get(k)}
        if diff:
            shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{out_dir} holds generations made with other settings ({shown}); use a new out_dir, "
                "or delete generations.jsonl there to regenerate"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- hf backend


def stop_token_ids(tokenizer: Any, eot: str | None) -> list[int]:
    """eos plus the chat template's end-of-turn token: a base model fine-tuned on chat data
    ends its turn with ``<|eot_id|>``/``<|im_end|>`` while its eos may be another token."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if eot:
        eot_ids = tokenizer(eot, add_special_tokens=False)["input_ids"]
        if len(eot_ids) == 1:
            ids.append(int(eot_ids[0]))
        else:
            log.warning("end-of-turn marker %r is %d tokens, not one: generation stops at eos only", eot, len(eot_ids))
    if not ids:
        raise ValueError("the tokenizer has neither an eos token nor a one-token end-of-turn marker to stop at")
    return sorted(set(ids))


def greedy_generate_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    max_new_tokens: int,
    pad_id: int,
    stop_ids: Sequence[int],
    progress: bool = False,
    on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
) -> list[list[int]]:
    """Greedy new tokens for each prompt (in input order), each cut after its first stop token.

    Batches are taken from the prompts sorted longest first and left-padded. ``on_batch``
    receives ``(prompt indices, new token ids)`` as each batch finishes.
    """
    import torch
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"generation.batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    stops = set(int(s) for s in stop_ids)
    out: list[list[int] | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="generate", unit="item", disable=not progress)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in idx)
            input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids = list(prompts[i])
                if not ids:
                    raise ValueError("empty prompt: nothing to generate from")
                input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention[row, width - len(ids) :] = 1
            with torch.inference_mode():
                result = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention.to(device),
                    do_sample=False,
                    # Plain greedy even if the checkpoint's generation_config asks for sampling
                    # or a repetition penalty (as vLLM's SamplingParams(temperature=0) does).
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    repetition_penalty=1.0,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=sorted(stops),
                    pad_token_id=pad_id,
                    use_cache=True,
                )
            new = result[:, width:].tolist()
            batch_out: list[list[int]] = []
            for row, i in enumerate(idx):
                ids = new[row]
                cut = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
                out[i] = ids[:cut]
                batch_out.append(ids[:cut])
            if on_batch is not None:
                on_batch(idx, batch_out)
            bar.update(len(idx))
    finally:
        bar.close()
    assert all(ids is not None for ids in out)
    return out  # type: ignore[return-value]


def generate_hf(
    model: Any,
    tokenizer: Any,
    items: Sequence[GenItem],
    out_dir: str | Path,
    *,
    stop_ids: Sequence[int],
    batch_size: int = 8,
    max_new_tokens: int = 256,
    progress: bool = True,
    restraint: Restraint | None = None,
) -> GenerationRun:
    """Generate replies for ``items`` not yet in ``<out_dir>/generations.jsonl``, appending
    each batch as it finishes; return every item's generation in item order."""
    store = GenerationStore(Path(out_dir) / "generations.jsonl")
    done = store.load()
    todo = [it for it in items if it.id not in done]
    if len(todo) < len(items):
        log.info("generation: %d of %d items already in %s, %d to go", len(items) - len(todo), len(items),
                 store.path, len(todo))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = set(stop_ids)

    def write(indices: list[int], new_ids: list[list[int]]) -> None:
        gens = []
        for i, ids in zip(indices, new_ids, strict=True):
            it = todo[i]
            reply = tokenizer.decode(ids, skip_special_tokens=True).strip()
            gens.append(Generation(it.id, it.task, reply, len(ids), bool(ids) and ids[-1] in stops))
        store.append(gens)
        for g in gens:
            done[g.id] = g

    if todo:
        was_training = model.training
        model.eval()
        try:
            with restraint(model) if restraint is not None else nullcontext():
                greedy_generate_ids(
                    model,
                    [it.prompt_ids for it in todo],
                    batch_size=batch_size,
                    max_new_tokens=max_new_tokens,
                    pad_id=pad_id,
                    stop_ids=stop_ids,
                    progress=progress,
                    on_batch=write,
                )
        finally:
            model.train(was_training)
    return GenerationRun([done[it.id] for it in items], n_new=len(todo), n_resumed=len(items) - len(todo))


# ---------------------------------------------------------------- vllm backend


def require_vllm() -> Any:
    """The vllm module, or an ImportError that says how to get it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


def generate_vllm(
    model_path: str,
    tokenizer_path: str | None,
    items: Sequence[GenItem],
    out_dir: str | Path,
    *,
    stop_ids: Sequence[int],
    max_new_tokens: int = 256,
    max_model_len: int = 4096,
    seed: int = 0,
    llm_kwargs: Mapping[str, Any] | None = None,
) -> GenerationRun:
    """Generate with vLLM (greedy, the paper's setting). Not exercised by the CPU tests.

    vLLM schedules all prompts itself, so unfinished items are sent in one call and written
    when it returns; a kill loses that call's work, not earlier runs'.
    """
    vllm = require_vllm()
    store = GenerationStore(Path(out_dir) / "generations.jsonl")
    done = store.load()
    todo = [it for it in items if it.id not in done]
    if todo:
        too_long = [it.id for it in todo if len(it.prompt_ids) >= max_model_len]
        if too_long:
            raise ValueError(
                f"{len(too_long)} prompt(s) reach generation.max_model_len={max_model_len} tokens "
                f"(first: {too_long[0]}); raise generation.max_model_len"
            )
        llm = vllm.LLM(
            model=model_path,
            tokenizer=tokenizer_path or model_path,
            max_model_len=max_model_len,
            seed=seed,
            **dict(llm_kwargs or {}),
        )
        params = vllm.SamplingParams(
            temperature=0,
            max_tokens=max_new_tokens,
            stop_token_ids=list(stop_ids),
            skip_special_tokens=True,
        )
        outputs = llm.generate([{"prompt_token_ids": list(it.prompt_ids)} for it in todo], params)
        gens = []
        for it, res in zip(todo, outputs, strict=True):
            comp = res.outputs[0]
            ids = list(comp.token_ids)
            gens.append(Generation(it.id, it.task, comp.text.strip(), len(ids), comp.finish_reason == "stop"))
        store.append(gens)
        for g in gens:
            done[g.id] = g
    return GenerationRun([done[it.id] for it in items], n_new=len(todo), n_resumed=len(items) - len(todo))


# ---------------------------------------------------------------- the model being evaluated


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def model_label(cfg: Any) -> str:
    """What was evaluated, for the report and the judge cache key."""
    return cfg.model.path or f"random-init {cfg.model.name} (seed {cfg.seed})"


def load_eval_model(cfg: Any, tokenizer: Any) -> Any:
    """The model to evaluate, on its device, in eval mode, with the KV cache on."""
    import torch

    from rolemrc.build import build_model

    if cfg.generation.cpu_threads:
        torch.set_num_threads(cfg.generation.cpu_threads)
    torch.manual_seed(cfg.seed)  # a path-less (random-init) model is then the same on every run
    model = build_model(cfg.model, tokenizer)
    model.config.use_cache = True  # load_model turns it off for training; generation needs it
    return model.to(_device(cfg.generation.device)).eval()


def restraint_hook(spec: str) -> Restraint:
    """``restraint=<spec>`` -> a function giving the context manager active while generating."""
    try:
        from rolemrc.probing.restraint import load_restraint
    except ImportError as err:
        raise ImportError(
            f"restraint={spec!r} needs rolemrc.probing.restraint (neuron restraint), which could not be "
            f"imported: {err}"
        ) from err
    return lambda model: load_restraint(spec, model)


def prepare_generation(cfg: Any, items: Sequence[TestItem], ids: Sequence[str], tokenizer: Any,
                       chat: Any) -> tuple[list[GenItem], list[int]]:
    """Prompt ids and stop tokens; refuses to resume into a folder made with other settings."""
    gen_items = [GenItem(i, it.task, chat.encode_prompt(it.question)) for i, it in zip(ids, items, strict=True)]
    stops = stop_token_ids(tokenizer, chat.eot)
    check_settings(cfg.out_dir, {
        "model": model_label(cfg),
        "tokenizer": cfg.model.tokenizer,
        "chat_template": cfg.model.chat_template,
        "dtype": cfg.model.dtype,
        "backend": cfg.generation.backend,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "restraint": cfg.restraint,
        "stop_ids": stops,
    })
    return gen_items, stops


def generate(cfg: Any, gen_items: Sequence[GenItem], stops: Sequence[int], tokenizer: Any,
             model: Any | None) -> GenerationRun:
    """Replies for every item, resuming from ``<out_dir>/generations.jsonl``."""
    g = cfg.generation
    if g.backend == "hf":
        return generate_hf(
            model, tokenizer, gen_items, cfg.out_dir,
            stop_ids=stops,
            batch_size=g.batch_size,
            max_new_tokens=g.max_new_tokens,
            progress=g.progress,
            restraint=restraint_hook(cfg.restraint) if cfg.restraint else None,
        )
    from rolemrc.config import plain

    return generate_vllm(
        cfg.model.path, cfg.model.tokenizer, gen_items, cfg.out_dir,
        stop_ids=stops,
        max_new_tokens=g.max_new_tokens,
        max_model_len=g.max_model_len,
        seed=cfg.seed,
        llm_kwargs=dict(plain(g.vllm_kwargs) or {}),
    )
