"""Generation backends for evaluation: greedy replies to test prompts, written as they finish.

Prompts are token ids from :meth:`rolemrc.data.templates.ChatFormat.encode_prompt` (the one
place that renders chat templates), so evaluation sees exactly the layout training used.

- ``hf``: transformers ``generate``, greedy, batched with LEFT padding (the new tokens of
  every row then start at the same column), prompts sorted longest first so a batch holds
  prompts of similar length and little padding is computed.
- ``vllm``: optional (GPU nodes, its own environment: vllm pins another torch/transformers),
  imported only when asked for.
- ``openai``: the evaluated model behind any OpenAI-compatible server (``generation.model``,
  ``base_url``, ``api_key_env``): each test conversation is sent as chat messages
  (system/user/assistant), temperature 0, ``max_tokens = generation.max_new_tokens``, through
  :class:`rolemrc.api.ApiClient` (retries with backoff on 429/5xx/timeouts/malformed 200s,
  concurrency, request budget, fault counts); good replies are also kept in an
  :class:`rolemrc.api.AnswerCache` (``generation.cache_dir``). Each reply is appended as it
  arrives; replies still missing at the end stop the run (:class:`GenerationIncomplete`),
  never scored as empty, and a rerun asks only for them.
- ``file``: replies produced elsewhere (``generation.path``), see :func:`read_replies`.

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Protocol, Sequence

from rolemrc.api import FAULT_KINDS, AnswerCache, Rejected, fault_summary, request_key
from rolemrc.config import Judging, Replier, plain, typed
from rolemrc.data.schemas import DataError
from rolemrc.data.test_items import generation_prompts
from rolemrc.errors import ConfigError, InputNotFound, UserError
from rolemrc.eval.judge import (
    check_api_key, check_judge, endpoint_client, judge_config, make_judge, role_of, uses_evaluated_model,
)
from rolemrc.fileio import atomic_write_text
from rolemrc.models.loading import check_source, count_parameters, load_model
from rolemrc.models.source import check_model_path
from rolemrc.probing.restraint import load_restraint
from rolemrc.registry import Registry
from rolemrc.rollout.engine import Sampling
from rolemrc.rollout.hf import greedy_generate_ids, pad_id_of, stop_token_ids
from rolemrc.rollout.vllm import build_llm, llm_generate, require_vllm

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
    n_tokens: int | None  # None: not known (replies read from a file)
    stopped: bool | None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


@dataclass
class GenerationRun:
    """Replies in item order, and how many were made now vs read back from the file."""

    generations: list[Generation]
    n_new: int
    n_resumed: int
    missing: list[int] = field(default_factory=list)  # positions without a reply (file backend, on_missing=skip)
    requests: int = 0  # API requests sent (openai backend; retries included)
    faults: dict[str, int] = field(default_factory=dict)
    unmatched: int = 0  # rows of a replies file (file backend) that no item was matched to

    strip: bool = False  # generation.strip_replies: score the replies with surrounding whitespace removed

    @property
    def replies(self) -> list[str]:
        """What is scored and judged: each reply as the backend returned it (``generations.jsonl``
        keeps that), or ``str.strip()``-ed where ``generation.strip_replies=true`` asked for it."""
        return [g.reply.strip() if self.strip else g.reply for g in self.generations]

    @property
    def n_cut(self) -> int:
        return sum(g.stopped is False for g in self.generations)


# ---------------------------------------------------------------- the resumable file


class GenerationStore:
    """``generations.jsonl``: append-only, durable per batch, readable after a kill. ``row``: the
    dataclass of a line (with ``id`` and ``to_json()``; default :class:`Generation`), ``what``: what a
    line holds, for the error naming a damaged one."""

    def __init__(self, path: str | Path, row: Any = None, what: str = "generation") -> None:
        self.path = Path(path)
        self.row = row or Generation
        self.what = what

    def load(self) -> dict[str, Any]:
        """Finished rows by id. A torn last line (no newline: killed mid-write) is
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
        out: dict[str, Any] = {}
        for lineno, raw in enumerate(data[:end].splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                gen = self.row(**json.loads(raw))
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(
                    f"{self.path}:{lineno}: unreadable {self.what} line ({err}); delete the line or the file "
                    "to regenerate those items"
                ) from err
            out[gen.id] = gen
        return out

    def append(self, generations: Iterable[Any]) -> None:
        """Write lines in one call, then flush and fsync: after this returns they survive a kill."""
        text = "".join(g.to_json() + "\n" for g in generations)
        if not text:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def check_settings(out_dir: str | Path, settings: Mapping[str, Any], results: str = "generations.jsonl") -> None:
    """Refuse to resume into a folder whose generations (``results``: the file holding them) were
    made with other settings (another model, length limit, restraint...): mixing them would
    corrupt the scores."""
    path = Path(out_dir) / "generation_settings.json"
    settings = json.loads(json.dumps(dict(settings)))  # normalise tuples etc. for comparison
    if path.exists() and (Path(out_dir) / results).exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = {k: (old.get(k), settings.get(k)) for k in set(old) | set(settings) if old.get(k) != settings.get(k)}
        if diff:
            shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{out_dir} holds generations made with other settings ({shown}); use a new out_dir, "
                f"or delete {results} there to regenerate"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- hf backend (rolemrc.rollout.hf)


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
    pad_id = pad_id_of(tokenizer)
    stops = set(stop_ids)

    def write(indices: list[int], new_ids: list[list[int]]) -> None:
        gens = []
        for i, ids in zip(indices, new_ids, strict=True):
            it = todo[i]
            reply = tokenizer.decode(ids, skip_special_tokens=True)  # as generated: never stripped
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
    vllm = require_vllm(VLLM_MISSING, ImportError)
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
        llm = build_llm(vllm, model=model_path, tokenizer=tokenizer_path, max_model_len=max_model_len, seed=seed,
                        **dict(llm_kwargs or {}))
        outputs = llm_generate(vllm, llm, [it.prompt_ids for it in todo], Sampling(max_new_tokens), stop_ids)
        gens = []
        for it, res in zip(todo, outputs, strict=True):
            comp = res.outputs[0]
            ids = list(comp.token_ids)
            gens.append(Generation(it.id, it.task, comp.text, len(ids), comp.finish_reason == "stop"))
        store.append(gens)
        for g in gens:
            done[g.id] = g
    return GenerationRun([done[it.id] for it in items], n_new=len(todo), n_resumed=len(items) - len(todo))


# ---------------------------------------------------------------- openai backend

GENERATION_CACHE_FILE = "generation_cache.sqlite"


class GenerationIncomplete(UserError, RuntimeError):
    """Replies are missing (API faults, budget spent, no reply in the file): the run stops
    before scoring instead of scoring them as empty."""


def chat_messages(question: Sequence[Mapping[str, str]]) -> list[Message]:
    """A test conversation as OpenAI chat messages (roles system/user/assistant)."""
    return [{"role": role_of(m["role"]), "content": str(m["content"])} for m in question]


@dataclass
class ChatItem:
    """One test conversation to send to a served model."""

    id: str
    task: str
    messages: list[Message]


def nonempty(text: str) -> str:
    """``text`` unless it is empty or blank (a :class:`rolemrc.api.Rejected`: an API reply to ask again)."""
    if not text or not text.strip():
        raise Rejected("empty_reply", "the reply is empty")
    return text


def openai_settings(g: Any) -> dict[str, Any]:
    """What shapes a served model's reply (the cache key and generation_settings.json)."""
    return {"model": g.model, "base_url": g.base_url, "temperature": 0.0, "max_tokens": g.max_new_tokens}


def check_openai(g: Any) -> None:
    """Before anything slow: the model name and the API key's variable."""
    if not g.model:
        raise ConfigError("generation.backend=openai needs generation.model (the served model name)")
    check_api_key(g.api_key_env, "generation")


def generate_openai(g: Any, items: Sequence[ChatItem], out_dir: str | Path, cache_dir: str | Path | None = None,
                    progress: bool = False) -> GenerationRun:
    """Replies of the served model ``g.model`` for ``items`` not yet in ``<out_dir>/generations.jsonl``
    (greedy: temperature 0, ``max_tokens=g.max_new_tokens``), each appended as it arrives.

    Raises :class:`GenerationIncomplete` naming how many are missing when some could not be
    obtained (the ones obtained are kept; a rerun asks only for the rest).
    """
    import asyncio

    from tqdm.auto import tqdm


    check_openai(g)
    store = GenerationStore(Path(out_dir) / "generations.jsonl")
    done = store.load()
    todo = [it for it in items if it.id not in done]
    sampling = {"temperature": 0.0, "max_tokens": g.max_new_tokens}
    counts: Counter[str] = Counter()
    requests = 0
    failed: list[tuple[ChatItem, str]] = []
    if todo:
        cache = AnswerCache(Path(cache_dir or Path(out_dir) / "generation_cache") / GENERATION_CACHE_FILE)
        keys = {it.id: request_key({"model": g.model, "messages": it.messages,
                                    "sampling": {**sampling, "base_url": g.base_url}}) for it in todo}
        try:
            hits = []
            for it in todo:
                text = cache.get(keys[it.id], valid=nonempty)
                if text is not None:
                    hits.append(Generation(it.id, it.task, text, None, None))
            store.append(hits)
            for h in hits:
                done[h.id] = h
            ask = [it for it in todo if it.id not in done]
            if ask:
                log.info("generation: asking %s for %d replies (%d from the cache)", g.model, len(ask), len(hits))

            async def main() -> None:
                client = endpoint_client("generation", g, counts)
                bar = tqdm(total=len(ask), desc="generate (api)", unit="item", disable=not progress)

                async def one(it: ChatItem) -> None:
                    nonlocal requests
                    body = {"model": g.model, "messages": it.messages, **sampling}
                    out = await client.chat(body, tag=f"item {it.id}", check=nonempty)
                    requests += out.attempts
                    bar.update(1)
                    if not out.ok:
                        failed.append((it, out.error or out.status))
                        return
                    # Stored the moment it arrives (cache, then the run's file): a kill keeps it.
                    cache.put(keys[it.id], out.text or "", g.model)
                    gen = Generation(it.id, it.task, out.text or "", out.completion_tokens,
                                     None if out.finish_reason is None else out.finish_reason == "stop")
                    store.append([gen])
                    done[it.id] = gen

                try:
                    await asyncio.gather(*(one(it) for it in ask))
                finally:
                    bar.close()
                    await client.close()

            if ask:
                asyncio.run(main())
        finally:
            cache.close()
    faults = {k: n for k, n in counts.items() if k in FAULT_KINDS}
    if failed:
        first = ", ".join(f"{it.id} ({why})" for it, why in failed[:3])
        raise GenerationIncomplete(
            f"generation: {len(failed)} of {len(items)} replies missing from {g.model} (faults: "
            f"{fault_summary(faults)}; first: {first}); the {len(done)} replies obtained are in "
            f"{store.path}; rerun the same command to ask only for the missing ones"
        )
    return GenerationRun([done[it.id] for it in items], n_new=len(todo), n_resumed=len(items) - len(todo),
                         requests=requests, faults=faults)


# ---------------------------------------------------------------- file backend


def _canon(messages: Sequence[Mapping[str, str]]) -> str:
    return json.dumps([[str(m["role"]).strip().lower(), str(m["content"]).strip()] for m in messages],
                      ensure_ascii=False)


@dataclass
class ReplyFile:
    """Replies read from ``generation.path``, indexed every way an item can be matched."""

    by_id: dict[str, tuple[str, str]]  # id -> (reply, where)
    by_conversation: dict[str, tuple[str, str]]  # canonical question messages -> (reply, where)
    by_role_question: dict[tuple[str, str], tuple[str, str]]  # RoleBench: (role, question)
    by_question: dict[str, tuple[str, str]]  # a question string (the conversation's last user turn)
    rows: int
    paths: list[str]
    wheres: list[str] = field(default_factory=list)  # "file:line" of every reply row
    same_as: dict[str, str] = field(default_factory=dict)  # a row repeating an earlier one -> that row
    used: set[str] = field(default_factory=set)  # rows some test item was matched to

    def unmatched(self) -> list[str]:
        """``file:line`` of the rows no test item was matched to (an unknown id or question)."""
        return [w for w in self.wheres if self.same_as.get(w, w) not in self.used]


def reply_paths(path: Any) -> list[str]:
    if path is None or path == "" or path == []:
        raise ConfigError("generation.backend=file needs generation.path (a JSON-lines file of replies, or a list)")
    paths = [str(path)] if isinstance(path, (str, Path)) else [str(x) for x in path]
    for p in paths:
        if not Path(p).expanduser().is_file():
            raise InputNotFound(f"generation.path: no such file: {p}")
    return [str(Path(p).expanduser()) for p in paths]


def read_replies(path: Any, reply_field: str = "reply", *, path_key: str = "generation.path",
                 field_key: str = "generation.reply_field") -> ReplyFile:
    """Rows ``{"<reply_field>": str, "id"?: ..., "question"?: str | [messages], "role"?: str}``
    from one or several JSON-lines files. ``reply_field`` may hold a list of exactly one string
    (RoleBench's ``rolegpt_baseline.jsonl`` rows ``{"role", "question", "generated": [reply]}``).
    A row that no key can match, an unreadable row, or one key given two different replies is
    an error naming file:line and the config keys that gave the file and the field."""
    out = ReplyFile({}, {}, {}, {}, 0, reply_paths(path))
    errors: list[str] = []

    def put(index: dict[Any, tuple[str, str]], key: Any, reply: str, where: str, ambiguous_ok: bool = False) -> None:
        old = index.get(key)
        if old is not None and old[0] != reply:
            if ambiguous_ok:  # a bare question string several rows share (other roles): never used to match
                index[key] = (None, f"{old[1]} and {where}")  # type: ignore[assignment]
            else:
                errors.append(f"{where}: a different reply for the same item as {old[1]} ({key!r:.80})")
        elif old is None:
            index[key] = (reply, where)
        elif old[1] != where:
            out.same_as.setdefault(where, old[1])

    for p in out.paths:
        with open(p, "rb") as f:
            for lineno, raw_bytes in enumerate(f, start=1):
                if not raw_bytes.strip():
                    continue
                where = f"{p}:{lineno}"
                try:
                    raw = raw_bytes.decode("utf-8")
                except UnicodeDecodeError as e:
                    errors.append(f"{where}: not UTF-8 text (byte 0x{raw_bytes[e.start]:02x} at byte {e.start + 1} "
                                  "of the line; re-save the file as UTF-8)")
                    continue
                try:
                    row = json.loads(raw)
                except json.JSONDecodeError as e:
                    errors.append(f"{where}: not JSON ({e.msg}: column {e.colno})")
                    continue
                if not isinstance(row, dict):
                    errors.append(f"{where}: expected a JSON object, got {type(row).__name__}")
                    continue
                reply = row.get(reply_field)
                if isinstance(reply, list) and len(reply) == 1:
                    reply = reply[0]
                if not isinstance(reply, str):
                    errors.append(f"{where}: field {reply_field!r} must be a string (or a list of one string); "
                                  f"has: {', '.join(map(str, row)) or 'nothing'} ({field_key})")
                    continue
                out.rows += 1
                out.wheres.append(where)
                keyed = False
                if row.get("id") is not None:
                    put(out.by_id, str(row["id"]), reply, where)
                    keyed = True
                q = row.get("question")
                if isinstance(q, list) and q and all(isinstance(m, dict) and "role" in m and "content" in m for m in q):
                    put(out.by_conversation, _canon(q), reply, where)
                    keyed = True
                elif isinstance(q, str) and q.strip():
                    if isinstance(row.get("role"), str):
                        put(out.by_role_question, (row["role"].strip(), q.strip()), reply, where)
                    put(out.by_question, q.strip(), reply, where, ambiguous_ok=True)
                    keyed = True
                if not keyed:
                    errors.append(f"{where}: a reply row needs an 'id' or a 'question' (a string or the test "
                                  "conversation's messages) to be matched to a test item")
    if errors:
        raise DataError(f"{len(errors)} bad row(s) in the replies file ({path_key}):\n  " + "\n  ".join(errors[:20]))
    log.info("generation: %d replies read from %s", out.rows, ", ".join(out.paths))
    return out


def match_replies(replies: ReplyFile, items: Sequence[TestItem], ids: Sequence[str]) -> list[str | None]:
    """The reply of each item (None where the file has none): by ``id`` (the test row's own
    ``id`` field or rolemrc's item id, as in a run's generations.jsonl), else by the question:
    the whole conversation, RoleBench's role + question, or the last user turn when no other
    item has the same one."""
    lasts = Counter(it.question[-1]["content"].strip() for it in items)
    out: list[str | None] = []
    for it, iid in zip(items, ids, strict=True):
        found = None
        own = it.extra.get("id")
        for key in ([str(own)] if own is not None else []) + [iid]:
            if key in replies.by_id:
                found = replies.by_id[key]
                break
        if found is None:
            found = replies.by_conversation.get(_canon(it.question))
        role = it.extra.get("rolebench_role")
        last = it.question[-1]["content"].strip()
        if found is None and role:
            found = replies.by_role_question.get((str(role).strip(), last))
        if found is None and not role and lasts[last] == 1:
            found = replies.by_question.get(last)
        if found is not None and found[0] is not None:
            replies.used.add(found[1])
        out.append(None if found is None else found[0])
    return out


def file_replies(g: Any, items: Sequence[TestItem], ids: Sequence[str], out_dir: str | Path,
                 replies: ReplyFile | None = None) -> GenerationRun:
    """The replies of ``generation.path`` for ``items``; missing ones are an error naming how many
    and the first few, or with ``generation.on_missing=skip`` left out (``GenerationRun.missing``).
    The matched replies are written to ``<out_dir>/generations.jsonl`` (the run folder's layout)."""
    if g.on_missing not in ("error", "skip"):
        raise ConfigError(f"generation.on_missing must be error or skip, got {g.on_missing!r}")
    shared = replies
    replies = replies or read_replies(g.path, g.reply_field)
    got = match_replies(replies, items, ids)
    missing = [k for k, r in enumerate(got) if r is None]
    if missing and g.on_missing == "error":
        raise no_reply_error("generation", missing, items, ids, ", ".join(replies.paths), "them out")
    if missing:
        log.warning("generation.path: %d of %d test items have no reply and are left out (generation.on_missing=skip)",
                    len(missing), len(items))
    # A shared file (several benchmarks read from it) is counted once, by its reader, at the end.
    unmatched = count_unmatched(replies) if shared is None else 0
    # Exactly as in the file: the authors' scripts score the reply as generated.
    gens = [Generation(i, it.task, r, None, None) for i, it, r in zip(ids, items, got) if r is not None]

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out_dir) / "generations.jsonl", "".join(x.to_json() + "\n" for x in gens))
    return GenerationRun(gens, n_new=0, n_resumed=0, missing=missing, unmatched=unmatched)


def no_reply_error(group: str, missing: Sequence[int], items: Sequence[TestItem], ids: Sequence[str], files: str,
                   left_out: str) -> GenerationIncomplete:
    """The error for test items without a reply in ``files`` (``group``: ``generation`` or
    ``pairwise``, whose ``on_missing=skip`` leaves ``left_out``), naming the first few."""
    first = "; ".join(f"{ids[k]} ({items[k].question[-1]['content'].strip()[:60]!r})" for k in missing[:3])
    key = "generation.path" if group == "generation" else f"{group}.against"
    return GenerationIncomplete(
        f"{key}: {len(missing)} of {len(items)} test items have no reply in {files} (first: {first}); give every "
        f"item a reply (matched by id, else by question), or set {group}.on_missing=skip to leave {left_out} "
        "(counted in the report)")


def count_unmatched(replies: ReplyFile) -> int:
    """How many rows of ``replies`` no test item was matched to (logged with the first few)."""
    unmatched = replies.unmatched()
    if unmatched:
        log.warning("generation.path: %d of %d reply rows match no test item (an unknown id or question; first: %s)",
                    len(unmatched), replies.rows, ", ".join(unmatched[:3]))
    return len(unmatched)


# ---------------------------------------------------------------- the model being evaluated


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


class GenerationBackend(Protocol):
    """How the evaluated model's replies are made (``generation.backend``; one object per name in
    :data:`GENERATION_BACKENDS`). Every method is handed the :class:`~rolemrc.config.Replier` typed
    at evaluate.py's door (``r``: the model, ``generation`` group, data, ``out_dir``, restraint, seed).

    ``local``: a model runs in this process from ``model.path`` (prompts encoded here with the chat
    template; model sources resolved; lm-eval benchmarks possible); such a backend answers
    :meth:`generate_local`, the others :meth:`generate_remote`. ``loads_model``: that model is a
    transformers model loaded here (restraint hooks into it, ``judge=hf`` with ``judge.model=null``
    judges with it). ``generates``: it answers new prompts (False: replies come from a file).
    """

    name: str
    local: bool
    loads_model: bool
    generates: bool

    def check(self, r: Replier, judge: Any) -> None:
        """What can be checked before anything slow (``judge``: the ``judge`` group, which may
        need the evaluated model); a :class:`ConfigError` naming the key."""

    def model_label(self, r: Replier) -> str:
        """What was evaluated, for the report and the judge cache key."""

    def label(self, g: Any) -> str:
        """How the replies were made (``g``: the ``generation`` group), for the report."""

    def generate_local(self, r: Replier, gen_items: Sequence[GenItem], stops: Sequence[int], tokenizer: Any,
                       model: Any | None) -> GenerationRun:
        """Replies to ``gen_items`` (encoded prompts), resuming from ``<r.out_dir>/generations.jsonl``."""

    def generate_remote(self, r: Replier, items: Sequence[TestItem], ids: Sequence[str],
                        replies: ReplyFile | None = None) -> GenerationRun:
        """Replies to ``items`` (chat messages) from a server or a replies file, into ``r.out_dir``."""


def _no_evaluated_model(r: Replier, judge: Any, name: str) -> None:
    """Checks for a backend that loads no transformers model here."""
    if r.restraint:
        raise ConfigError(f"restraint hooks into a transformers model: not with generation.backend={name}")
    if uses_evaluated_model(judge):
        raise ConfigError(f"judge=hf with judge.model=null judges with the evaluated model, which "
                          f"generation.backend={name} does not load: set judge.model")


class _Remote:
    local = False
    loads_model = False

    def generate_local(self, r: Replier, gen_items: Sequence[GenItem], stops: Sequence[int], tokenizer: Any,
                       model: Any | None) -> GenerationRun:
        raise ValueError(f"generation.backend={self.name} runs no model here: use generate_remote")  # type: ignore[attr-defined]


class _Local:
    local = True
    generates = True

    def model_label(self, r: Replier) -> str:
        return r.model.path or f"random-init {r.model.name} (seed {r.seed})"

    def label(self, g: Any) -> str:
        return f"{self.name}, greedy, max_new_tokens={g.max_new_tokens}"  # type: ignore[attr-defined]

    def generate_remote(self, r: Replier, items: Sequence[TestItem], ids: Sequence[str],
                        replies: ReplyFile | None = None) -> GenerationRun:
        raise ValueError(f"generation.backend={self.name} is local: use generate_local")  # type: ignore[attr-defined]


class HFGeneration(_Local):
    """transformers ``generate`` in this process."""

    name = "hf"
    loads_model = True

    def check(self, r: Replier, judge: Any) -> None:
        pass

    def generate_local(self, r: Replier, gen_items: Sequence[GenItem], stops: Sequence[int], tokenizer: Any,
                       model: Any | None) -> GenerationRun:
        g = r.generation
        return _normalised(g, generate_hf(
            model, tokenizer, gen_items, r.out_dir,
            stop_ids=stops,
            batch_size=g.batch_size,
            max_new_tokens=g.max_new_tokens,
            progress=g.progress,
            restraint=restraint_hook(r.restraint) if r.restraint else None,
        ))


class VLLMGeneration(_Local):
    """vLLM's engine, loading ``model.path`` itself."""

    name = "vllm"
    loads_model = False

    def check(self, r: Replier, judge: Any) -> None:
        require_vllm(VLLM_MISSING, ImportError)
        if r.model.path is None:
            raise ConfigError("generation.backend=vllm needs model.path (a saved model folder or hub id)")
        if r.restraint:
            raise ConfigError("restraint hooks into a transformers model: use generation.backend=hf")

    def generate_local(self, r: Replier, gen_items: Sequence[GenItem], stops: Sequence[int], tokenizer: Any,
                       model: Any | None) -> GenerationRun:
        g = r.generation
        return _normalised(g, generate_vllm(
            r.model.path, r.model.tokenizer, gen_items, r.out_dir,
            stop_ids=stops,
            max_new_tokens=g.max_new_tokens,
            max_model_len=g.max_model_len,
            seed=r.seed,
            llm_kwargs=dict(plain(g.vllm_kwargs) or {}),
        ))


class OpenAIGeneration(_Remote):
    """The evaluated model behind an OpenAI-compatible server."""

    name = "openai"
    generates = True

    def check(self, r: Replier, judge: Any) -> None:
        _no_evaluated_model(r, judge, self.name)
        check_openai(r.generation)

    def model_label(self, r: Replier) -> str:
        g = r.generation
        return f"{g.model} (OpenAI-compatible API{' at ' + g.base_url if g.base_url else ''})"

    def label(self, g: Any) -> str:
        return f"openai ({g.model}), temperature 0, max_tokens={g.max_new_tokens}"

    def generate_remote(self, r: Replier, items: Sequence[TestItem], ids: Sequence[str],
                        replies: ReplyFile | None = None) -> GenerationRun:
        g = r.generation
        check_settings(r.out_dir, {"model": self.model_label(r), "backend": "openai", **openai_settings(g)})
        chat_items = [ChatItem(i, it.task, chat_messages(it.question)) for i, it in zip(ids, items, strict=True)]
        return _normalised(g, generate_openai(g, chat_items, r.out_dir, g.cache_dir, g.progress))


class FileGeneration(_Remote):
    """Replies produced elsewhere (``generation.path``)."""

    name = "file"
    generates = False

    def check(self, r: Replier, judge: Any) -> None:
        _no_evaluated_model(r, judge, self.name)
        g = r.generation
        reply_paths(g.path)
        if g.on_missing not in ("error", "skip"):
            raise ConfigError(f"generation.on_missing must be error or skip, got {g.on_missing!r}")

    def model_label(self, r: Replier) -> str:
        p = r.generation.path
        paths = [str(p)] if isinstance(p, (str, Path)) or p is None else [str(x) for x in p]
        return f"replies from {', '.join(paths)}"

    def label(self, g: Any) -> str:
        return f"file (replies read from {', '.join(reply_paths(g.path))}, field {g.reply_field!r})"

    def generate_remote(self, r: Replier, items: Sequence[TestItem], ids: Sequence[str],
                        replies: ReplyFile | None = None) -> GenerationRun:
        check_settings(r.out_dir, {"backend": "file"})  # never overwrite generations of a model
        return _normalised(r.generation, file_replies(r.generation, items, ids, r.out_dir, replies))


GENERATION_BACKENDS: Registry[GenerationBackend] = Registry("generation.backend", doc="how evaluated replies are made")
for _b in (HFGeneration(), VLLMGeneration(), OpenAIGeneration(), FileGeneration()):
    GENERATION_BACKENDS.register(_b.name, _b)


def generation_backend(r: Replier) -> GenerationBackend:
    """The backend object ``generation.backend`` names; a :class:`ConfigError` listing the
    known names for any other."""
    return GENERATION_BACKENDS.get(r.generation.backend)


def model_label(r: Replier) -> str:
    """What was evaluated, for the report and the judge cache key."""
    return generation_backend(r).model_label(r)


def generation_label(r: Replier) -> str:
    """How the replies were made, for the report."""
    g = r.generation
    label = generation_backend(r).label(g)
    if getattr(g, "strip_replies", False):
        return label + "; replies stripped of surrounding whitespace before scoring (generation.strip_replies=true)"
    return label + "; replies scored as generated (not stripped)"


def check_generation(r: Replier, judge: Any) -> GenerationBackend:
    """The checks in the order of relevance, before anything slow: the model (a missing or empty
    folder is the error to read), the backend (vllm installed, the API key's variable, the replies
    file), the judge's (``judge``: the ``judge`` group) backend, model and key. Returns the backend."""
    backend = generation_backend(r)
    if backend.local:
        check_model_path(r.model.path, "model.path")
        check_source(r.model.tokenizer, "model.tokenizer")
    backend.check(r, judge)
    check_judge(judge_config(judge))
    return backend


def load_eval_model(r: Replier, tokenizer: Any) -> Any:
    """The model to evaluate, on its device, in eval mode, with the KV cache on."""
    import torch

    if r.generation.cpu_threads:
        torch.set_num_threads(r.generation.cpu_threads)
    torch.manual_seed(r.seed)  # a path-less (random-init) model is then the same on every run
    model_cfg = typed(r.model)
    model = load_model(model_cfg, tokenizer)
    log.info("model %s: %s parameters", model_cfg.name, f"{count_parameters(model)[1]:,}")
    model.config.use_cache = True  # load_model turns it off for training; generation needs it
    return model.to(_device(r.generation.device)).eval()


def build_judge(judging: Judging, replier: Replier, model: Any | None, tokenizer: Any) -> Any:
    """A :class:`rolemrc.eval.judge.Judge` for ``judging.judge`` (``make_judge``), None for ``judge=none``;
    ``replier``: the evaluated model, which ``judge=hf`` with ``judge.model=null`` judges with."""
    j = judge_config(judging.judge)
    if uses_evaluated_model(j) and model is None and replier.model.path is not None:
        j = replace(j, model=replier.model.path)  # generated with vllm: the evaluated model judges, loaded here
    return make_judge(j, cache_dir=judging.cache_dir, model=model, tokenizer=tokenizer,
                      model_id=model_label(replier), device=judging.device, progress=judging.progress)


def restraint_hook(spec: str) -> Restraint:
    """``restraint=<spec>`` -> a function giving the context manager active while generating."""
    return lambda model: load_restraint(spec, model)


def prepare_generation(r: Replier, items: Sequence[TestItem], ids: Sequence[str], tokenizer: Any,
                       chat: Any) -> tuple[list[GenItem], list[int]]:
    """Prompt ids and stop tokens; refuses to resume into a folder made with other settings."""
    # Encoded once into the data store (data.cache), read back by later starts
    prompts = generation_prompts(r.data, list(items), chat)
    gen_items = [GenItem(i, it.task, p) for i, it, p in zip(ids, items, prompts, strict=True)]
    stops = stop_token_ids(tokenizer, chat.eot)
    check_settings(r.out_dir, {
        "model": model_label(r),
        "tokenizer": r.model.tokenizer,
        "chat_template": r.model.chat_template,
        "dtype": r.model.dtype,
        "backend": r.generation.backend,
        "max_new_tokens": r.generation.max_new_tokens,
        "restraint": r.restraint,
        "stop_ids": stops,
    })
    return gen_items, stops


def _normalised(g: Any, run: GenerationRun) -> GenerationRun:
    """``generation.strip_replies`` (``g``: the ``generation`` group; default false: replies are
    scored as generated, as the authors' scripts score them) applied to the run's
    :attr:`GenerationRun.replies`."""
    run.strip = bool(getattr(g, "strip_replies", False))
    return run
