"""The dialogue mode of ``python evaluate.py env=<name>``: for each test seed the model holds a
conversation with the environment's user (at most ``env.max_turns`` replies); the judge scores
every reply and the whole dialogue; the report shows the scores by turn.

Seeds: the rows of ``data.prompts`` (the seeds multi-turn GRPO plays), else those of ``data.test``
(RoleMRC test items: the question opens the conversation), each a prompt ending with the user's
turn and the fields its environment reads (``user_turns`` for ``env=scripted``), cut to ``limit``.

Conversations, per ``generation.backend``:

- ``hf`` / ``vllm``: :func:`rolemrc.env.roll`, greedy, the conversation held as token ids;
- ``openai``: :func:`rolemrc.env.converse`, the conversation sent as chat messages, temperature 0,
  each reply cached (``<generation.cache_dir>/dialogue_cache.sqlite``) as it arrives;
- ``file``: whole conversations read from ``generation.path`` (:func:`read_dialogues`), scored
  without generating.

Finished conversations are appended to ``<out_dir>/dialogues.jsonl`` (flushed, fsynced) every
``generation.batch_size`` seeds (vllm: every :data:`VLLM_CHUNK`): a rerun plays only the seeds
missing there, and judgements come from the judge's cache.

Judging (:mod:`rolemrc.eval.judge`): each reply on its seed's task's dimensions given the
conversation before it (a seed without a RoleMRC task: role style, and nested instruction
following when it has a rule), and each conversation once on role consistency across its turns
(``assets/judge/consistency.txt``, or ``dialogue.consistency_template``; ``VERDICT: 1|0``).
A judgement without a verdict is counted, never scored.

Report: ``summary.md`` (scores by turn index, role consistency, turns, end reasons),
``metrics.json`` (``dialogue``: flat ``dialogue/turn_<k>/<dim>`` scores and the counts),
``judge.jsonl``, ``dialogue_by_turn.png`` (with matplotlib) and the loggers (W&B: scalars, the
by-turn table, the plot, the turns)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import OmegaConf

from rolemrc.api import FAULT_KINDS, AnswerCache, Budget, Rejected, fault_summary, request_key
from rolemrc.config import Judging, Replier, check_data_dir, plain, typed
from rolemrc.data.readers import read_examples
from rolemrc.data.schemas import DataError, Message, RecordError, check_turn_order, normalise_messages
from rolemrc.env import ENVS, Conversation, Dialogue, Environment, Fault, Reply, converse, make_env, roll
from rolemrc.errors import ConfigError
from rolemrc.eval import pairwise
from rolemrc.eval.bench.ask import ask_judge
from rolemrc.eval.generation import (
    VLLM_MISSING, GenerationIncomplete, GenerationStore, build_judge, check_generation, check_openai, check_settings,
    generation_backend, generation_label, item_id, load_eval_model, model_label, nonempty, reply_paths, restraint_hook,
)
from rolemrc.eval.judge import (
    JudgeIncomplete, JudgeItem, Verdict, aggregate, endpoint_client, judge_backend, parse_verdict, uses_evaluated_model,
)
from rolemrc.eval.report import log_to_loggers, pct, print_console, write_report
from rolemrc.eval.verifiers import verify
from rolemrc.fileio import atomic_write_text
from rolemrc.models.source import resolve_model_sources
from rolemrc.parts import build_chat, make_loggers
from rolemrc.rollout.engine import Sampling
from rolemrc.rollout.hf import greedy_generate_ids, pad_id_of, stop_token_ids
from rolemrc.rollout.vllm import build_llm, llm_generate, require_vllm
from rolemrc.tasks import TASKS, Dimension, dimensions_of

log = logging.getLogger(__name__)

DIALOGUES_FILE = "dialogues.jsonl"
PLOT_FILE = "dialogue_by_turn.png"
CACHE_FILE = "dialogue_cache.sqlite"
CONSISTENCY_CACHE = "consistency_cache.sqlite"
DEFAULT_TEMPLATE = "judge/consistency.txt"  # rolemrc.asset name
TEMPLATE_FIELDS = {
    "conversation": "the whole conversation, one labelled block per message",
    "turns": "how many replies the role-player gave",
    "task": "the seed's task name (empty when it has none)",
}
NO_TASK = "dialogue"  # the task name of a seed without a RoleMRC task
CONSISTENCY = "consistency"  # its verdicts' dimension in judge.jsonl


def enabled(cfg: Any) -> bool:
    """``env=<name>`` other than none: evaluate.py's dialogue mode."""
    env = cfg.get("env") if hasattr(cfg, "get") else getattr(cfg, "env", None)
    return env is not None and str(env.name) != "none"


# ---------------------------------------------------------------- seeds


@dataclass
class Seed:
    """One conversation to hold: ``row`` is what the environment's ``reset`` reads (``messages``,
    ``columns``: the record's fields)."""

    id: str
    task: str | None
    rule: Any
    row: dict[str, Any]

    @property
    def opening(self) -> list[Message]:
        return self.row["messages"]


def load_seeds(data: Any, limit: int | None) -> tuple[list[Seed], str]:
    """The seeds (see the module) and the key they came from."""
    key = "prompts" if data.get("prompts") else "test"
    sources = OmegaConf.to_container(data[key], resolve=True) if OmegaConf.is_config(data[key]) else data[key]
    if not sources:
        raise ConfigError(f"data={data.name} has neither data.prompts nor data.test: the dialogue mode "
                          "needs seeds (e.g. data=sample_dialogues)")
    items, report = read_examples(list(sources), "prompts", on_error=data.get("on_error", "raise"))
    for line in report.lines():
        log.info("dialogue seeds: %s", line)
    if limit is not None:
        if limit < 1:
            raise ConfigError(f"limit must be >= 1 (or null for all seeds), got {limit}")
        items = items[:limit]
    seeds = []
    for i, it in enumerate(items):
        if not it.prompt or it.prompt[-1]["role"] != "user":
            raise DataError(f"data.{key}: {it.origin or f'seed {i}'}: a dialogue seed's prompt must end with the "
                            "user's turn")
        seeds.append(Seed(item_id(i, it.task or "", it.prompt), it.task, it.rule,
                          {"messages": [dict(m) for m in it.prompt], "columns": it.columns()}))
    if not seeds:
        raise DataError(f"data.{key} holds no seeds")
    return seeds, f"data.{key}"


# ---------------------------------------------------------------- the resumable file


@dataclass
class Record:
    """One line of ``dialogues.jsonl``: a finished conversation."""

    id: str
    task: str | None
    messages: list[Message]
    opening: int  # the seed's opening messages at the start of ``messages``
    reason: str  # why it ended (rolemrc.env: script_end, turn_cap, truncated, ...)
    turn_info: list[dict[str, float]] = field(default_factory=list)
    n_tokens: int | None = None  # the conversation's tokens (local backends)
    noncanonical: int = 0  # replies sampled otherwise than the template tokenises their text

    @property
    def replies(self) -> list[tuple[list[Message], str]]:
        """(the conversation before it, the reply) for each reply, in turn order."""
        return [(self.messages[:j], m["content"]) for j, m in enumerate(self.messages)
                if j >= self.opening and m["role"] == "assistant"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def dialogue_store(out_dir: Path) -> GenerationStore:
    """``dialogues.jsonl``: append-only, durable per batch; a torn last line (a kill mid-write) is cut."""
    return GenerationStore(out_dir / DIALOGUES_FILE, Record, "conversation")


# ---------------------------------------------------------------- conversations


@dataclass
class Played:
    """The conversations of a run, in seed order, and what it took."""

    records: list[Record]
    n_new: int = 0
    n_resumed: int = 0
    missing: list[str] = field(default_factory=list)  # seeds without a conversation (file backend, skip)
    requests: int = 0
    faults: dict[str, int] = field(default_factory=dict)


def _record(seed: Seed, conv: Conversation | Dialogue, opening: int) -> Record:
    tokens = len(conv.ids) if isinstance(conv, Conversation) else None
    noncanonical = conv.noncanonical if isinstance(conv, Conversation) else 0
    return Record(seed.id, seed.task, conv.messages, opening, conv.reason, conv.turn_info, tokens, noncanonical)


def _chunks(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    n = max(1, int(n))
    return [items[i:i + n] for i in range(0, len(items), n)]


VLLM_CHUNK = 256  # seeds per vLLM rollout (it schedules a whole turn's prompts itself); written after each


def play_local(seeds: Sequence[Seed], env: Environment, chat: Any, generate: Callable[[list[list[int]]],
               list[list[int]]], stops: Sequence[int], store: GenerationStore, per: int, max_turns: int,
               max_tokens: int | None) -> list[tuple[str, str]]:
    """Conversations for ``seeds`` with a local engine (:func:`rolemrc.env.roll`), appended to
    ``store`` every ``per`` seeds; returns the failed ones' (seed id, why): their user could not
    answer (never scored, not stored: a rerun holds them again)."""
    failed: list[tuple[str, str]] = []
    for chunk in _chunks(seeds, per):
        episodes = [env.reset(s.row) for s in chunk]
        convs = roll(episodes, chat, generate, stop_ids=stops, max_turns=max_turns, max_tokens=max_tokens)
        store.append([_record(s, c, len(e.opening)) for s, c, e in zip(chunk, convs, episodes, strict=True)
                      if not c.failed])
        failed += [(s.id, f"{c.reason}: {c.error}") for s, c in zip(chunk, convs, strict=True) if c.failed]
    return failed


def hf_generate(r: Replier, model: Any, tokenizer: Any,
                stops: Sequence[int]) -> Callable[[list[list[int]]], list[list[int]]]:
    """Greedy continuations with transformers (``generation.batch_size``, ``max_new_tokens``)."""
    g = r.generation
    pad = pad_id_of(tokenizer)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        with restraint_hook(r.restraint)(model) if r.restraint else nullcontext():
            return greedy_generate_ids(model, prompts, batch_size=g.batch_size, max_new_tokens=g.max_new_tokens,
                                       pad_id=pad, stop_ids=stops)

    return generate


def vllm_generate(r: Replier, stops: Sequence[int]) -> Callable[[list[list[int]]], list[list[int]]]:
    """Greedy continuations with vLLM (the stop token kept at the end of a stopped reply, as roll expects)."""
    vllm = require_vllm(VLLM_MISSING, ImportError)
    g = r.generation
    llm = build_llm(vllm, model=r.model.path, tokenizer=r.model.tokenizer, max_model_len=g.max_model_len,
                    seed=r.seed, **dict(plain(g.vllm_kwargs) or {}))

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outs = llm_generate(vllm, llm, prompts, Sampling(g.max_new_tokens), stops)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def _reply_json(text: str) -> Reply:
    raw = json.loads(text)
    if not isinstance(raw, dict) or not str(raw.get("text", "")).strip():
        raise Rejected("empty_reply", "the cached reply is empty")
    return Reply(str(raw["text"]), bool(raw.get("cut")), raw.get("tokens"))


def openai_reply(g: Any, cache: AnswerCache, counts: Counter[str], sent: list[int]) -> Callable[
        [list[list[Message]]], list[Reply | Fault]]:
    """The served model's greedy replies (temperature 0) to conversations, through ``cache``
    (every reply stored as it arrives); ``sent[0]`` counts the requests."""
    sampling = {"temperature": 0.0, "max_tokens": g.max_new_tokens}
    budget = Budget(g.max_requests, names=("generation.max_requests", ""))

    def reply(batch: list[list[Message]]) -> list[Reply | Fault]:
        keys = [request_key({"model": g.model, "messages": m, "sampling": {**sampling, "base_url": g.base_url,
                                                                           "mode": "dialogue"}}) for m in batch]
        out: list[Reply | Fault | None] = [None] * len(batch)
        for i, k in enumerate(keys):
            hit = cache.get(k, valid=_reply_json)
            if hit is not None:
                out[i] = _reply_json(hit)

        async def main() -> None:
            client = endpoint_client("generation", g, counts, budget)

            async def one(i: int) -> None:
                o = await client.chat({"model": g.model, "messages": batch[i], **sampling}, tag=f"conversation {i}",
                                      check=nonempty)
                sent[0] += o.attempts
                if not o.ok:
                    out[i] = Fault(o.error or o.status)
                    return
                tokens = (o.prompt_tokens + o.completion_tokens
                          if o.prompt_tokens is not None and o.completion_tokens is not None else None)
                r = Reply(o.text or "", o.finish_reason == "length", tokens)
                cache.put(keys[i], json.dumps(asdict(r), ensure_ascii=False), g.model)
                out[i] = r

            try:
                await asyncio.gather(*(one(i) for i, x in enumerate(out) if x is None))
            finally:
                await client.close()

        if any(x is None for x in out):
            asyncio.run(main())
        return [x for x in out if x is not None]

    return reply


def play_openai(r: Replier, e: Any, seeds: Sequence[Seed], env: Environment,
                store: GenerationStore) -> tuple[int, dict, list]:
    """Conversations for ``seeds`` with the served model (:func:`rolemrc.env.converse`; ``e``: the
    ``env`` group); returns (requests sent, faults by kind, the unfinished conversations' (seed id, error))."""
    g = r.generation
    counts: Counter[str] = Counter()
    sent = [0]
    failed: list[tuple[str, str]] = []
    cache = AnswerCache(Path(g.cache_dir or Path(r.out_dir) / "generation_cache") / CACHE_FILE)
    try:
        reply = openai_reply(g, cache, counts, sent)
        for chunk in _chunks(seeds, max(g.batch_size, g.concurrency)):
            episodes = [env.reset(s.row) for s in chunk]
            dialogues = converse(episodes, reply, max_turns=e.max_turns, max_tokens=e.max_tokens)
            store.append([_record(s, d, d.opening) for s, d in zip(chunk, dialogues, strict=True) if d.finished])
            failed += [(s.id, f"{d.reason + ': ' if d.reason else ''}{d.error}") for s, d in
                       zip(chunk, dialogues, strict=True) if not d.finished]
    finally:
        cache.close()
    return sent[0], {k: n for k, n in counts.items() if k in FAULT_KINDS}, failed


def read_dialogues(g: Any, seeds: Sequence[Seed]) -> tuple[list[Record], list[str], int]:
    """Conversations from ``generation.path`` (JSON lines): each row ``{"messages": [...]}`` (or
    ``conversations``) holding the whole conversation, the seed's opening first (its system
    message and the user's first turn), then the replies and user turns, ending with a reply;
    optional ``id`` (the seed's id, or the seed record's own ``id``) and ``reason`` (why it ended;
    default ``file``). A row is matched to a seed by id, else by the opening. Returns (records in
    seed order, the ids of seeds without one, rows matched to no seed)."""
    by_id: dict[str, tuple[str, dict]] = {}
    by_opening: dict[str, tuple[str, dict]] = {}
    rows = 0
    for path in reply_paths(g.path):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                rows += 1
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: not JSON ({err})") from None
                if not isinstance(raw, dict):
                    raise DataError(f"{where}: a conversation row must be a JSON object")
                key = "messages" if "messages" in raw else "conversations" if "conversations" in raw else None
                if key is None:
                    raise DataError(f"{where}: a conversation row needs 'messages' (the whole conversation: the "
                                    f"seed's opening, then replies and user turns); has: {', '.join(raw) or 'nothing'}")
                try:
                    messages = normalise_messages(raw[key], key)
                    check_turn_order(messages, key, last="assistant")
                except RecordError as err:
                    raise DataError(f"{where}: {err}") from None
                row = {"messages": messages, "reason": str(raw.get("reason") or "file"), "where": where}
                if raw.get("id") is not None:
                    by_id[str(raw["id"])] = (where, row)
                for n in range(1, len(messages)):
                    if messages[n - 1]["role"] == "user" and messages[n]["role"] == "assistant":
                        by_opening.setdefault(_canon(messages[:n]), (where, row))
    out, missing, used = [], [], set()
    for s in seeds:
        own = s.row["columns"].get("id")
        found = next((by_id[k] for k in (s.id, str(own) if own is not None else None) if k in by_id), None)
        found = found or by_opening.get(_canon(s.opening))
        if found is None:
            missing.append(s.id)
            continue
        where, row = found
        opening = len(s.opening)
        if _canon(row["messages"][:opening]) != _canon(s.opening) or len(row["messages"]) <= opening:
            raise DataError(f"{where}: the conversation matched to seed {s.id} by id does not start with that seed's "
                            "opening (its system message and first user turn) followed by a reply")
        used.add(where)
        out.append(Record(s.id, s.task, row["messages"], opening, row["reason"]))
    unmatched = rows - len(used)
    return out, missing, unmatched


def _canon(messages: Sequence[Mapping[str, str]]) -> str:
    return json.dumps([[m["role"], m["content"].strip()] for m in messages], ensure_ascii=False)


# ---------------------------------------------------------------- judging


def _judge_task(seed: Seed) -> tuple[str, tuple[Dimension, ...]]:
    """The task name and dimensions each reply of the seed is judged on."""
    if seed.task in TASKS:
        return seed.task, dimensions_of(seed.task)
    return NO_TASK, (Dimension.RS, Dimension.NI) if seed.rule else (Dimension.RS,)


def turn_id(seed_id: str, turn: int) -> str:
    return f"{seed_id}/turn_{turn}"


def turn_items(records: Sequence[Record], seeds: Mapping[str, Seed], strip: bool = False) -> list[JudgeItem]:
    """One judgement per (reply, dimension of its seed's task), given the conversation before it."""
    out = []
    for rec in records:
        task, dims = _judge_task(seeds[rec.id])
        for turn, (before, reply) in enumerate(rec.replies, start=1):
            messages = tuple((m["role"], m["content"]) for m in before)
            for dim in dims:
                out.append(JudgeItem(turn_id(rec.id, turn), task, dim, messages, reply.strip() if strip else reply))
    return out


def load_template(path: str | None) -> str:
    """The consistency judge's prompt: ``path`` (``dialogue.consistency_template``) or rolemrc's;
    checked as pairwise judging's (:func:`rolemrc.eval.pairwise.load_template`): known placeholders,
    the conversation shown, and the verdict line asked for. A fault is a ConfigError naming the file."""
    where = "dialogue.consistency_template"
    text = pairwise.load_template(path, where, DEFAULT_TEMPLATE, TEMPLATE_FIELDS, ("conversation",),
                                  "it must show the conversation")
    if "VERDICT" not in text:
        raise ConfigError(f"{where}={path}: the template never asks for the verdict line (`VERDICT: 1` or "
                          "`VERDICT: 0`)")
    return text


_LABELS = {"system": "System message", "user": "User", "assistant": "Assistant (the character)"}


def consistency_prompt(template: str, rec: Record) -> list[Message]:
    """One user message: the template filled with the whole conversation."""
    blocks, turn = [], 0
    for j, m in enumerate(rec.messages):
        label = _LABELS.get(m["role"], m["role"])
        if m["role"] == "assistant" and j >= rec.opening:
            turn += 1
            label += f", reply {turn}"
        blocks.append(f"[{label}]\n{m['content']}")
    text = template.format(conversation="\n\n".join(blocks), turns=len(rec.replies), task=rec.task or "")
    return [{"role": "user", "content": text}]


def check_consistency(text: str) -> int:
    v = parse_verdict(text)
    if v is None:
        raise Rejected("no_verdict", "the answer does not end with 'VERDICT: 1' or 'VERDICT: 0'")
    return v


def judge_consistency(judging: Judging, judge: Any, template: str,
                      records: Sequence[Record]) -> tuple[list[Verdict], int]:
    """One :class:`Verdict` (dimension ``consistency``) per conversation, through its cache
    (``<judge cache>/consistency_cache.sqlite``); returns them and the requests sent."""
    prompts = [consistency_prompt(template, r) for r in records]
    with AnswerCache(Path(judging.cache_dir) / CONSISTENCY_CACHE) as cache:
        answers, counts = ask_judge(judge.backend, cache, prompts, parse_verdict, check_consistency,
                                    "consistency prompt")
    return [Verdict(rec.id, rec.task or NO_TASK, CONSISTENCY, a["value"], a["status"], a["text"], a["attempts"],
                    cached=a["cached"], error=a["error"]) for rec, a in zip(records, answers, strict=True)], \
        counts["requests"]


# ---------------------------------------------------------------- report


def rule_passes(rule: Any, reply: str) -> bool | None:
    """Whether ``reply`` keeps the seed's rule(s) (None: no rule, or one the verifiers do not know)."""
    rules = [rule] if isinstance(rule, Mapping) else list(rule or [])
    try:
        return all(verify(r, reply) for r in rules) if rules else None
    except ValueError:
        return None


def by_turn(records: Sequence[Record], seeds: Mapping[str, Seed], verdicts: Sequence[Verdict],
            strip: bool = False) -> list[dict[str, Any]]:
    """Per turn index: replies, each dimension's judge summary, and the rule verifier's pass rate."""
    turns = max((len(r.replies) for r in records), default=0)
    rows = []
    for k in range(1, turns + 1):
        ids = {turn_id(r.id, k) for r in records if len(r.replies) >= k}
        checks = [rule_passes(seeds[r.id].rule, r.replies[k - 1][1].strip() if strip else r.replies[k - 1][1])
                  for r in records if len(r.replies) >= k]
        checks = [c for c in checks if c is not None]
        rows.append({"turn": k, "replies": len(ids), "judge": aggregate(v for v in verdicts if v.item_id in ids),
                     "rule": (sum(checks) / len(checks)) if checks else None, "rule_n": len(checks)})
    return rows


def _summary(vs: Sequence[Verdict]) -> dict[str, Any]:
    ok = [v.verdict for v in vs if v.status == "ok"]
    return {"accuracy": (sum(ok) / len(ok)) if ok else None, "n_ok": len(ok),
            **{f"n_{s}": sum(v.status == s for v in vs) for s in ("unparseable", "failed", "budget_exhausted")}}


def scores(rows: Sequence[dict[str, Any]], consistency: dict[str, Any] | None, records: Sequence[Record]) -> dict:
    """The flat numbers of metrics.json and the loggers (``dialogue/...``)."""
    out: dict[str, float] = {"dialogue/conversations": float(len(records)),
                             "dialogue/turns_mean": sum(len(r.replies) for r in records) / max(len(records), 1)}
    for row in rows:
        k = row["turn"]
        out[f"dialogue/turn_{k}/replies"] = float(row["replies"])
        for dim, s in row["judge"].items():
            if s.accuracy is not None:
                out[f"dialogue/turn_{k}/{dim}"] = s.accuracy
        if row["rule"] is not None:
            out[f"dialogue/turn_{k}/rule"] = row["rule"]
    if consistency is not None and consistency["accuracy"] is not None:
        out["dialogue/consistency"] = consistency["accuracy"]
    for reason, n in Counter(r.reason for r in records).items():
        out[f"dialogue/ends/{reason}"] = float(n)
    return out


def table(rows: Sequence[dict[str, Any]], overall: Mapping[str, Any] | None) -> tuple[list[str], list[list[Any]]]:
    """The by-turn table: columns and rows (one per turn, then ``all``)."""
    dims = [d.short for d in Dimension if any(d.short in r["judge"] for r in rows)]
    rule = any(r["rule"] is not None for r in rows)
    columns = ["turn", "replies", *(f"{Dimension[d].title} ({d})" for d in dims), *(["rule kept (verifier)"] * rule)]

    def cell(s: Any) -> str:
        return "–" if s is None else f"{pct(s.accuracy)} ({s.n_ok})"

    body = [[r["turn"], r["replies"], *(cell(r["judge"].get(d)) for d in dims),
             *([f"{pct(r['rule'])} ({r['rule_n']})" if r["rule"] is not None else "–"] * rule)] for r in rows]
    if overall is not None and rows:
        body.append(["all", sum(r["replies"] for r in rows), *(cell(overall.get(d)) for d in dims),
                     *([pct(_mean_rule(rows))] * rule)])
    return columns, body


def _mean_rule(rows: Sequence[dict[str, Any]]) -> float | None:
    n = sum(r["rule_n"] for r in rows)
    return sum(r["rule"] * r["rule_n"] for r in rows if r["rule"] is not None) / n if n else None


def plot(rows: Sequence[dict[str, Any]], consistency: float | None, path: Path) -> str | None:
    """``path``: each dimension's accuracy and the rule's pass rate by turn (PNG); None when
    matplotlib is missing (the reason returned instead is written in the report)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment (pip install matplotlib): no plot"
    turns = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in Dimension:
        ys = [r["judge"][d.short].accuracy if d.short in r["judge"] else None for r in rows]
        if any(y is not None for y in ys):
            ax.plot(turns, [float("nan") if y is None else y for y in ys], marker="o", label=f"{d.title} ({d.short})")
    if any(r["rule"] is not None for r in rows):
        ax.plot(turns, [float("nan") if r["rule"] is None else r["rule"] for r in rows], marker="s", linestyle="--",
                label="rule kept (verifier)")
    if consistency is not None:
        ax.axhline(consistency, color="grey", linestyle=":", label="role consistency (whole dialogue)")
    ax.set_xlabel("turn")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks(turns)
    ax.set_title("Scores by turn")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def render(env_name: str, max_turns: int, records: Sequence[Record], columns: list[str], body: list[list[Any]],
           consistency: dict[str, Any] | None, plot_note: str | None, missing: int) -> str:
    """The dialogue section of summary.md."""
    n = len(records)
    ends = Counter(r.reason for r in records)
    mean = sum(len(r.replies) for r in records) / max(n, 1)
    lines = [f"## Dialogue evaluation (env={env_name}, {n} conversations, at most {max_turns} turns)", "",
             f"Replies per conversation: mean {mean:.2f}, max {max((len(r.replies) for r in records), default=0)}. "
             f"Ended by: {', '.join(f'{k} {v}' for k, v in sorted(ends.items()))}."
             + (f" {missing} seeds without a conversation, left out." if missing else ""), ""]
    if columns:
        lines += ["### Scores by turn", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
        rule = " rule kept: the replies that obey their seed's rule (rolemrc's verifiers)." if any(
            c.startswith("rule kept") for c in columns) else ""
        judged = any(c not in ("turn", "replies") and not c.startswith("rule kept") for c in columns)
        cell = ("Each cell: the judge's accuracy over the replies of that turn with a verdict (their number); " if judged
                else "Each cell: the share of that turn's replies (their number); ")
        lines += ["", cell + "a turn's replies are fewer when conversations ended earlier." + rule, ""]
    if consistency is not None:
        lines += [f"Role consistency across the turns (judge, one verdict per conversation): "
                  f"{pct(consistency['accuracy'])} of {consistency['n_ok']} conversations with a verdict "
                  f"({consistency['n_unparseable']} unparseable, {consistency['n_failed']} failed, "
                  f"{consistency['n_budget_exhausted']} not sent; none of them scored).", ""]
    lines += [f"Plot: {plot_note}" if plot_note else f"Plot: {PLOT_FILE}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the pipeline


def check(r: Replier, judging: Judging, e: Any, d: Any, pair: Any) -> None:
    """Before anything slow: the environment (``e``: the ``env`` group), the backend, the judge and
    its template (``d``: the ``dialogue`` group); no ``pairwise.against`` (``pair``)."""
    ENVS.get(e.name, where="env.name", hint=" (or none)")
    check_generation(r, judging.judge)
    if judge_backend(judging.judge) is not None:
        load_template(d.consistency_template)
    if pair is not None and pair.against not in (None, "", []):
        raise ConfigError("pairwise.against compares single replies: not with env=" + str(e.name))


def run_dialogues(cfg: Any) -> dict[str, Any]:
    """``python evaluate.py env=<name>``: see the module."""
    check_data_dir(cfg.data)
    # The door: the evaluated model and the judge, typed once (the model's path again once resolved).
    r, judging = Replier.of(cfg), Judging.of(cfg)
    check(r, judging, cfg.env, cfg.dialogue, cfg.get("pairwise"))
    backend = generation_backend(r)
    out_dir = Path(r.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds, origin = load_seeds(cfg.data, cfg.limit)
    by_id = {s.id: s for s in seeds}
    log.info("dialogue mode: %s holds %d conversations with env=%s (%s)", model_label(r), len(seeds), cfg.env.name,
             origin)
    if backend.local:
        cfg, resolved = resolve_model_sources(cfg)
        r = replace(r, model=cfg.model)
    else:
        resolved = {}
    store = dialogue_store(out_dir)
    env_settings = plain(cfg.env)
    played = Played([])
    model = tokenizer = None
    failed: list[tuple[str, str]] = []
    if backend.generates:
        done = store.load()
        todo = [s for s in seeds if s.id not in done]
        played.n_resumed = len(seeds) - len(todo)
        if backend.local:
            chat = build_chat(cfg.model)
            tokenizer = chat.tokenizer
            stops = stop_token_ids(tokenizer, chat.eot)
            check_settings(out_dir, {"mode": "dialogue", "env": env_settings, "model": model_label(r),
                                     "tokenizer": cfg.model.tokenizer, "chat_template": cfg.model.chat_template,
                                     "dtype": cfg.model.dtype, "backend": cfg.generation.backend,
                                     "max_new_tokens": cfg.generation.max_new_tokens, "restraint": cfg.restraint,
                                     "stop_ids": stops, "max_length": cfg.data.get("max_length")},
                           results=DIALOGUES_FILE)
            if backend.loads_model and (todo or (uses_evaluated_model(judging.judge) and r.model.path is None)):
                model = load_eval_model(r, tokenizer)
        else:
            check_openai(cfg.generation)
            check_settings(out_dir, {"mode": "dialogue", "env": env_settings, "model": model_label(r),
                                     "backend": "openai", "temperature": 0.0,
                                     "max_tokens": cfg.generation.max_new_tokens, "base_url": cfg.generation.base_url},
                           results=DIALOGUES_FILE)
        if todo:
            env = make_env(typed(cfg.env), cache_dir=out_dir / "env_cache", seed=cfg.seed, device=cfg.generation.device)
            try:
                if backend.local:
                    generate = (hf_generate(r, model, tokenizer, stops) if backend.loads_model
                                else vllm_generate(r, stops))
                    per = (cfg.generation.batch_size if backend.loads_model
                           else max(cfg.generation.batch_size, VLLM_CHUNK))
                    max_tokens = cfg.env.max_tokens if cfg.env.max_tokens is not None else cfg.data.get("max_length")
                    failed = play_local(todo, env, chat, generate, stops, store, per, cfg.env.max_turns, max_tokens)
                else:
                    played.requests, played.faults, failed = play_openai(r, cfg.env, todo, env, store)
            finally:
                env.close()
            played.n_new = len(todo) - len(failed)
        done = store.load()
        played.records = [done[s.id] for s in seeds if s.id in done]
    else:  # generation.backend=file: whole conversations from generation.path
        check_settings(out_dir, {"mode": "dialogue", "backend": "file"}, results=DIALOGUES_FILE)
        records, missing, unmatched = read_dialogues(cfg.generation, seeds)
        if missing and cfg.generation.on_missing == "error":
            raise GenerationIncomplete(
                f"generation.path: {len(missing)} of {len(seeds)} seeds have no conversation in "
                f"{', '.join(reply_paths(cfg.generation.path))} (first: {', '.join(missing[:3])}); give each seed one "
                "(matched by id, else by its opening), or set generation.on_missing=skip to leave them out")
        if unmatched:
            log.warning("generation.path: %d conversation rows match no seed", unmatched)
        atomic_write_text(out_dir / DIALOGUES_FILE, "".join(rec.to_json() + "\n" for rec in records))
        played.records, played.missing = records, missing
    log.info("dialogues: %d new, %d resumed from %s", played.n_new, played.n_resumed, store.path)
    if failed:
        first = ", ".join(f"{i} ({why})" for i, why in failed[:3])
        raise GenerationIncomplete(
            f"generation: {len(failed)} of {len(seeds)} conversations unfinished: a reply of the model or of the "
            f"user could not be obtained (faults: {fault_summary(played.faults)}; first: {first}); the "
            f"{len(played.records)} finished are in {store.path}; rerun the same command to hold only the rest")
    return _judge_and_report(r, judging, cfg.env, cfg.dialogue, cfg.logger, played, by_id, model, tokenizer,
                             resolved.get("model.path"))


def _judge_and_report(r: Replier, judging: Judging, e: Any, d: Any, logger: Any, played: Played,
                      seeds: Mapping[str, Seed], model: Any, tokenizer: Any, source: str | None) -> dict[str, Any]:
    """Judge the conversations and write the report (``e``, ``d``, ``logger``: the ``env``,
    ``dialogue`` and ``logger`` groups; ``source``: the checkpoint ``model.path`` was exported from)."""
    out_dir = Path(r.out_dir)
    records = played.records
    strip = bool(r.generation.get("strip_replies", False))
    verdicts: list[Verdict] | None = None
    cons: list[Verdict] = []
    judge_stats = None
    judge_model = None
    cons_requests = 0
    final_unparseable = False
    if judge_backend(judging.judge) is not None and records:
        template = load_template(d.consistency_template)
        with build_judge(judging, r, model, tokenizer) as judge:
            judge_model = judge.backend.model_id
            verdicts = judge.judge(turn_items(records, seeds, strip))
            judge_stats = judge.last_stats
            cons, cons_requests = judge_consistency(judging, judge, template, records)
            final_unparseable = not getattr(judge.backend, "retries_unparseable", True)
    rows = by_turn(records, seeds, verdicts or [], strip)
    overall = aggregate(verdicts) if verdicts is not None else None
    consistency = _summary(cons) if verdicts is not None else None
    columns, body = table(rows, overall)
    png = out_dir / PLOT_FILE
    note = plot(rows, consistency["accuracy"] if consistency else None, png) if rows else "no conversation: no plot"
    flat = scores(rows, consistency, records)
    ends = dict(sorted(Counter(r.reason for r in records).items()))
    meta: dict[str, Any] = {
        "name": f"{r.model.name} on {r.data.name}, dialogues with env={e.name}",
        "model": model_label(r),
        **({"model_checkpoint": source} if source else {}),
        "data": r.data.name,
        "conversations": len(records),
        "env": f"{e.name}, max_turns={e.max_turns}",
        "generation": generation_label(r),
        "judge_model": judge_model,
    }
    extra = {
        "dialogue": {
            "scores": flat,
            "by_turn": [{"turn": r["turn"], "replies": r["replies"], "rule": r["rule"], "rule_n": r["rule_n"],
                         "judge": {d: s.to_dict() for d, s in r["judge"].items()}} for r in rows],
            "consistency": consistency,
            "ends": ends,
            "turns_mean": flat["dialogue/turns_mean"],
            "noncanonical_replies": sum(r.noncanonical for r in records),
        },
        "counts": {
            "seeds": len(seeds), "conversations": len(records), "generated": played.n_new,
            "resumed": played.n_resumed, "missing": len(played.missing), "generation_requests": played.requests,
            "generation_faults": played.faults, "judgements": len(verdicts or []) + len(cons),
            "judge_cache_hits": (judge_stats.cache_hits if judge_stats else 0) + sum(v.cached for v in cons),
            "judge_requests": (judge_stats.requests if judge_stats else 0) + cons_requests,
        },
    }
    section = render(str(e.name), int(e.max_turns), records, columns, body, consistency, note,
                     len(played.missing))
    paths = write_report(out_dir, verdicts=None if verdicts is None else [*verdicts, *cons], meta=meta, extra=extra,
                         sections=[section])
    if png.is_file() and note is None:
        paths[PLOT_FILE] = png
    scalars = dict(flat)  # and the judge's accuracy over all turns, as evaluate logs it
    scalars.update({f"judge/{name}/accuracy": s.accuracy for name, s in (overall or {}).items()
                    if s.accuracy is not None})
    samples = [[rec.id, k, before[-1]["content"], reply, rec.reason] for rec in records
               for k, (before, reply) in enumerate(rec.replies, start=1)]
    log_to_loggers(make_loggers(logger) if logger else [], scalars, samples, ["id", "turn", "user", "reply", "end"],
                   tables={"dialogue_by_turn": (columns, [[str(c) for c in row] for row in body])},
                   images={"dialogue_by_turn": paths[PLOT_FILE]} if PLOT_FILE in paths else None)
    print_console(paths["summary.md"], judge=overall, sections=[section])
    if verdicts is not None and judge_stats is not None:
        missing = judge_stats.missing([*verdicts, *cons], final_unparseable=final_unparseable)
        if missing:
            n = len(verdicts) + len(cons)
            raise JudgeIncomplete(
                f"judge: {n - sum(missing.values())} of {n} verdicts obtained, missing "
                f"{', '.join(f'{k} {s}' for s, k in missing.items())}; the report in {out_dir} holds what was "
                "obtained; rerun the same command to ask only for the rest")
    return {"out_dir": str(out_dir), "paths": {k: str(p) for k, p in paths.items()}, "played": played,
            "verdicts": verdicts, "consistency": cons, "scores": flat, "by_turn": rows}
