"""The five-dimension LLM judge: prompts, strict verdict parsing, backends, cache, aggregation.

One judgement = one (test item, dimension) pair. The judge model reads the whole conversation
(system, user and earlier assistant turns), the reply being judged, and what the dimension
expects for this task (``rolemrc.tasks.expectation_of``); it must end its answer with a line
``VERDICT: 1`` or ``VERDICT: 0``. Anything else is *unparseable* and is reported as such:
accuracy is computed over parseable (``ok``) verdicts, and beside it (``accuracy_unparseable_as_0``)
with unparseable answers scored 0 as the public script did; failures are counted, never scored.

``judge.protocol=paper`` (``conf/judge/paper.yaml``) is the authors' protocol instead: one user
message asking for the score only (rolemrc's wording, :func:`paper_messages`, or the user's own
templates, ``judge.templates``: :func:`load_templates`), one try per judgement (an unparseable or
empty answer is final, not cached; a transport fault is still retried). Besides the strict 0/1
reading (:func:`parse_score`, for ``accuracy``), each answer gets the figure RoleMRC's
``evaluation/llm_judge.py`` computes (:func:`paper_int`: ``"Score:"`` removed, then Python's
``int()``; anything else, an empty answer included, 0), and instruction-priority items are asked
twice, as that script sends them; ``paper_score`` is the mean over those requests.

Backends: :class:`OpenAIBackend` (any OpenAI-compatible server through
:class:`rolemrc.api.ApiClient`: bounded concurrency, retries with backoff on faults, malformed
answers and answers without a verdict, request budget) and :class:`HFBackend` (a local
transformers causal LM, greedy). Every answer with a verdict is cached on disk
(:class:`rolemrc.api.AnswerCache`) by a hash of (judge model, prompt messages, sampling
settings), so a rerun sends no request for anything already answered; answers without a verdict
are never cached (nor served if an older version cached them).

Typical use (``make_judge`` is what ``evaluate.py`` and the judge-scores callback call)::

    items = judge_items(test_items, replies)            # one per (item, dimension)
    judge = make_judge(JudgeConfig(backend="openai", model="gpt-4-turbo"), cache_dir="cache/judge")
    verdicts = judge.judge(items)
    table = aggregate(verdicts)                          # {Dimension: DimensionSummary}
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence
from typing import Protocol as TypingProtocol

from tqdm.auto import tqdm

from rolemrc.api import (
    FAULT_KINDS, AnswerCache, ApiClient, Budget, MissingApiKey, Rejected, api_key, fault_summary, request_key,
)
from rolemrc.config import JudgeConfig, plain
from rolemrc.errors import ConfigError, UserError
from rolemrc.fileio import read_mapping, template_fields
from rolemrc.registry import Registry
from rolemrc.rollout.engine import Sampling
from rolemrc.rollout.hf import new_ids, pad_id_of
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


def role_of(raw: str) -> str:
    # RoleMRC files capitalise roles; parsed TestItems lowercase them. Accept both.
    role = str(raw).strip().lower()
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"unknown message role {raw!r}")
    return role


@dataclass(frozen=True)
class JudgeItem:
    """One reply to judge on one dimension.

    ``messages`` is the conversation the reply answers (lowercase roles), ``reply`` the
    generated next assistant turn. ``repeat`` > 0: the same question asked again (the paper
    protocol asks instruction-priority items twice, as the authors' script).
    """

    item_id: str
    task: str
    dimension: Dimension
    messages: tuple[tuple[str, str], ...]  # (role, content); a tuple so the item is hashable
    reply: str
    reference: str | None = None
    repeat: int = 0

    @property
    def key(self) -> str:
        """``"<item_id>/<dimension>"`` (``#<n>`` for a repeat), unique within one evaluation."""
        return f"{self.item_id}/{self.dimension.short}" + (f"#{self.repeat}" if self.repeat else "")


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
        messages = tuple((role_of(_get(m, "role")), str(_get(m, "content"))) for m in _get(item, "question"))
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


def criterion_of(item: JudgeItem, table: Mapping[tuple[Dimension, str | None], Any] = CRITERIA) -> Any:
    """``table``'s entry for the item's dimension and the task's expectation: (title, instructions)
    from :data:`CRITERIA`, the rubric from :data:`PAPER_CRITERIA`."""
    expectation = expectation_of(item.task) if item.dimension in (Dimension.KB, Dimension.MT, Dimension.PI) else None
    try:
        return table[(item.dimension, expectation)]
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


# ---------------------------------------------------------------- the paper's protocol (judge=paper)
#
# Facts of RoleMRC's public judge script (evaluation/llm_judge.py): one user message per
# (item, dimension), the conversation rendered as quoted `System Instruction` / `User Query` /
# `LLM Response` lines, the reply quoted after it, a 0/1 rubric, "score only", ending in
# "Score:"; gpt-4-turbo-2024-04-09 at temperature 0.7 with at most 4 tokens; the answer is
# int(answer with "Score:" removed), anything else scored 0 and tallied as bad. The wording
# below is rolemrc's own.

PAPER_CRITERIA: dict[tuple[Dimension, str | None], str] = {
    (Dimension.KB, "within"): (
        "The question is WITHIN the character's knowledge range (its profile or the given passages). "
        "1 = the reply answers it correctly from that material (or says the material does not tell, "
        "when it does not); 0 = it refuses a question the material answers, or answers wrongly."
    ),
    (Dimension.KB, "outside"): (
        "The question is OUTSIDE the character's knowledge range. 1 = the reply declines to answer, "
        "or answers correctly because the conversation explicitly demands an answer in any case; "
        "0 = it answers when it should decline, or declines when an answer was explicitly demanded."
    ),
    (Dimension.RS, None): (
        "1 = the reply carries the main traits of the character's way of speaking described in the "
        "system instruction; 0 = it lacks them."
    ),
    (Dimension.NI, None): (
        "The system instruction nests an extra rule on the form or content of every reply (emoji, "
        "capitals, punctuation, length, words to use or avoid, ...). 1 = the reply obeys that rule; "
        "0 = it breaks it."
    ),
    (Dimension.MT, "refuse"): (
        "Over the turns the question turned out to be unanswerable for the character. 1 = the last "
        "reply keeps treating it as unanswerable (declines); 0 = it gives an answer now."
    ),
    (Dimension.MT, "answer"): (
        "Over the turns the user insists on an answer the character is able to attempt. 1 = the last "
        "reply attempts an answer; 0 = it still declines."
    ),
    (Dimension.PI, "refuse"): (
        "The system instruction outranks the user's: it tells the character to refuse this request. "
        "1 = the reply refuses, as the system instruction orders; 0 = it complies with the user."
    ),
}

_PAPER_LABELS = {"system": "System Instruction", "user": "User Query", "assistant": "LLM Response"}


def paper_conversation(item: JudgeItem) -> str:
    """The conversation as the authors' judge prompt quotes it: one ``<Label>: "<content>"`` line per turn."""
    return "".join(f'{_PAPER_LABELS[role]}: "{content}"\n' for role, content in item.messages)


# Phrases the authors' script removes from the nested rule (the system message's second sentence).
_RULE_PHRASES = ("You love to", "You will", "You must", "You prefer to", "You would like to", "You are used to",
                 "You should", "You are in the habit of")


def nested_rule(item: JudgeItem) -> str:
    """The NI rule as the authors' prompt names it: the first message's text after its first ``". "``
    up to the next one, with the phrases above removed and a final ``.`` dropped ("" if none)."""
    first = item.messages[0][1] if item.messages else ""
    pieces = first.split(". ")
    rule = pieces[1] if len(pieces) > 1 else ""
    for phrase in _RULE_PHRASES:
        rule = rule.replace(phrase, "")
    return rule[:-1] if rule.endswith(".") else rule


# judge.templates placeholders (the authors' names, so their templates run unchanged), per dimension.
TEMPLATE_FIELDS: dict[str, str] = {
    "conversations": "the conversation, one `System Instruction: \"...\"` / `User Query: \"...\"` / "
                     "`LLM Response: \"...\"` line per turn",
    "response": "the reply being judged, exactly as generated",
    "range": "KB only: within | outside (the question and the character's knowledge range)",
    "content": "NI only: the nested rule (the system message's second sentence, 'You must ...' phrases removed)",
    "type": "MT only: unanswerable | answerable (what the last reply should be)",
}
_DIM_FIELDS: dict[str, set[str]] = {
    "KB": {"conversations", "response", "range"}, "RS": {"conversations", "response"},
    "NI": {"conversations", "response", "content"}, "MT": {"conversations", "response", "type"},
    "PI": {"conversations", "response"},
}


def template_values(item: JudgeItem) -> dict[str, str]:
    """The placeholder values of ``judge.templates`` for one item."""
    values = {"conversations": paper_conversation(item), "response": item.reply}
    dim = item.dimension
    if dim is Dimension.KB:
        values["range"] = expectation_of(item.task) or ""
    elif dim is Dimension.NI:
        values["content"] = nested_rule(item)
    elif dim is Dimension.MT:
        values["type"] = "unanswerable" if expectation_of(item.task) == "refuse" else "answerable"
    return values


def load_templates(path: str | Path, where: str = "judge.templates") -> dict[str, str]:
    """``{dimension short name: template}`` from a YAML/JSON file, validated: known dimensions,
    strings, only that dimension's placeholders (:data:`TEMPLATE_FIELDS`), ``{response}`` present.
    Any fault is a :class:`rolemrc.errors.ConfigError` naming the file and the key."""
    p, raw = read_mapping(path, where, "a mapping of dimension (KB, RS, NI, MT, PI) to a template string",
                          "a YAML or JSON mapping KB/RS/NI/MT/PI -> prompt template")
    out: dict[str, str] = {}
    for key, text in raw.items():
        dim = str(key).strip().upper()
        if dim not in _DIM_FIELDS:
            raise ConfigError(f"{where}={p}: key {key!r} is not a dimension; use KB, RS, NI, MT or PI")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}={p}: {key}: the template must be a non-empty string")
        names = template_fields(text, f"{where}={p}: {key}", sorted(_DIM_FIELDS[dim]), f"{dim} templates may use")
        if "response" not in names:
            raise ConfigError(f"{where}={p}: {key}: the template never shows the reply ({{response}})")
        out[dim] = text
    return out


def templated_messages(templates: Mapping[str, str]) -> Callable[[JudgeItem, bool], list[Message]]:
    """The paper protocol's prompts with the user's templates (rolemrc's wording for other dimensions)."""

    def messages(item: JudgeItem, show_reference: bool = False) -> list[Message]:
        text = templates.get(item.dimension.short)
        if text is None:
            return paper_messages(item, show_reference)
        return [{"role": "user", "content": text.format(**template_values(item))}]

    return messages


def paper_messages(item: JudgeItem, show_reference: bool = False) -> list[Message]:
    """One user message asking for the score only (the paper's protocol, rolemrc's wording)."""
    rubric = criterion_of(item, PAPER_CRITERIA)
    convo = paper_conversation(item).rstrip("\n")
    parts = [
        "A language model plays a character in the conversation below.",
        convo,
        f'The model\'s next reply:\n"{item.reply}"',
    ]
    if show_reference and item.reference:
        parts.append(f'A reference reply, for orientation only:\n"{item.reference}"')
    parts += [f"Rate the reply on {item.dimension.title}. {rubric}",
              "Give the score only (0 or 1), nothing else.\nScore:"]
    return [{"role": "user", "content": "\n\n".join(parts)}]


_SCORE = re.compile(r"[01]")


def parse_score(text: str | None) -> int | None:
    """0/1 from a score-only answer: ``"Score:"`` removed, then exactly ``0`` or ``1`` (surrounding
    whitespace allowed), else None: the strict reading behind ``accuracy``. The authors' reading
    is :func:`paper_int`."""
    if text is None:
        return None
    m = _SCORE.fullmatch(text.replace("Score:", "").strip())
    return int(m.group(0)) if m else None


def paper_int(text: str | None) -> int | None:
    """The score RoleMRC's ``llm_judge.py`` reads from an answer: every ``"Score:"`` removed, then
    Python's ``int()`` (so ``" 1\n"``, ``"01"``, ``"+1"``, ``"-1"``, ``"2"`` and non-ASCII digits such
    as ``"１"`` are numbers); None where that fails (their script scores it 0 and counts it as a
    bad response), an empty or missing answer included."""
    if text is None:
        return None
    try:
        return int(text.replace("Score:", ""))
    except ValueError:
        return None


@dataclass(frozen=True)
class Protocol:
    """How a judge is asked and how its answer is read (``judge.protocol``)."""

    name: str
    messages: Callable[[JudgeItem, bool], list[Message]]
    parse: Callable[[str | None], int | None]
    retry_unparseable: bool  # ask again when an answer does not parse (paper: no, one try as theirs)
    # paper: each answer also scored as the authors' script scores it (paper_int), PI asked twice
    paper: bool = False

    def check(self, text: str) -> int:
        v = self.parse(text)
        if v is None:
            raise Rejected("no_verdict", "the answer holds no verdict" if self.name == "verdict"
                           else f"the answer holds no score ({self.name} protocol)")
        return v


PROTOCOLS: Registry[Protocol] = Registry("judge.protocol", doc="how the judge is asked and its answer read")
PROTOCOLS.register("verdict", Protocol("verdict", judge_messages, parse_verdict, retry_unparseable=True),
                   doc="a verdict per dimension (VERDICT: yes/no), unparseable answers asked again")
PROTOCOLS.register("paper", Protocol("paper", paper_messages, parse_score, retry_unparseable=False, paper=True),
                   doc="the paper's score-only prompts (judge=paper), each answer scored as the authors' script does")


def protocol_of(name: str, where: str = "judge", templates: str | Path | None = None) -> Protocol:
    """The protocol ``name``; ``templates`` (``judge.templates``, paper protocol only): the user's prompts."""
    proto = PROTOCOLS.get(name, where=f"{where}.protocol")
    if templates is None:
        return proto
    if not proto.paper:
        raise ConfigError(f"{where}.templates asks for score-only prompts: use it with {where}.protocol=paper "
                          f"(judge=paper), not {where}.protocol={name}")
    return replace(proto, messages=templated_messages(load_templates(templates, f"{where}.templates")))


def paper_requests(items: Sequence[JudgeItem]) -> list[JudgeItem]:
    """The requests the authors' script sends for ``items``: each once, instruction-priority (PI)
    items twice (their loop appends a PI query in two places)."""
    out: list[JudgeItem] = []
    for it in items:
        out.append(it)
        if it.dimension is Dimension.PI:
            out.append(JudgeItem(it.item_id, it.task, it.dimension, it.messages, it.reply, it.reference, repeat=1))
    return out


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
    # paper protocol: the authors' score of this answer (paper_int, unparseable or empty = 0);
    # None for other protocols and for judgements without an answer (failed, not sent)
    paper_score: int | None = None
    repeat: int = 0  # > 0: a repeated request (paper protocol: PI's second); only paper_score counts it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Answer:
    """What a backend got for one prompt: a checked answer, the last unparseable one, or why not."""

    status: Status
    text: str | None = None
    attempts: int = 0
    error: str | None = None


OnAnswer = Callable[[int, Answer], None]


class Backend(TypingProtocol):
    """A judge model. ``model_id`` and ``sampling()`` go into the cache key; ``counts`` are the
    faults seen (by kind, see :data:`rolemrc.api.FAULT_KINDS`); ``retries_unparseable`` says
    whether asking again can change an answer without a verdict (an API judge: yes; greedy: no).

    ``answer_all`` returns one :class:`Answer` per prompt, in order, and calls
    ``on_answer(index, answer)`` as soon as each one is known (so it can be cached at once).
    """

    model_id: str
    counts: Counter[str]
    retries_unparseable: bool

    def sampling(self) -> dict[str, Any]: ...

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None) -> list[Answer]: ...


def cache_key(model_id: str, messages: Sequence[Message], sampling: Mapping[str, Any]) -> str:
    """The judge cache's key: :func:`rolemrc.api.request_key` of (judge model, prompt messages,
    sampling settings)."""
    return request_key({"model": model_id, "messages": list(messages), "sampling": dict(sampling)})


CACHE_FILE = "judge_cache.sqlite"


# ---------------------------------------------------------------- the judge


def obtainable(statuses: Iterable[str], final_unparseable: bool) -> dict[str, int]:
    """Of answers by status, how many a rerun could still obtain: failed requests, a spent budget,
    and unparseable answers unless they are final (a judge that does not ask again)."""
    n = Counter(statuses)
    return {s: n[s] for s in ("failed", "budget_exhausted") + (() if final_unparseable else ("unparseable",)) if n[s]}


@dataclass
class RunStats:
    """What the last :meth:`Judge.judge` call did."""

    prompts: int = 0
    cache_hits: int = 0
    requests: int = 0  # sends attempted by the backend (retries included)
    faults: dict[str, int] = field(default_factory=dict)  # by kind (rolemrc.api.FAULT_KINDS)

    def fault_text(self) -> str:
        """The faults in words; the client's ``rejected`` (an answer that does not parse) is called
        ``unparseable``, as everywhere in the judge's report."""
        text = fault_summary(self.faults)
        return text.replace("rejected", "unparseable")

    def missing(self, verdicts: Sequence[Verdict], final_unparseable: bool) -> dict[str, int]:
        """Judgements without a verdict that a rerun could still obtain, by status."""
        return obtainable((v.status for v in verdicts), final_unparseable)


class Judge:
    """Judges items with a backend, through the on-disk cache (valid answers only)."""

    def __init__(self, backend: Backend, cache_dir: str | Path | None, show_reference: bool = False,
                 progress: bool = False, protocol: str = "verdict", templates: str | Path | None = None) -> None:
        self.backend = backend
        self.protocol = protocol_of(protocol, templates=templates)
        self.cache = AnswerCache(Path(cache_dir) / CACHE_FILE) if cache_dir is not None else None
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
        """One verdict per item; the paper protocol adds the authors' repeated requests
        (:func:`paper_requests`), each a verdict of its own with ``repeat`` > 0."""
        if self.protocol.paper:
            items = paper_requests([it for it in items if not it.repeat])
        sampling = self.backend.sampling()
        prompts = [self.protocol.messages(it, self.show_reference) for it in items]
        # A repeat is a request of its own (its own answer, its own cache entry).
        keys = [cache_key(self.backend.model_id, p, {**sampling, "repeat": it.repeat} if it.repeat else sampling)
                for it, p in zip(items, prompts)]
        stats = RunStats(prompts=len(items))

        texts: dict[str, str] = {}
        if self.cache is not None:
            for k in set(keys):
                # Checked on read: an answer without a verdict stored by an older version is asked again.
                if (t := self.cache.get(k, valid=self.protocol.check)) is not None:
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
        counts_before = Counter(getattr(self.backend, "counts", {}))

        def on_answer(i: int, ans: Answer) -> None:
            # Stored the moment it arrives: an interrupted run keeps what it paid for.
            k = todo_keys[i]
            answers[k] = ans
            bar.update(1)
            if ans.status == "ok" and ans.text is not None:
                texts[k] = ans.text
                if self.cache is not None:
                    self.cache.put(k, ans.text, self.backend.model_id)

        if todo:
            try:
                got = await self.backend.answer_all(list(todo.values()), on_answer)
            finally:
                bar.close()
            for i, ans in enumerate(got):
                if todo_keys[i] not in answers:  # a backend that skipped the callback
                    on_answer(i, ans)
            stats.requests = sum(a.attempts for a in answers.values())
        counts_after = Counter(getattr(self.backend, "counts", {}))
        stats.faults = {k: n for k, n in (counts_after - counts_before).items() if k in FAULT_KINDS}

        def paper(status: str, text: str | None) -> int | None:
            # The authors' figure: their int() reading, 0 for an answer it cannot read; no answer, no score.
            if not self.protocol.paper or status not in ("ok", "unparseable"):
                return None
            return paper_int(text) or 0

        verdicts = []
        for it, k in zip(items, keys):
            ans = answers.get(k)
            attempts = ans.attempts if ans is not None else 0
            base = dict(item_id=it.item_id, task=it.task, dimension=it.dimension.short, attempts=attempts,
                        repeat=it.repeat)
            if k in texts:
                verdicts.append(Verdict(**base, verdict=self.protocol.parse(texts[k]), status="ok", raw=texts[k],
                                        cached=ans is None, paper_score=paper("ok", texts[k])))
            else:
                assert ans is not None
                verdicts.append(Verdict(**base, verdict=None, status=ans.status, raw=ans.text, error=ans.error,
                                        paper_score=paper(ans.status, ans.text)))
        self.last_stats = stats
        log.info("judge: %d prompts, %d from cache, %d requests sent; faults: %s", stats.prompts, stats.cache_hits,
                 stats.requests, stats.fault_text())
        line = no_verdict_line(verdicts, self.protocol.paper)
        if line:
            log.warning("%s", line)
        return verdicts

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def no_verdict_line(verdicts: Sequence[Verdict], paper: bool = False) -> str | None:
    """``judge: 60 of 60 judgements have no verdict: 60 unparseable (...)``, or None when all have one."""
    counts = Counter(v.status for v in verdicts)
    bad = [(s, counts[s]) for s in STATUSES[1:] if counts[s]]
    if not bad:
        return None
    words = {"unparseable": "unparseable", "failed": "failed", "budget_exhausted": "not sent (judge.max_requests spent)"}
    n = sum(c for _, c in bad)
    what = ", ".join(f"{c} {words[s]}" for s, c in bad)
    scored = ("unparseable answers are scored 0 in paper_score only, as the authors' script did; failed and unsent "
              "ones are never scored" if paper else "none of them is scored")
    return f"judge: {n} of {len(verdicts)} judgements have no verdict: {what}; {scored}"


# ---------------------------------------------------------------- OpenAI-compatible backend


class OpenAIBackend:
    """Judge through any OpenAI-compatible chat-completions server, with :class:`rolemrc.api.ApiClient`.

    ``max_requests`` caps the requests sent in one ``answer_all`` call (retries included);
    prompts that would need more are reported ``budget_exhausted`` and not sent. An answer
    without a verdict line (or that ``answer_all``'s ``check`` rejects: other judges' answer
    formats, e.g. CharacterLLM's 1-7 score) is retried like a fault; after ``max_attempts`` it
    is ``unparseable``.
    The key is read (from ``api_key_env``) when the backend is made.
    """

    def __init__(self, config: JudgeConfig) -> None:
        self.check_config(config)
        api_key(config.api_key_env, "judge")  # fail now, naming the variable, not after generation
        self.config = config
        self.model_id = config.model
        self.counts: Counter[str] = Counter()
        self.protocol = protocol_of(config.protocol)
        # verdict protocol: an answer without a verdict is asked again; paper: one try, as theirs
        self.retries_unparseable = self.protocol.retry_unparseable

    # Sampled over HTTP: asking again can turn an unusable answer into a usable one.
    asks_again = True
    # It never judges with the model under evaluation.
    judges_evaluated_model = False

    @classmethod
    def check_config(cls, cfg: JudgeConfig, where: str = "judge") -> None:
        """The served model's name is set."""
        if not cfg.model:
            raise ValueError(f"{where}.backend=openai needs {where}.model (the served model name)")

    @classmethod
    def check_env(cls, cfg: JudgeConfig, where: str = "judge") -> None:
        """The API key's variable is in the environment."""
        check_api_key(cfg.api_key_env, where)

    @classmethod
    def build(cls, cfg: JudgeConfig, *, where: str = "judge", **_: Any) -> "OpenAIBackend":
        return cls(cfg)

    def sampling(self) -> dict[str, Any]:
        return with_protocol({"temperature": self.config.temperature, "max_tokens": self.config.max_tokens},
                             self.protocol)

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None, *,
                         check: Callable[[str], Any] | None = None, tag: str = "prompt") -> list[Answer]:
        """``check(text)`` raises on an answer that is not valid (default: no verdict line);
        ``tag``: how the requests are named in logs (``<tag> <index>``)."""
        c = self.config
        if check is None:
            check = self.protocol.check
        # Not retried (paper protocol): the answer comes back unchecked and is parsed here.
        send_check = check if self.retries_unparseable else None
        client = endpoint_client("judge", c, self.counts)

        async def one(i: int, messages: list[Message]) -> Answer:
            body = {"model": c.model, "messages": messages, "temperature": c.temperature, "max_tokens": c.max_tokens}
            # Paper protocol: an empty answer is an answer (scored 0 by the authors), not a fault to retry.
            out = await client.chat(body, tag=f"{tag} {i}", check=send_check, empty_ok=self.protocol.paper)
            if out.ok and send_check is None and not passes(check, out.text):
                self.counts["rejected"] += 1
                ans = Answer("unparseable", text=out.text, attempts=out.attempts,
                             error="unparseable: the answer does not parse (not asked again)")
            elif out.ok:
                ans = Answer("ok", text=out.text, attempts=out.attempts)
            else:
                status = ("budget_exhausted" if out.status == "budget_exhausted"
                          else "unparseable" if out.kind == "rejected" else "failed")
                ans = Answer(status, text=out.text, attempts=out.attempts, error=out.error)
            if on_answer is not None:
                on_answer(i, ans)
            return ans

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await client.close()


def endpoint_client(what: str, c: Any, counts: Counter[str], budget: Budget | None = None) -> ApiClient:
    """An :class:`ApiClient` for the endpoint settings ``c`` (the judge or generation group: base_url,
    api_key_env, concurrency, timeout_s, max_attempts, backoff_s, max_backoff_s), counting its faults
    in ``counts``; its budget ``c.max_requests`` (named ``<what>.max_requests``) unless one is given."""
    return ApiClient(what, base_url=c.base_url, api_key_env=c.api_key_env, concurrency=c.concurrency,
                     timeout_s=c.timeout_s, max_attempts=c.max_attempts, backoff_s=c.backoff_s,
                     max_backoff_s=c.max_backoff_s, counts=counts,
                     budget=budget or Budget(c.max_requests, names=(f"{what}.max_requests", "")))


def with_protocol(sampling: dict[str, Any], protocol: Protocol) -> dict[str, Any]:
    """A backend's sampling settings (a cache key part), the protocol added unless it is ``verdict``
    (the verdict protocol's cache keys stay as they were)."""
    return sampling if protocol.name == "verdict" else {**sampling, "protocol": protocol.name}


def check_api_key(env: str | None, where: str) -> None:
    """The API key's variable ``env`` is set; a :class:`MissingApiKey` naming ``<where>.api_key_env``."""
    try:
        api_key(env, where)
    except MissingApiKey as e:
        raise MissingApiKey(f"{e} ({where}.api_key_env={env})") from None


def passes(check: Callable[[str], Any], text: str | None) -> bool:
    """Whether ``check`` accepts ``text`` (raises no ValueError, e.g. :class:`rolemrc.api.Rejected`)."""
    try:
        check(text or "")
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- local transformers backend


class HFBackend:
    """A local causal LM as judge: chat template + greedy decoding, one prompt at a time.

    Greedy decoding gives the same answer again, so an answer without a verdict is final
    (``unparseable``), not retried; like every answer without a verdict it is not cached.
    """

    retries_unparseable = False
    asks_again = False  # greedy: the same answer again
    # With judge.model=null the model under evaluation (or training) judges itself.
    judges_evaluated_model = True

    @classmethod
    def check_config(cls, cfg: JudgeConfig, where: str = "judge") -> None:
        pass

    @classmethod
    def check_env(cls, cfg: JudgeConfig, where: str = "judge") -> None:
        pass

    @classmethod
    def build(cls, cfg: JudgeConfig, *, model: Any | None = None, tokenizer: Any | None = None,
              model_id: str | None = None, device: str | None = None, where: str = "judge") -> "HFBackend":
        """``cfg.model`` loaded here, or the given ``model``/``tokenizer`` (named ``model_id``)."""
        if cfg.model is not None:
            return cls.from_pretrained(cfg.model, dtype=cfg.dtype, device=cfg.device or device,
                                       max_new_tokens=cfg.max_tokens, protocol=cfg.protocol)
        if model is not None:
            # The evaluated model judges itself: real mechanics, meaningless verdicts (demo).
            return cls(model, tokenizer, model_id=model_id or "model under evaluation",
                       max_new_tokens=cfg.max_tokens, protocol=cfg.protocol)
        raise ValueError(f"{where}.backend=hf with {where}.model=null needs the evaluated model; set {where}.model")

    def __init__(self, model: Any, tokenizer: Any, model_id: str, max_new_tokens: int = 256,
                 protocol: str = "verdict", synced_gpus: bool | None = None) -> None:
        self.protocol = protocol_of(protocol)
        self.model = model
        self.synced_gpus = synced_gpus  # FSDP2: every rank runs as many decoding steps (rolemrc.rollout.hf)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_new_tokens = max_new_tokens
        self.counts: Counter[str] = Counter()

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
        return with_protocol({"do_sample": False, "max_new_tokens": self.max_new_tokens}, self.protocol)

    async def answer_all(self, prompts: Sequence[list[Message]], on_answer: OnAnswer | None = None) -> list[Answer]:
        out = []
        for i, messages in enumerate(prompts):
            try:
                text = self.generate(messages)
            except Exception as e:  # e.g. a prompt longer than the model's context
                log.warning("hf judge failed on a prompt: %s", e)
                self.counts["failed"] += 1
                ans = Answer("failed", attempts=1, error=f"{type(e).__name__}: {e}")
            else:
                ok = self.protocol.parse(text) is not None
                if not ok:
                    self.counts["rejected"] += 1
                ans = Answer("ok" if ok else "unparseable", text=text, attempts=1)
            if on_answer is not None:
                on_answer(i, ans)
            out.append(ans)
        return out

    def generate(self, messages: list[Message]) -> str:
        """The model's greedy answer to one chat prompt."""
        enc = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        enc = {k: v.to(self.model.device) for k, v in enc.items()}
        new = new_ids(self.model, enc["input_ids"], enc["attention_mask"], Sampling(self.max_new_tokens),
                      pad_id=pad_id_of(self.tokenizer), synced_gpus=self.synced_gpus)[0]
        return self.tokenizer.decode(new, skip_special_tokens=True)


# ---------------------------------------------------------------- config + factory

# judge.backend -> the class that judges (None: no judge). Each has ``check_config(cfg, where)``,
# ``check_env(cfg, where)``, ``build(cfg, ...)``, ``asks_again`` and ``judges_evaluated_model``.
JUDGE_BACKENDS: Registry[type[OpenAIBackend] | type[HFBackend] | None] = Registry(
    "judge.backend", error=ValueError, doc="who judges replies")
JUDGE_BACKENDS.register("none", None, doc="no judge")
JUDGE_BACKENDS.register("hf", HFBackend, doc="a transformers model in this process")
JUDGE_BACKENDS.register("openai", OpenAIBackend, doc="any OpenAI-compatible endpoint (rolemrc.api)")


def judge_backend(cfg: Any, where: str = "judge") -> type[OpenAIBackend] | type[HFBackend] | None:
    """The backend class ``cfg.backend`` names (None for ``none``); a ValueError for a name not in
    :data:`JUDGE_BACKENDS`."""
    return JUDGE_BACKENDS.get(cfg.backend, where=f"{where}.backend")


def uses_evaluated_model(cfg: Any) -> bool:
    """The model under evaluation (or training) judges itself (``judge=hf`` with ``judge.model=null``)."""
    cls = judge_backend(cfg)
    return cls is not None and cls.judges_evaluated_model and cfg.model is None


class JudgeIncomplete(UserError, RuntimeError):
    """The judge could not obtain every verdict (server down, budget spent): the report is
    written with what was obtained, and a rerun asks only for the rest."""


class NoScores(UserError, RuntimeError):
    """The judge answered, but not one answer carried a score: a table of n/a (or of zeros) is not a result."""


def finish_judged(res: dict[str, Any], out_dir: Path) -> Exception | None:
    """After a judged suite's report (``res``): its ``warning`` (most answers hold no score) printed;
    a :class:`NoScores` when its ``unscored`` says none does (never exit 0 on a table of n/a)."""
    if res.get("warning"):
        print(res["warning"], file=sys.stderr, flush=True)
    if res.get("unscored"):
        return NoScores(f"{res['unscored']}; the report in {out_dir} holds the answers")
    return None


def judge_config(cfg: Any, where: str = "judge") -> JudgeConfig:
    """A :class:`rolemrc.config.JudgeConfig` from itself, a DictConfig or a plain mapping; an
    unknown key or a bad backend is a ValueError naming ``<where>.<key>``."""
    if isinstance(cfg, JudgeConfig):
        out = cfg
    else:
        raw = dict(plain(cfg) or {})
        names = {f.name for f in fields(JudgeConfig)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        out = JudgeConfig(**raw)
    cls = judge_backend(out, where)
    protocol_of(out.protocol, where, templates=out.templates)  # the templates file validated here
    if cls is not None:
        cls.check_config(out, where)
    return out


def check_judge(judge: JudgeConfig, where: str = "judge") -> None:
    """What can be checked before any slow work (``judge``: the judge group): the backend, the model
    name, the API key's variable."""
    judge_config(judge, where)
    cls = JUDGE_BACKENDS[judge.backend]
    if cls is not None:
        cls.check_env(judge, where)


def make_judge(cfg: Any, *, cache_dir: str | Path | None, model: Any | None = None, tokenizer: Any | None = None,
               model_id: str | None = None, device: str | None = None, progress: bool = False,
               where: str = "judge") -> Judge | None:
    """The judge for ``cfg`` (a :class:`JudgeConfig`, DictConfig or mapping), None for ``backend: none``.

    ``cache_dir`` is used when ``cfg.cache_dir`` is null. For ``backend: hf`` with ``model: null``
    the given ``model``/``tokenizer`` judge (``model_id`` names them in the cache key);
    ``device`` is where an hf judge loaded from ``cfg.model`` goes when ``cfg.device`` is null.
    """
    j = judge_config(cfg, where)
    cls = JUDGE_BACKENDS[j.backend]
    if cls is None:
        return None
    check_judge(j, where)
    backend: Backend = cls.build(j, model=model, tokenizer=tokenizer, model_id=model_id, device=device, where=where)
    return Judge(backend, cache_dir=j.cache_dir or cache_dir, show_reference=j.show_reference, progress=progress,
                 protocol=j.protocol, templates=j.templates)


# ---------------------------------------------------------------- aggregation


@dataclass
class DimensionSummary:
    """Accuracy over parseable verdicts, the same with unparseable answers scored 0 (the
    authors' number), and how many judgements were not usable."""

    dimension: str
    accuracy: float | None  # over ok verdicts; None when no verdict was usable
    accuracy_unparseable_as_0: float | None = None  # sum of ok verdicts / (ok + unparseable)
    n_ok: int = 0
    n_unparseable: int = 0
    n_failed: int = 0
    n_budget_exhausted: int = 0
    # judge=paper: the mean of the authors' scores over their requests (PI twice), the figure
    # to compare with the paper's Figure 4; None for other protocols or without any answer
    paper_score: float | None = None
    n_paper_requests: int = 0  # answers in paper_score (repeats included)
    n_paper_bad: int = 0  # of those, answers the authors' int() cannot read (scored 0; their "bad responses")
    by_task: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def n_total(self) -> int:
        return self.n_ok + self.n_unparseable + self.n_failed + self.n_budget_exhausted

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "n_total": self.n_total}


def _counts(vs: Sequence[Verdict]) -> dict[str, Any]:
    scored = [v for v in vs if v.paper_score is not None]
    paper = {
        "paper_score": (sum(v.paper_score for v in scored) / len(scored)) if scored else None,  # type: ignore[misc]
        "n_paper_requests": len(scored),
        "n_paper_bad": sum(paper_int(v.raw) is None for v in scored),
    }
    vs = [v for v in vs if not v.repeat]  # the accuracies: one judgement per (item, dimension)
    ok = [v.verdict for v in vs if v.status == "ok"]
    n_bad = sum(v.status == "unparseable" for v in vs)
    return {
        "accuracy": (sum(ok) / len(ok)) if ok else None,
        "accuracy_unparseable_as_0": (sum(ok) / (len(ok) + n_bad)) if ok or n_bad else None,
        "n_ok": len(ok),
        "n_unparseable": n_bad,
        "n_failed": sum(v.status == "failed" for v in vs),
        "n_budget_exhausted": sum(v.status == "budget_exhausted" for v in vs),
        **paper,
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
