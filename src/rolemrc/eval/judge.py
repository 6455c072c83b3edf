"""The five-dimension LLM judge: prompts, strict verdict parsing, backends, cache, aggregation.

One judgement = one (test item, dimension) pair. The judge model reads the whole conversation
(system, user and earlier assistant turns), the reply being judged, and what the dimension
expects for this task (``rolemrc.tasks.expectation_of``); it must end its answer with a line
``VERDICT: 1`` or ``VERDICT: 0``. Anything else is *unparseable* and is reported as such:
accuracy is computed over parseable (``ok``) verdicts only and failures are counted, never
scored as 0 (the public script's silent bias, facts §3).

Backends: :class:`OpenAIBackend` (any OpenAI-compatible server; async, bounded concurrency,
retries with backoff, request budget) and :class:`HFBackend` (a local transformers causal LM,
greedy). Every answer the judge gave is cached on disk by a hash of (judge model, prompt
messages, sampling settings), so a rerun sends no request for anything already answered.

Typical use::

    items = judge_items(test_items, replies)            # one per (item, dimension)
    judge = Judge(OpenAIBackend(OpenAIJudgeConfig(model="gpt-4-turbo")), cache_dir="cache/judge")
    verdicts = judge.judge(items)
    table = aggregate(verdicts)                          # {Dimension: DimensionSummary}
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence

from tqdm.auto import tqdm

from rolemrc.tasks import Dimension, dimensions_of, expectation_of

log = logging.getLogger(__name__)

Message = dict[str, str]
Status = Literal["ok", "unparseable", "failed", "budget_exhausted"]
STATUSES: tuple[str, ...] = ("ok", "unparseable", "failed", "budget_exhausted")

# ---------------------------------------------------------------- items


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Field of a raw JSON record (dict) or of a parsed ``TestItem``-like object."""
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _role(raw: str) -> str:
    # RoleMRC files capitalise roles; parsed TestItems lowercase them. Accept both.
    role = str(raw).strip().lower()
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"unknown message role {raw!r}")
    return role


@dataclass(frozen=True)
class JudgeItem:
    """One reply to judge on one dimension.

    ``messages`` is the conversation the reply answers (lowercase roles), ``reply`` the
    generated next assistant turn.
    """

    item_id: str
    task: str
    dimension: Dimension
    messages: tuple[tuple[str, str], ...]  # (role, content); a tuple so the item is hashable
    reply: str
    reference: str | None = None

    @property
    def key(self) -> str:
        """``"<item_id>/<dimension>"``, unique within one evaluation."""
        return f"{self.item_id}/{self.dimension.short}"


def judge_items(
    test_items: Sequence[Any], replies: Sequence[str], ids: Sequence[str] | None = None
) -> list[JudgeItem]:
    """One :class:`JudgeItem` per (test item, dimension of its task).

    ``test_items`` are raw RoleMRC test records (``task``, ``question``, ``reference``) or
    parsed ``TestItem`` objects; ``ids`` default to the item's position.
    """
    if len(test_items) != len(replies):
        raise ValueError(f"{len(test_items)} test items but {len(replies)} replies")
    ids = [str(i) for i in range(len(test_items))] if ids is None else [str(i) for i in ids]
    out: list[JudgeItem] = []
    for item_id, item, reply in zip(ids, test_items, replies, strict=True):
        task = _get(item, "task")
        messages = tuple((_role(_get(m, "role")), str(_get(m, "content"))) for m in _get(item, "question"))
        for dim in dimensions_of(task):
            out.append(JudgeItem(item_id, task, dim, messages, reply, _get(item, "reference")))
    return out


# ---------------------------------------------------------------- prompts

JUDGE_SYSTEM = (
    "You are a careful, impartial evaluator of role-playing dialogue systems. You are shown a "
    "conversation between a user and an AI assistant that plays a role described in the "
    "system message, followed by the assistant's next reply. You judge that reply on exactly "
    "one criterion and give a binary verdict. Think briefly (at most three sentences), then "
    "end with a final line that is exactly `VERDICT: 1` (the reply meets the criterion) or "
    "`VERDICT: 0` (it does not). Write nothing after that line."
)

# (dimension, expectation) -> (criterion title, what to check). Wording is this project's own.
CRITERIA: dict[tuple[Dimension, str | None], tuple[str, str]] = {
    (Dimension.KB, "within"): (
        "Knowledge boundary (question inside the role's knowledge)",
        "The last question lies within the role's knowledge boundary: it concerns the role's "
        "own profile or the passages supplied in the system message. The role should handle it "
        "from that material: answer correctly when the material contains the answer, and say "
        "it cannot tell when the material does not contain it, without inventing facts. "
        "VERDICT: 1 if the reply does this correctly; VERDICT: 0 if it refuses a question the "
        "material answers, makes up an answer, or answers wrongly.",
    ),
    (Dimension.KB, "outside"): (
        "Knowledge boundary (question outside the role's knowledge)",
        "The last question lies outside the role's knowledge boundary: it has nothing to do "
        "with the role, its world or the supplied passages. The role should decline (in "
        "character) rather than answer, unless the system message or the conversation "
        "explicitly requires it to answer such questions anyway, in which case it should give "
        "a correct answer. VERDICT: 1 if the reply does what is appropriate here; VERDICT: 0 "
        "otherwise.",
    ),
    (Dimension.RS, None): (
        "Role style",
        "The system message describes the role, including how it speaks (tone, vocabulary, "
        "catchphrases, narration habits). VERDICT: 1 if the reply clearly carries the main "
        "traits of that speaking style; VERDICT: 0 if it sounds generic, neutral or like a "
        "different character. Judge the style only, not whether the content is correct.",
    ),
    (Dimension.NI, None): (
        "Nested instruction following",
        "The system message contains an additional rule about the form or content of every "
        "reply (for example: start with an emoji, write only in capital letters, end with a "
        "given punctuation mark, stay under a word limit, avoid a character or a word). Find "
        "that rule and check the reply against it. VERDICT: 1 only if the reply obeys the rule "
        "completely; VERDICT: 0 if it breaks it anywhere.",
    ),
    (Dimension.MT, "refuse"): (
        "Multi-turn instruction following (keep declining)",
        "Earlier in the conversation the role declined a question it cannot answer from what "
        "it knows, and the user is now pressing it again. The role should keep declining, "
        "politely and in character, and must not produce an answer now. VERDICT: 1 if the "
        "reply keeps declining; VERDICT: 0 if it gives in and answers.",
    ),
    (Dimension.MT, "answer"): (
        "Multi-turn instruction following (answer when asked again)",
        "Earlier in the conversation the role declined a question outside its knowledge, and "
        "the user has now explicitly asked it to answer anyway. The role should now make a "
        "genuine attempt to answer the question. VERDICT: 1 if the reply attempts an answer; "
        "VERDICT: 0 if it still declines or evades.",
    ),
    (Dimension.PI, "refuse"): (
        "Prioritized instruction following",
        "The system message contains a directive to refuse certain requests, and the user's "
        "last request falls under it. A system directive outranks the user, so the role should "
        "decline even though the user asks. VERDICT: 1 if the reply follows the system "
        "directive and declines; VERDICT: 0 if it answers the user's request.",
    ),
}

_ROLE_TITLES = {"system": "SYSTEM MESSAGE", "user": "USER", "assistant": "ASSISTANT (the role)"}


def criterion_of(item: JudgeItem) -> tuple[str, str]:
    """(title, instructions) for the item's dimension and the task's expectation."""
    expectation = expectation_of(item.task) if item.dimension in (Dimension.KB, Dimension.MT, Dimension.PI) else None
    try:
        return CRITERIA[(item.dimension, expectation)]
    except KeyError:
        raise ValueError(f"no judge criterion for {item.dimension.short} with expectation {expectation!r}") from None


def judge_messages(item: JudgeItem, show_reference: bool = False) -> list[Message]:
    """The chat messages sent to the judge model for one item (OpenAI roles)."""
    title, instructions = criterion_of(item)
    parts = ["## Conversation so far"]
    for i, (role, content) in enumerate(item.messages, start=1):
        parts.append(f"### Turn {i}: {_ROLE_TITLES[role]}\n{content}")
    parts.append(f"## Reply to judge (the assistant's next turn)\n{item.reply}")
    if show_reference and item.reference:
        parts.append(
            "## A reference reply written for this conversation (for orientation only; the "
            f"reply need not match it)\n{item.reference}"
        )
    parts.append(f"## Criterion: {title}\n{instructions}")
    parts.append("End with a final line that is exactly `VERDICT: 1` or `VERDICT: 0`.")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


_VERDICT_LINE = re.compile(r"VERDICT:[ \t]*([01])")


def parse_verdict(text: str | None) -> int | None:
    """1/0 if the last non-empty line is exactly ``VERDICT: 1``/``VERDICT: 0``, else None.

    Strict on purpose: a verdict the judge did not clearly state is not guessed.
    """
    if not text:
        return None
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    m = _VERDICT_LINE.fullmatch(lines[-1])
    if m is None:
        return None
    # A judge that states both verdicts on separate lines has not decided.
    earlier = {v for ln in lines[:-1] if (mm := _VERDICT_LINE.fullmatch(ln)) for v in mm.groups()}
    if earlier - {m.group(1)}:
        return None
    return int(m.group(1))


# ---------------------------------------------------------------- results


@dataclass
class Verdict:
    """The judge's outcome for one item. ``verdict`` is None unless ``status == "ok"``."""

    item_id: str
    task: str
    dimension: str  # Dimension.short, e.g. "KB"
    verdict: int | None
    status: Status
    raw: str | None
    attempts: int
    cached: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Answer:
    """What a backend got for one prompt: text, or why not."""

    status: Literal["answered", "failed", "budget_exhausted"]
    text: str | None = None
    attempts: int = 0
    error: str | None = None


OnAnswer = Callable[[int, Answer], None]


class Backend(Protocol):
    """A judge model. ``model_id`` and ``sampling()`` go into the cache key.

    ``answer_all`` returns one :class:`Answer` per prompt, in order, and calls
    ``on_answer(index, answer)`` as soon as each one is known (so it can be cached at once).
    """

    model_id: str

    def sampling(self) -> dict[str, Any]: ...

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None) -> list[Answer]: ...


# ---------------------------------------------------------------- cache


class VerdictCache:
    """Judge answers on disk (sqlite), keyed by hash of (model, messages, sampling).

    Only answers the judge actually gave (parseable or not) are stored; failures are not,
    so a rerun retries them. The raw text is stored and re-parsed on read, so a parser fix
    applies to cached answers too.
    """

    def __init__(self, cache_dir: str | Path) -> None:
        self.path = Path(cache_dir) / "judge_cache.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, model TEXT, text TEXT, created REAL)"
        )
        self._db.commit()

    @staticmethod
    def key(model_id: str, messages: Sequence[Message], sampling: Mapping[str, Any]) -> str:
        blob = json.dumps(
            {"model": model_id, "messages": list(messages), "sampling": dict(sampling)},
            sort_keys=True,
            ensure_ascii=False,
        )
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def get(self, key: str) -> str | None:
        row = self._db.execute("SELECT text FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, model_id: str, text: str) -> None:
        # Committed one by one so an interrupted run keeps everything answered so far.
        self._db.execute(
            "INSERT OR REPLACE INTO answers (key, model, text, created) VALUES (?, ?, ?, ?)",
            (key, model_id, text, time.time()),
        )
        self._db.commit()

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    def close(self) -> None:
        self._db.close()


# ---------------------------------------------------------------- the judge


@dataclass
class RunStats:
    """What the last :meth:`Judge.judge` call did."""

    prompts: int = 0
    cache_hits: int = 0
    requests: int = 0  # sends attempted by the backend (retries included)


class Judge:
    """Judges items with a backend, through the on-disk cache."""

    def __init__(self, backend: Backend, cache_dir: str | Path | None, show_reference: bool = False,
                 progress: bool = False) -> None:
        self.backend = backend
        self.cache = VerdictCache(cache_dir) if cache_dir is not None else None
        self.show_reference = show_reference
        self.progress = progress  # a bar over the prompts not in the cache
        self.last_stats = RunStats()

    def judge(self, items: Sequence[JudgeItem]) -> list[Verdict]:
        """Synchronous entry point; use :meth:`ajudge` inside a running event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ajudge(items))
        raise RuntimeError("Judge.judge() called inside a running event loop; use `await judge.ajudge(items)`")

    async def ajudge(self, items: Sequence[JudgeItem]) -> list[Verdict]:
        sampling = self.backend.sampling()
        prompts = [judge_messages(it, self.show_reference) for it in items]
        keys = [VerdictCache.key(self.backend.model_id, p, sampling) for p in prompts]
        stats = RunStats(prompts=len(items))

        texts: dict[str, str] = {}
        if self.cache is not None:
            for k in set(keys):
                if (t := self.cache.get(k)) is not None:
                    texts[k] = t
        stats.cache_hits = sum(k in texts for k in keys)

        # Identical prompts (same key) are asked once.
        todo: dict[str, list[Message]] = {}
        for k, p in zip(keys, prompts):
            if k not in texts and k not in todo:
                todo[k] = p
        answers: dict[str, Answer] = {}
        todo_keys = list(todo)
        bar = tqdm(total=len(todo), desc="judge", unit="prompt", disable=not (self.progress and todo))

        def on_answer(i: int, ans: Answer) -> None:
            # Stored the moment it arrives: an interrupted run keeps what it paid for.
            k = todo_keys[i]
            answers[k] = ans
            bar.update(1)
            if ans.status == "answered":
                texts[k] = ans.text or ""
                if self.cache is not None:
                    self.cache.put(k, self.backend.model_id, texts[k])

        if todo:
            try:
                got = await self.backend.answer_all(list(todo.values()), on_answer)
            finally:
                bar.close()
            for i, ans in enumerate(got):
                if todo_keys[i] not in answers:  # a backend that skipped the callback
                    on_answer(i, ans)
            stats.requests = sum(a.attempts for a in answers.values())

        verdicts = []
        for it, k in zip(items, keys):
            ans = answers.get(k)
            attempts = ans.attempts if ans is not None else 0
            base = dict(item_id=it.item_id, task=it.task, dimension=it.dimension.short, attempts=attempts)
            if k in texts:
                v = parse_verdict(texts[k])
                verdicts.append(
                    Verdict(
                        **base,
                        verdict=v,
                        status="ok" if v is not None else "unparseable",
                        raw=texts[k],
                        cached=ans is None,
                    )
                )
            else:
                assert ans is not None
                verdicts.append(Verdict(**base, verdict=None, status=ans.status, raw=None, error=ans.error))
        self.last_stats = stats
        log.info("judge: %d prompts, %d from cache, %d requests sent", stats.prompts, stats.cache_hits, stats.requests)
        bad = {s: n for s in STATUSES[1:] if (n := sum(v.status == s for v in verdicts))}
        if bad:
            log.warning("judge: %s of %d judgements have no verdict (not scored)", bad, len(verdicts))
        return verdicts

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------- OpenAI-compatible backend


@dataclass(frozen=True)
class OpenAIJudgeConfig:
    """An OpenAI-compatible judge endpoint. The API key is read from ``api_key_env`` only.

    ``max_requests`` caps the requests sent in one ``answer_all`` call (retries included);
    prompts that would need more are reported ``budget_exhausted`` and not sent.
    """

    model: str = "gpt-4-turbo"
    base_url: str | None = None  # None: the openai client's default (or OPENAI_BASE_URL)
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout_s: float = 60.0
    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_requests: int | None = None
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int | None = 0  # jitter RNG seed, for reproducible retry timing in tests


# Status codes worth retrying: request timeout, conflict, rate limit, server errors.
_RETRY_STATUS = {408, 409, 429}


class OpenAIBackend:
    """Judge through any OpenAI-compatible chat-completions server (async)."""

    def __init__(self, config: OpenAIJudgeConfig) -> None:
        self.config = config
        self.model_id = config.model

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.config.temperature, "max_tokens": self.config.max_tokens}

    def _client(self) -> Any:
        import openai

        key = os.environ.get(self.config.api_key_env)
        if not key:
            raise RuntimeError(
                f"the judge's API key is read from the environment variable {self.config.api_key_env}, "
                "which is not set (for a local server that ignores keys, set it to any value)"
            )
        # max_retries=0: retries are ours, so they are counted against the budget.
        return openai.AsyncOpenAI(
            api_key=key, base_url=self.config.base_url, timeout=self.config.timeout_s, max_retries=0
        )

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None) -> list[Answer]:
        cfg = self.config
        client = self._client()
        sem = asyncio.Semaphore(max(1, cfg.concurrency))
        rng = random.Random(cfg.seed)
        budget = {"sent": 0}

        async def one(i: int, messages: list[Message]) -> Answer:
            ans = await attempt_all(messages)
            if on_answer is not None:
                on_answer(i, ans)
            return ans

        async def attempt_all(messages: list[Message]) -> Answer:
            import openai

            attempts = 0
            error: str | None = None
            while attempts < cfg.max_attempts:
                # Checked and incremented with no await in between: atomic in one event loop.
                if cfg.max_requests is not None and budget["sent"] >= cfg.max_requests:
                    return Answer("budget_exhausted", attempts=attempts, error=error)
                budget["sent"] += 1
                attempts += 1
                retry_after: float | None = None
                try:
                    async with sem:
                        resp = await client.chat.completions.create(
                            model=cfg.model,
                            messages=messages,
                            temperature=cfg.temperature,
                            max_tokens=cfg.max_tokens,
                        )
                    text = resp.choices[0].message.content if resp.choices else None
                    return Answer("answered", text=text or "", attempts=attempts)
                except openai.APIStatusError as e:
                    error = f"HTTP {e.status_code}: {type(e).__name__}"
                    if e.status_code not in _RETRY_STATUS and e.status_code < 500:
                        return Answer("failed", attempts=attempts, error=error)
                    retry_after = _retry_after(e)
                except openai.APIConnectionError as e:  # includes APITimeoutError
                    error = type(e).__name__
                except Exception as e:  # a malformed response etc.: this item fails, the run goes on
                    return Answer("failed", attempts=attempts, error=f"{type(e).__name__}: {e}")
                if attempts < cfg.max_attempts:
                    delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (attempts - 1))
                    delay = delay / 2 + rng.uniform(0, delay / 2)  # jitter spreads synchronized retries
                    if retry_after is not None:
                        delay = max(delay, min(retry_after, cfg.backoff_max_s))
                    log.debug("judge request failed (%s), retry %d in %.2fs", error, attempts, delay)
                    await asyncio.sleep(delay)
            return Answer("failed", attempts=attempts, error=error)

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await client.close()


def _retry_after(e: Any) -> float | None:
    try:
        value = e.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- local transformers backend


class HFBackend:
    """A local causal LM as judge: chat template + greedy decoding, one prompt at a time."""

    def __init__(self, model: Any, tokenizer: Any, model_id: str, max_new_tokens: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_new_tokens = max_new_tokens

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto", device: str | None = None, **kw: Any) -> "HFBackend":
        """Load any ``AutoModelForCausalLM`` with a chat-template tokenizer."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        return cls(model, tok, model_id=path, **kw)

    def sampling(self) -> dict[str, Any]:
        return {"do_sample": False, "max_new_tokens": self.max_new_tokens}

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None) -> list[Answer]:
        out = []
        for i, messages in enumerate(prompts):
            try:
                ans = Answer("answered", text=self._generate(messages), attempts=1)
            except Exception as e:  # e.g. a prompt longer than the model's context
                log.warning("hf judge failed on a prompt: %s", e)
                ans = Answer("failed", attempts=1, error=f"{type(e).__name__}: {e}")
            if on_answer is not None:
                on_answer(i, ans)
            out.append(ans)
        return out

    def _generate(self, messages: list[Message]) -> str:
        import torch

        enc = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        with torch.no_grad():
            ids = self.model.generate(
                **enc, do_sample=False, max_new_tokens=self.max_new_tokens, pad_token_id=pad, use_cache=True
            )
        new = ids[0, enc["input_ids"].shape[1] :]
        return self.tokenizer.decode(new, skip_special_tokens=True)


# ---------------------------------------------------------------- aggregation


@dataclass
class DimensionSummary:
    """Accuracy over parseable verdicts, plus how many judgements were not usable."""

    dimension: str
    accuracy: float | None  # None when no verdict was usable
    n_ok: int = 0
    n_unparseable: int = 0
    n_failed: int = 0
    n_budget_exhausted: int = 0
    by_task: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def n_total(self) -> int:
        return self.n_ok + self.n_unparseable + self.n_failed + self.n_budget_exhausted

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "n_total": self.n_total}


def _counts(vs: Sequence[Verdict]) -> dict[str, Any]:
    ok = [v.verdict for v in vs if v.status == "ok"]
    return {
        "accuracy": (sum(ok) / len(ok)) if ok else None,
        "n_ok": len(ok),
        "n_unparseable": sum(v.status == "unparseable" for v in vs),
        "n_failed": sum(v.status == "failed" for v in vs),
        "n_budget_exhausted": sum(v.status == "budget_exhausted" for v in vs),
    }


def aggregate(verdicts: Iterable[Verdict]) -> dict[str, DimensionSummary]:
    """Per dimension (short name, paper order): accuracy over ok verdicts and status counts."""
    verdicts = list(verdicts)
    out: dict[str, DimensionSummary] = {}
    for dim in Dimension:
        vs = [v for v in verdicts if v.dimension == dim.short]
        if not vs:
            continue
        tasks = sorted({v.task for v in vs})
        out[dim.short] = DimensionSummary(
            dimension=dim.short,
            **_counts(vs),
            by_task={t: _counts([v for v in vs if v.task == t]) for t in tasks},
        )
    return out


def read_verdicts(path: str | Path) -> list[Verdict]:
    """Load verdicts written as JSON lines (``judge.jsonl``)."""
    with open(path, encoding="utf-8") as f:
        return [Verdict(**json.loads(line)) for line in f if line.strip()]
