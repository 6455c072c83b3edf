"""CoSER given-circumstance acting (GCA): book scenes re-enacted by the model, judged on four
dimensions, plus BLEU and ROUGE-L against the original dialogue, as the CoSER authors compute them
(``Neph0s/CoSER``, ``gca_evaluation``).

``data.coser.test_file`` is the released ``test_set.json``: a JSON list of scenes, each with
``book``, ``i_c``, ``scenario``, ``plot`` (``i_p``, ``summary``, ``key_characters`` with ``name``
and ``description``), ``key_characters``, ``dialogues`` (``[{character, message}]``),
``speaking_characters_w_env``, ``major_characters`` and ``character_profiles``. A scene's id is
``{book}-{plot.i_p}-{i_c}``, as the authors name it.

**Simulation** (any generation backend but ``file``): every character of
``speaking_characters_w_env`` is played by the evaluated model, the ``Environment`` by the
environment model (``data.coser.environment``) and the turn order by the next-speaker model
(``data.coser.nsp``); both are judge-style backends (``openai``: any OpenAI-compatible server;
``hf``: a local model, ``model: null`` = the evaluated one). Each agent keeps its own history:
its system prompt, the opening message, its own turns as ``assistant`` and everyone else's as
``user`` (``Name: text``, thoughts removed); consecutive messages of one role are joined with a
blank line. The scene opens with the first of ``speaking_characters_w_env``; after each turn the
next-speaker model names who acts next. ``<END CHAT>`` ends the scene from round
``data.coser.end_after`` on; an answer naming nobody valid (or the one who just spoke) is replaced
by a random pick among the major characters and the Environment (seeded per scene). At most
``data.coser.max_rounds`` rounds. With ``generation.backend=file``, ``generation.path`` holds the
whole simulated dialogues instead (their ``exp/simulation/*.json`` layout, or JSON lines of the
same records) and nothing is simulated.

**Scoring**: the next-speaker messages are dropped; thoughts (``[...]``) are removed from every
message but the Environment's; the simulation is the messages joined by a blank line, the
reference ``Name: message`` lines likewise. BLEU is NLTK's ``sentence_bleu`` (default weights, no
smoothing) on ``word_tokenize`` of the lower-cased texts; ROUGE-L is the F of the ``rouge``
package (``Rouge().get_scores(simulation, reference)``). The judge (``judge=...``) is asked once
per dimension with the user's critic template as system message and the simulation as user
message; it answers JSON ``{dimension: {"flaws": [{"instance", "type", "severity"}]}}``. A
dimension's score is ``max(0, min(100 - (sum of integer severities - 0.3 * actor turns) * 5,
100))`` (a flaw without a severity counts 1; actor turns = the non-Environment messages). The
report gives each dimension's mean over scenes, their average, and the mean BLEU and ROUGE-L.

The prompt texts (the characters', the environment's, the next-speaker's and the critic's) are
the authors' and not shipped: ``data.coser.templates`` names a YAML file holding them (see
:func:`load_templates`); rolemrc's sample ships a short original one for the mechanics.
"""

from __future__ import annotations

import json
import logging
import random
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rolemrc.api import AnswerCache, Rejected
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.bench.ask import ask_judge, suite_judge
from rolemrc.eval.generation import model_label
from rolemrc.eval.metrics import ensure_punkt
from rolemrc.eval.judge import (
    JUDGE_BACKENDS, check_judge, judge_backend, judge_config, obtainable, uses_evaluated_model,
)
from rolemrc.eval.report import fmt, mean, status_table
from rolemrc.fileio import read_mapping

log = logging.getLogger(__name__)

ENVIRONMENT = "Environment"
NSP = "NSP"
END = "<END CHAT>"
# The critic answers with a JSON list of flaws per dimension, often thousands of tokens: the
# judge's answer length docs/coser.md recommends (judge.max_tokens); below it answers may be cut off.
JUDGE_MAX_TOKENS = 8192
DIMENSIONS = ("Storyline Consistency", "Anthropomorphism", "Character Fidelity", "Storyline Quality")
KEYS = {"Storyline Consistency": "storyline_consistency", "Anthropomorphism": "anthropomorphism",
        "Character Fidelity": "character_fidelity", "Storyline Quality": "storyline_quality"}

# placeholder -> meaning, per template; the character/environment/nsp ones are needed to simulate only
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "character": ("character", "book", "profile", "scenario", "plot_summary", "other_profiles", "motivation",
                  "thought"),
    "environment": ("major_characters", "scenario"),
    "nsp": ("characters", "scenario"),
    "judge": ("book", "plot_summary", "scenario", "character_profiles", "original_conversation",
              "major_characters", "additional_instructions", "dimension_name", "dimension_brief",
              "dimension_criteria"),
}
SIMULATION_TEMPLATES = ("character", "environment", "nsp")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


# ---------------------------------------------------------------- text: the authors' rules


def remove_thoughts(text: str) -> str:
    """A message with its ``[thoughts]`` removed: brackets cut, every line stripped, runs of
    newlines made one, ``<system_thinking>``/``<role_thinking>``-style blocks dropped, stripped."""
    out = re.sub(r"\[.*?\]", "", text)
    out = "\n".join(line.strip() for line in out.split("\n"))
    out = re.sub(r"\n+", "\n", out)
    for inner in (r"system[_\s]+", r"role[_\s]+", r"[_\s]+"):
        tag = inner + r"think(?:ing)?\s*"
        out = re.sub(rf"\s*<\s*{tag}>.*?</\s*{tag}>\s*", "", out, flags=re.S).strip()
    return out.strip()


def with_speaker(text: str, speaker: str) -> str:
    """``Name: text`` unless a line of ``text`` already starts with the name and a colon."""
    if any(ln.strip().startswith((f"{speaker}:", f"{speaker}：")) for ln in text.split("\n")):
        return text
    return f"{speaker}: {text}"


_NEXT = re.compile(r"(?:\*\*|#)?\s*Next\s+Speaker\s*(?:\*\*|#)?\s*(?:[:\-]|\bis\b)?\s*\*?([^\n*]+)", re.IGNORECASE)


def next_speaker(text: str) -> str:
    """The name a next-speaker answer gives: the last ``Next Speaker: <name>``, else the text
    before the first colon, else the whole answer."""
    found = _NEXT.findall(text)
    if found:
        name = found[-1].strip().rstrip(".,!\"'").replace("*", "")
        if name:
            return name
    return text.split(":")[0].strip() if ":" in text else text


def simulation_text(simulation: Sequence[dict[str, str]]) -> tuple[list[dict[str, str]], str]:
    """The simulation as scored: next-speaker messages dropped, thoughts removed (not the
    Environment's), and the messages joined by a blank line."""
    kept = [m for m in simulation if m["role"] != NSP]
    kept = [m if m["role"] == ENVIRONMENT else {**m, "content": remove_thoughts(m["content"])} for m in kept]
    return kept, "\n\n".join(m["content"].strip("\n") for m in kept)


def reference_text(dialogues: Sequence[dict[str, str]]) -> str:
    """The original dialogue as scored: ``Name: message`` (thoughts removed but the Environment's)."""
    ref = [m if m["character"] == ENVIRONMENT else {**m, "message": remove_thoughts(m["message"])} for m in dialogues]
    return "\n\n".join(f"{m['character']}: {m['message']}".strip("\n") for m in ref)


def bleu_rouge(reference: str, simulation: str) -> tuple[float, float | None]:
    """Sentence BLEU (NLTK defaults, no smoothing) on lower-cased ``word_tokenize`` tokens, and the
    ``rouge`` package's ROUGE-L F of the simulation against the reference (None for an empty
    simulation, which that package refuses)."""
    from nltk.tokenize import word_tokenize
    from nltk.translate.bleu_score import sentence_bleu
    from rouge import Rouge

    ensure_punkt()
    with warnings.catch_warnings():  # NLTK warns when an n-gram order has no match (BLEU is then 0)
        warnings.simplefilter("ignore")
        bleu = float(sentence_bleu([word_tokenize(reference.lower())], word_tokenize(simulation.lower())))
    try:
        rouge_l: float | None = float(Rouge().get_scores(simulation, reference)[0]["rouge-l"]["f"])
    except ValueError:  # "Hypothesis is empty."
        rouge_l = None
    return bleu, rouge_l


def extract_json(text: str) -> Any:
    """The JSON value of a judge answer: the whole text, else the longest JSON object found in it
    (newlines inside quoted strings escaped first); None when there is none."""
    text = re.sub(r'"([^"\\]*(\\.[^"\\]*)*)"', lambda m: m.group().replace("\n", r"\n"), text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    found = []
    dec = json.JSONDecoder()
    i = 0
    while i < len(text):
        try:
            obj, end = dec.raw_decode(text[i:])
        except json.JSONDecodeError:
            i += 1
            continue
        found.append(obj)
        i += max(end, 1)
    return max(found, key=lambda o: len(json.dumps(o))) if found else None


def parse_critique(text: str | None, dimension: str) -> list[dict[str, Any]] | None:
    """The flaws a judge answer lists for ``dimension``; None when the answer is not a mapping of
    dimension names to ``{"flaws": [...]}`` with ``dimension`` among them. A flaw without a
    severity gets severity 1."""
    doc = extract_json(text or "")
    if not isinstance(doc, dict) or dimension not in doc:
        return None
    for k, v in doc.items():
        if k not in DIMENSIONS or not isinstance(v, dict) or not isinstance(v.get("flaws"), list):
            return None
        if not all(isinstance(f, dict) for f in v["flaws"]):
            return None
    flaws = [dict(f) for f in doc[dimension]["flaws"]]
    for f in flaws:
        if f.get("severity") is None:
            f["severity"] = 1
    return flaws


def dimension_score(flaws: Sequence[dict[str, Any]], actor_rounds: int) -> float:
    """``max(0, min(100 - (sum of integer severities - 0.3 * actor_rounds) * 5, 100))``."""
    total = sum(f["severity"] for f in flaws if isinstance(f["severity"], int))
    return max(0, min(100 - (total - 0.3 * actor_rounds) * 5, 100))


# ---------------------------------------------------------------- the test set


@dataclass
class Scene:
    id: str
    book: str
    i_p: int
    i_c: int
    scenario: str
    plot_summary: str
    speakers: list[str]  # speaking_characters_w_env, the Environment appended when absent
    major: list[str]
    profiles: dict[str, str]  # the characters' profiles the agents and the judge see
    motivations: dict[str, str]  # key_characters' "motivation" (the authors' prompt reads this field)
    thoughts: dict[str, str]  # key_characters' "thought"
    dialogues: list[dict[str, str]]


def _field(rec: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if key not in rec:
        raise DataError(f"{where}: no field '{key}' ({what}); is this CoSER's test_set.json?")
    val = rec[key]
    if not isinstance(val, kind) or isinstance(val, bool):
        raise DataError(f"{where}: field '{key}' must be {what}, got {type(val).__name__}")
    return val


def _names(items: Any, where: str, key: str) -> list[dict[str, Any]]:
    for j, c in enumerate(items):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise DataError(f"{where}: {key}[{j}] needs a string field 'name'")
    return list(items)


def scene_of(rec: Any, where: str) -> Scene:
    """One record of the test set, checked field by field (``where`` names file and record)."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected an object, got {type(rec).__name__}")
    book = _field(rec, "book", str, where, "the book's title (a string)")
    plot = _field(rec, "plot", dict, where, "an object with i_p, summary and key_characters")
    # The authors name a scene by its plot's i_p (equal to the record's in test_set.json, not in
    # example_test_set.json, whose records count plots otherwise).
    i_p = _field(plot, "i_p", int, f"{where}: plot", "the plot index (an integer)")
    i_c = _field(rec, "i_c", int, where, "the conversation index (an integer)")
    where = f"{where} ({book}-{i_p}-{i_c})"
    scenario = _field(rec, "scenario", str, where, "a string")
    summary = _field(plot, "summary", str, f"{where}: plot", "a string")
    plot_chars = _names(_field(plot, "key_characters", list, f"{where}: plot", "a list"), where, "plot.key_characters")
    keys = _names(_field(rec, "key_characters", list, where, "a list of {name, ...}"), where, "key_characters")
    speakers = list(_field(rec, "speaking_characters_w_env", list, where, "a list of names"))
    major = list(_field(rec, "major_characters", list, where, "a list of names"))
    for key, names in (("speaking_characters_w_env", speakers), ("major_characters", major)):
        if not names or not all(isinstance(n, str) and n for n in names):
            raise DataError(f"{where}: field '{key}' must be a non-empty list of names")
    profiles = _field(rec, "character_profiles", dict, where, "an object {name: profile}")
    if not all(isinstance(v, str) for v in profiles.values()):
        raise DataError(f"{where}: field 'character_profiles' must map names to strings")
    dialogues = _field(rec, "dialogues", list, where, "a list of {character, message}")
    for j, m in enumerate(dialogues):
        if not isinstance(m, dict) or not isinstance(m.get("character"), str) or not isinstance(m.get("message"), str):
            raise DataError(f"{where}: dialogues[{j}] needs string fields 'character' and 'message'")
    if ENVIRONMENT not in speakers:
        speakers.append(ENVIRONMENT)
    involved: dict[str, str] = {}
    for name in speakers:  # the authors' profile: the plot's description of the character, then its profile
        if name == ENVIRONMENT:
            continue
        text = profiles.get(name, "")
        info = next((c for c in plot_chars if c["name"] == name), None)
        if info is not None and "description" in info:
            text = str(info.get("description") or "").strip("\n") + "\n\n" + text.strip("\n")
        text = text.strip(" \n")
        if text:
            involved[name] = text
    return Scene(id=f"{book}-{i_p}-{i_c}", book=book, i_p=i_p, i_c=i_c, scenario=scenario, plot_summary=summary,
                 speakers=speakers, major=major, profiles=involved,
                 motivations={c["name"]: str(c.get("motivation") or "") for c in keys},
                 thoughts={c["name"]: str(c.get("thought") or "") for c in keys},
                 dialogues=[{"character": m["character"], "message": m["message"]} for m in dialogues])


def read_test_set(path: str | Path) -> list[Scene]:
    """Every scene of a CoSER test file (a JSON list); a record that differs from the released
    layout is a :class:`DataError` naming the file, the record and the field."""
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise InputNotFound(f"data.coser.test_file: no such file: {p} (CoSER's data/test/test_set.json)")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(doc, list) or not doc:
        raise DataError(f"{p}: expected a non-empty JSON list of scenes (CoSER's test_set.json)")
    scenes = [scene_of(rec, f"{p}: record [{i}]") for i, rec in enumerate(doc)]
    seen: dict[str, int] = {}
    for i, s in enumerate(scenes):
        if s.id in seen:
            raise DataError(f"{p}: records [{seen[s.id]}] and [{i}] share the id {s.id}")
        seen[s.id] = i
    return scenes


# ---------------------------------------------------------------- templates


@dataclass
class Templates:
    judge: str
    dimensions: dict[str, tuple[str, str]]  # name -> (brief, criteria)
    character: str | None = None
    environment: str | None = None
    nsp: str | None = None
    start: str = ""  # the message every agent's history opens with


def fill(template: str, values: dict[str, str]) -> str:
    """``{name}`` placeholders replaced in one pass (other braces, e.g. a JSON example, kept)."""
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def load_templates(path: str | Path, simulate: bool, where: str = "data.coser.templates") -> Templates:
    """The prompts from a YAML (or JSON) mapping: ``judge`` (the critic's system prompt),
    ``dimensions`` (each of the four names -> ``{brief, criteria}``), and, to simulate,
    ``character``, ``environment`` and ``nsp`` (system prompts), optional ``start`` (the opening
    message). Placeholders are ``{name}``; each template may use only its own
    (:data:`TEMPLATE_FIELDS`). Any fault is a :class:`ConfigError` naming the file and the key,
    raised before anything is sent."""
    p, raw = read_mapping(str(path), where, "a mapping with keys judge, dimensions, character, environment, nsp",
                          "a YAML mapping judge, dimensions, character, environment, nsp -> prompt text; see docs/coser.md")
    known = {*TEMPLATE_FIELDS, "dimensions", "start"}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ConfigError(f"{where}={p}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
    needed = ["judge", *(SIMULATION_TEMPLATES if simulate else ())]
    texts: dict[str, str] = {}
    for key in TEMPLATE_FIELDS:
        if key not in raw or raw[key] is None:
            if key in needed:
                why = "to simulate scenes" if key in SIMULATION_TEMPLATES else "to judge"
                raise ConfigError(f"{where}={p}: no '{key}' template (needed {why})")
            continue
        text = raw[key]
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}={p}: {key}: the template must be a non-empty string")
        bad = sorted({n for n in _PLACEHOLDER.findall(text) if n not in TEMPLATE_FIELDS[key]})
        if bad:
            raise ConfigError(f"{where}={p}: {key}: unknown placeholder {{{bad[0]}}}; {key} templates may use "
                              f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS[key])}")
        texts[key] = text
    if "{dimension_name}" not in texts["judge"]:
        raise ConfigError(f"{where}={p}: judge: the template never names the dimension ({{dimension_name}}), so the "
                          "four prompts would be the same")
    dims = raw.get("dimensions")
    if not isinstance(dims, dict) or sorted(map(str, dims)) != sorted(DIMENSIONS):
        got = sorted(map(str, dims)) if isinstance(dims, dict) else type(dims).__name__
        raise ConfigError(f"{where}={p}: dimensions must map exactly {', '.join(DIMENSIONS)} to {{brief, criteria}}; "
                          f"got {got}")
    parsed: dict[str, tuple[str, str]] = {}
    for name in DIMENSIONS:
        d = dims[name]
        if not isinstance(d, dict) or not all(isinstance(d.get(k), str) and d[k].strip() for k in ("brief", "criteria")):
            raise ConfigError(f"{where}={p}: dimensions.{name}: needs non-empty strings 'brief' and 'criteria'")
        parsed[name] = (d["brief"], d["criteria"])
    start = raw.get("start") or ""
    if not isinstance(start, str):
        raise ConfigError(f"{where}={p}: start: must be a string")
    return Templates(judge=texts["judge"], dimensions=parsed, character=texts.get("character"),
                     environment=texts.get("environment"), nsp=texts.get("nsp"), start=start)


def character_prompt(t: Templates, scene: Scene, name: str) -> str:
    others = "".join(f"{o}: {prof}\n\n" for o, prof in scene.profiles.items() if o != name)
    return fill(t.character or "", {
        "character": name, "book": scene.book, "profile": scene.profiles.get(name, ""), "scenario": scene.scenario,
        "plot_summary": scene.plot_summary, "other_profiles": others, "motivation": scene.motivations.get(name, ""),
        "thought": scene.thoughts.get(name, "")}).strip("\n")


def environment_prompt(t: Templates, scene: Scene) -> str:
    major = [c for c in scene.major if c != ENVIRONMENT]
    return fill(t.environment or "", {"major_characters": str(major), "scenario": scene.scenario}).strip("\n")


def nsp_prompt(t: Templates, scene: Scene) -> str:
    return fill(t.nsp or "", {"characters": str(scene.speakers), "scenario": scene.scenario}).strip("\n")


def critic_prompt(t: Templates, scene: Scene, dimension: str) -> str:
    brief, criteria = t.dimensions[dimension]
    return fill(t.judge, {
        "book": scene.book, "plot_summary": scene.plot_summary, "scenario": scene.scenario,
        "character_profiles": "\n\n".join(f"### {c}\n\n{p}" for c, p in scene.profiles.items()),
        "original_conversation": reference_text(scene.dialogues), "major_characters": ", ".join(scene.major),
        "additional_instructions": "", "dimension_name": dimension, "dimension_brief": brief,
        "dimension_criteria": criteria})


# ---------------------------------------------------------------- the simulation


class Agent:
    """One participant's chat history (system prompt, then alternating user/assistant turns)."""

    def __init__(self, system: str, start: str) -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        self.update("user", start)

    def update(self, role: str, text: str) -> None:
        if not text:
            return
        if self.messages[-1]["role"] == role:
            self.messages[-1] = {"role": role, "content": self.messages[-1]["content"] + "\n\n" + text}
        else:
            self.messages.append({"role": role, "content": text})


@dataclass
class Play:
    scene: Scene
    agents: dict[str, Agent]
    speaker: str
    rng: random.Random
    messages: list[dict[str, str]] = field(default_factory=list)  # {"role": speaker or NSP, "content"}
    done: bool = False
    stalled: str | None = None  # why the scene could not go on (a side model's request failed)
    nsp_fallbacks: int = 0

    def speak(self, text: str) -> None:
        actor = self.speaker
        self.messages.append({"role": actor, "content": text})
        for name, agent in self.agents.items():
            if name == actor:
                agent.update("assistant", text)
            else:
                agent.update("user", with_speaker(remove_thoughts(text), actor))

    def choose_next(self, text: str, round_index: int, end_after: int) -> None:
        name = next_speaker(text)
        valid = True
        if name == END and round_index >= end_after:
            self.done = True
        elif name in self.scene.speakers and name != self.speaker:
            self.speaker = name
        else:
            valid = False
            self.nsp_fallbacks += 1
            pool = set(self.scene.major + [ENVIRONMENT]) - {self.speaker}
            if not pool:
                pool = set(self.scene.speakers) - {self.speaker}
            self.speaker = self.rng.choice(sorted(pool))
        self.messages.append({"role": NSP, "content": name})
        nsp = self.agents[NSP]
        if valid:
            nsp.update("assistant", text)
        else:
            nsp.update("assistant", name)
            nsp.update("user", nsp.messages[0]["content"])


def _free_text(text: str) -> str:
    if not text or not text.strip():
        raise Rejected("empty_reply", "the answer is empty")
    return text


class SideModel:
    """The environment or the next-speaker model: a judge backend (``openai`` or ``hf``) asked for
    free text; every answer is cached (``<out_dir>/coser/side_cache.sqlite``), so a rerun replays
    the same scenes and asks only for what is missing."""

    def __init__(self, node: Any, where: str, ctx: Any, cache: AnswerCache) -> None:
        self.conf = side_config(node, where)
        self.where = where
        self.ctx, self.cache = ctx, cache
        self._backend: Any = None
        self.requests = 0

    @property
    def backend(self) -> Any:
        if self._backend is None:
            cls = JUDGE_BACKENDS[self.conf.backend]
            self._backend = cls.build(self.conf, model=self.ctx.model, tokenizer=self.ctx.tokenizer,
                                      model_id=model_label(self.ctx.replier), device=self.ctx.judging.device,
                                      where=self.where)
        return self._backend

    def ask(self, prompts: Sequence[list[dict[str, str]]]) -> list[str | None]:
        """One answer per prompt (None where the request failed)."""
        if not prompts:
            return []
        answers, counts = ask_judge(self.backend, self.cache, prompts, lambda t: t if (t or "").strip() else None,
                                    _free_text, self.where)
        self.requests += counts["requests"]
        for a in answers:
            if a["value"] is None:
                log.warning("%s: no answer (%s)", self.where, a["error"] or a["status"])
        return [a["value"] for a in answers]


def side_config(node: Any, where: str) -> Any:
    try:
        conf = judge_config(node, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if JUDGE_BACKENDS[conf.backend] is None:
        raise ConfigError(f"{where}.backend=none: the scenes need this model to be simulated; use openai "
                          f"({where}.model=<served name>) or hf ({where}.model=<local model>, null = the evaluated one)")
    return conf


def simulate(c: Any, ctx: Any, scenes: Sequence[Scene], t: Templates) -> list[Play]:
    """Every scene played out, round by round: the actors' turns of all scenes generated together
    (``<out_dir>/coser/round_NN/generations.jsonl``), then the environment's, then the next speakers."""
    cache_dir = Path(ctx.out_dir) / "coser"
    cache_dir.mkdir(parents=True, exist_ok=True)
    plays = []
    for s in scenes:
        agents = {name: Agent(environment_prompt(t, s) if name == ENVIRONMENT else character_prompt(t, s, name), t.start)
                  for name in s.speakers}
        agents[NSP] = Agent(nsp_prompt(t, s), t.start)
        plays.append(Play(s, agents, s.speakers[0], random.Random(f"{c.seed}:{s.id}")))
    with AnswerCache(cache_dir / "side_cache.sqlite") as cache:
        env = SideModel(c.environment, "data.coser.environment", ctx, cache)
        nsp = SideModel(c.nsp, "data.coser.nsp", ctx, cache)
        for r in range(c.max_rounds):
            live = [p for p in plays if not p.done]
            if not live:
                break
            actors = [p for p in live if p.speaker != ENVIRONMENT]
            envs = [p for p in live if p.speaker == ENVIRONMENT]
            if actors:
                items = [TestItem("coser", [dict(m) for m in p.agents[p.speaker].messages], "") for p in actors]
                replies: list[str | None] = ctx.generate(f"coser/round_{r + 1:02d}", items)
            else:
                replies = []
            answers = env.ask([p.agents[ENVIRONMENT].messages for p in envs])
            for p, text in [*zip(actors, replies), *zip(envs, answers)]:
                if text is None:
                    p.done, p.stalled = True, f"round {r + 1}: no {'environment' if p in envs else 'actor'} answer"
                else:
                    p.speak(text)
            live = [p for p in live if not p.done]
            picks = nsp.ask([p.agents[NSP].messages for p in live])
            for p, text in zip(live, picks):
                if text is None:
                    p.done, p.stalled = True, f"round {r + 1}: no next-speaker answer"
                else:
                    p.choose_next(text, r, c.end_after)
        log.info("CoSER: %d scenes simulated (%d environment, %d next-speaker requests)", len(plays),
                 env.requests, nsp.requests)
    return plays


def read_simulations(g: Any, scenes: Sequence[Scene]) -> dict[str, list[dict[str, str]] | None]:
    """``generation.path``: simulated dialogues made elsewhere, a JSON list (the authors'
    ``exp/simulation/*.json``) or JSON lines of records ``{book_title (or book), i_p, i_c,
    simulation: [{role, content}]}``; matched to scenes by id. None for a scene without one
    (``generation.on_missing=skip``); else a missing one is an error naming the first."""
    paths = [g.path] if isinstance(g.path, str) else list(g.path or [])
    if not paths:
        raise ConfigError("generation.backend=file needs generation.path (the simulated dialogues)")
    found: dict[str, list[dict[str, str]]] = {}
    for path in paths:
        p = Path(str(path)).expanduser()
        if not p.is_file():
            raise InputNotFound(f"generation.path: no such file: {p}")
        text = p.read_text(encoding="utf-8")
        try:
            doc = json.loads(text)
            rows = [(f"{p}: record [{i}]", r) for i, r in enumerate(doc)] if isinstance(doc, list) else None
        except json.JSONDecodeError:
            rows = None
        if rows is None:
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{p}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{n}: invalid JSON: {e.msg} (a JSON list or JSON lines of simulations)") from None
        for where, r in rows:
            if not isinstance(r, dict):
                raise DataError(f"{where}: expected an object {{book_title, i_p, i_c, simulation}}")
            book = r.get("book_title", r.get("book"))
            if not isinstance(book, str) or not isinstance(r.get("i_p"), int) or not isinstance(r.get("i_c"), int):
                raise DataError(f"{where}: needs 'book_title' (or 'book'), 'i_p' and 'i_c' naming the scene")
            sim = r.get("simulation")
            if not isinstance(sim, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                    and isinstance(m.get("content"), str) for m in sim):
                raise DataError(f"{where}: field 'simulation' must be a list of {{role, content}} strings")
            found[f"{book}-{r['i_p']}-{r['i_c']}"] = [{"role": m["role"], "content": m["content"]} for m in sim]
    out: dict[str, list[dict[str, str]] | None] = {s.id: found.get(s.id) for s in scenes}
    missing = [k for k, v in out.items() if v is None]
    if missing and g.on_missing != "skip":
        raise DataError(f"generation.path: no simulation for {len(missing)} of {len(scenes)} scenes (first: "
                        f"{missing[0]}); add them or set generation.on_missing=skip to leave them out")
    return out


# ---------------------------------------------------------------- judging and scores


def check(c: Any, ctx: Any) -> None:
    """Before anything slow: the test file, the templates, the judge and the side models."""
    backend = ctx.backend
    load_templates(c.templates, simulate=backend.generates)
    j = judge_config(ctx.judging.judge)
    if judge_backend(j) is None:
        raise ConfigError("data.coser is scored by a judge: add judge=openai (judge.model=gpt-4o, the key in the "
                          "environment) or judge=hf (judge.model=<local model>)")
    check_judge(j)
    if j.max_tokens < JUDGE_MAX_TOKENS:
        log.warning("judge.max_tokens=%d is below the %d tokens CoSER's critiques may need (long JSON lists of "
                    "flaws): an answer cut off holds no critique and is counted unparseable; set "
                    "judge.max_tokens=%d", j.max_tokens, JUDGE_MAX_TOKENS, JUDGE_MAX_TOKENS)
    if uses_evaluated_model(j) and not backend.loads_model:
        raise ConfigError(f"judge=hf with judge.model=null judges with the evaluated model, which "
                          f"generation.backend={backend.name} does not load: set judge.model")
    if c.max_rounds < 1 or c.end_after < 0:
        raise ConfigError(f"data.coser.max_rounds must be >= 1 and data.coser.end_after >= 0 (got {c.max_rounds}, "
                          f"{c.end_after})")
    if backend.generates:
        for key in ("environment", "nsp"):
            where = f"data.coser.{key}"
            conf = side_config(c[key], where)
            if uses_evaluated_model(conf) and not backend.loads_model:
                raise ConfigError(f"{where}.backend=hf with {where}.model=null plays it with the evaluated model, "
                                  f"which generation.backend={backend.name} does not load: set {where}.model")
            try:
                check_judge(conf, where)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    read_test_set(c.test_file)


def judge_all(ctx: Any, prompts: Sequence[tuple[str, list[dict[str, str]]]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One :func:`rolemrc.eval.bench.ask.ask_judge` answer per (dimension, messages), its
    ``value`` the flaws (cached in ``<judge cache>/coser_cache.sqlite``), and run stats."""
    results: list[dict[str, Any]] = [{}] * len(prompts)
    stats: dict[str, Any] = {"prompts": len(prompts), "cache_hits": 0, "requests": 0}
    with suite_judge(ctx, "coser_cache.sqlite") as (backend, cache):
        for dim in DIMENSIONS:
            def valid(text: str, dim: str = dim) -> list[dict[str, Any]]:
                flaws = parse_critique(text, dim)
                if flaws is None:
                    raise Rejected("no_critique", f"the answer holds no JSON {{\"{dim}\": {{\"flaws\": [...]}}}}")
                return flaws

            idx = [i for i, (d, _) in enumerate(prompts) if d == dim]
            answers, counts = ask_judge(backend, cache, [prompts[i][1] for i in idx],
                                        lambda text, dim=dim: parse_critique(text, dim), valid, f"coser {dim} prompt")
            for i, a in zip(idx, answers, strict=True):
                results[i] = a
            stats["cache_hits"] += counts["cache_hits"]
            stats["requests"] += counts["requests"]
    return results, {"judge_model": backend.model_id, **stats}


def score(c: Any, ctx: Any, scenes: Sequence[Scene], sims: dict[str, list[dict[str, str]] | None]) -> dict[str, Any]:
    """Per-scene BLEU, ROUGE-L and the four judged scores; the means as the authors aggregate them."""
    t = load_templates(c.templates, simulate=False)
    cases: dict[str, dict[str, Any]] = {}
    prompts: list[tuple[str, list[dict[str, str]]]] = []
    owners: list[tuple[str, str]] = []
    for s in scenes:
        sim = sims.get(s.id)
        if sim is None:
            continue
        kept, text = simulation_text(sim)
        bleu, rouge_l = bleu_rouge(reference_text(s.dialogues), text)
        rounds = sum(m["role"] != ENVIRONMENT for m in kept)
        cases[s.id] = {"simulation": sim, "simulation_str": text, "actor_rounds": rounds, "bleu": bleu,
                       "rouge_l": rouge_l, "critique": {}}
        for dim in DIMENSIONS:
            prompts.append((dim, [{"role": "system", "content": critic_prompt(t, s, dim)},
                                  {"role": "user", "content": text}]))
            owners.append((s.id, dim))
    answers, stats = judge_all(ctx, prompts) if prompts else ([], {"judge_model": None, "prompts": 0})
    status_counts: dict[str, dict[str, int]] = {d: {} for d in DIMENSIONS}
    for (sid, dim), a in zip(owners, answers):
        case = cases[sid]
        entry: dict[str, Any] = {"status": a["status"], "flaws": a["value"], "raw": a["text"], "error": a["error"]}
        if a["status"] == "ok":
            entry["score"] = dimension_score(a["value"], case["actor_rounds"])
        case["critique"][dim] = entry
        status_counts[dim][a["status"]] = status_counts[dim].get(a["status"], 0) + 1
    for case in cases.values():
        got = [case["critique"][d].get("score") for d in DIMENSIONS]
        case["score"] = sum(got) / len(got) if all(g is not None for g in got) else None
    means: dict[str, float | None] = {
        d: mean([c["critique"][d]["score"] for c in cases.values() if c["critique"][d].get("score") is not None])
        for d in DIMENSIONS}
    dims = [means[d] for d in DIMENSIONS]
    means["avg"] = sum(dims) / len(dims) if all(v is not None for v in dims) else None  # type: ignore[arg-type]
    means["bleu"] = mean([c["bleu"] for c in cases.values()])
    means["rouge_l"] = mean([c["rouge_l"] for c in cases.values() if c["rouge_l"] is not None])
    return {"scores": means, "cases": cases, "judge": stats, "statuses": status_counts}


def evaluate(c: Any, ctx: Any) -> dict[str, Any]:
    scenes = read_test_set(c.test_file)
    limit = c.limit if c.limit is not None else ctx.limit
    if limit:
        scenes = scenes[: int(limit)]
    backend = ctx.backend
    stalled: dict[str, str] = {}
    fallbacks = 0
    if backend.generates:
        t = load_templates(c.templates, simulate=True)
        plays = simulate(c, ctx, scenes, t)
        sims: dict[str, list[dict[str, str]] | None] = {}
        for p in plays:
            fallbacks += p.nsp_fallbacks
            if p.stalled:
                stalled[p.scene.id] = p.stalled
                sims[p.scene.id] = None
            else:
                sims[p.scene.id] = p.messages
        out = Path(ctx.out_dir) / "coser" / "simulation.json"
        out.write_text(json.dumps([{"book_title": s.book, "i_p": s.i_p, "i_c": s.i_c, "simulation": sims[s.id],
                                    "involved_character_profiles": s.profiles}
                                   for s in scenes if sims[s.id] is not None], ensure_ascii=False, indent=2),
                       encoding="utf-8")
    else:
        sims = read_simulations(ctx.replier.generation, scenes)
    res = score(c, ctx, scenes, sims)
    res.update({"scenes": len(scenes), "simulated": backend.generates, "stalled": stalled,
                "nsp_fallbacks": fallbacks, "not_in_file": sum(v is None for k, v in sims.items() if k not in stalled)})
    missing = []
    if stalled:
        missing.append(f"{len(stalled)} of {len(scenes)} scenes stopped early (side model unanswered; first: "
                       f"{next(iter(stalled.items()))})")
    counts = sum((Counter(res["statuses"][d]) for d in DIMENSIONS), Counter())
    asks_again = judge_backend(judge_config(ctx.judging.judge)).asks_again
    judged_missing = sum(obtainable(counts.elements(), not asks_again).values())
    if judged_missing:
        missing.append(f"CoSER judge: {judged_missing} of {res['judge']['prompts']} critiques missing")
    if missing:
        res["missing"] = "; ".join(missing)
    answered = counts["ok"] + counts["unparseable"]
    none = all(res["scores"][d] is None for d in DIMENSIONS)
    if answered and none and not judged_missing and counts.total() > counts["ok"]:
        res["unscored"] = (f"CoSER judge: none of the {answered} answers held the JSON critique, so there is no score: "
                           "check judge.model and judge.max_tokens (raw answers in metrics.json, coser.cases)")
    return res


def render(res: dict[str, Any]) -> str:
    sc = res["scores"]
    head = "| | " + " | ".join(DIMENSIONS) + " | average | BLEU | ROUGE-L |"
    lines = [f"## CoSER given-circumstance acting (judge: {res['judge'].get('judge_model')})", "",
             "Judged scores 0-100 (the authors' flaw deduction), mean over scenes; average = mean of the four; "
             "BLEU and ROUGE-L (0-1) of the simulation against the original dialogue.", "",
             head, "|---|" + "---|" * (len(DIMENSIONS) + 3),
             "| this model | " + " | ".join(fmt(sc[d]) for d in DIMENSIONS) + f" | {fmt(sc['avg'])} | "
             f"{fmt(sc['bleu'], 4)} | {fmt(sc['rouge_l'], 4)} |"]
    n = len(res["cases"])
    lines += ["", f"{n} of {res['scenes']} scenes scored ({'simulated here' if res['simulated'] else 'simulations read from generation.path'}"
              f"; {len(res['stalled'])} stopped early, {res['not_in_file']} without a simulation in the file; "
              f"{res['nsp_fallbacks']} next-speaker answers replaced by a random pick).", "",
              *status_table(["dimension"], (([d], res["statuses"][d]) for d in DIMENSIONS))]
    lines += ["", "Answers without a critique and failed requests are counted above, never scored.", ""]
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in res["scores"].items():
        if v is not None:
            out[f"coser/{KEYS.get(k, k)}"] = float(v)
    return out
