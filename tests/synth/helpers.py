"""Helpers for the synthesis tests: the shared fake server taught RoleMRC's schemas, small inputs, runs.

``SynthServer`` is the shared loopback server (``tests/fake_openai.py``) answering chat requests
with JSON built from the request's own ``response_format`` schema (deterministic per request) and
embeddings with bag-of-words vectors. It answers the first attempt of about a third of the
requests with a 429, and the profile of a persona carrying a GLITCH marker with content that
does not parse (GLITCH-JSON: cut JSON; GLITCH-SCHEMA: a field missing) ``glitch_times`` times
(default once: the client's retry then gets a good one).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from tests.fake_openai import FakeOpenAI, Request, bow_vector  # noqa: F401  (bow_vector: re-exported)

REPO = Path(__file__).resolve().parents[2]
API_KEY_ENV = "ROLEMRC_TEST_KEY"
API_KEY = "test-key-123"

_VOCAB = (
    "indeed well truly the a river lantern quiet morning careful stories old friend bright harbour "
    "garden numbers patient letters music kitchen tide clock north winter honest simple journey "
    "market bread stone window paper thread lamp road mountain little certainly perhaps gladly"
).split()


class SynthServer(FakeOpenAI):
    """``served[key]`` counts good 200 answers per distinct request body; ``malformed[key]`` says
    which glitch a profile request got ("json" | "schema")."""

    def __init__(self, *, rate_limit_mod: int = 3, glitch_times: int = 1, **kw: Any) -> None:
        super().__init__(api_key=API_KEY, **kw)
        self.rate_limit_mod = rate_limit_mod
        self.glitch_times = glitch_times
        self.glitched: Counter[str] = Counter()
        self.malformed: dict[str, str] = {}

    @property
    def rate_limited(self) -> int:
        return self.fault_counts["rate_limit"]

    def _schema(self, req: Request) -> dict[str, Any] | None:
        rf = req.body.get("response_format") or {}
        return rf["json_schema"] if rf.get("type") == "json_schema" else None

    def fault(self, req: Request) -> str | None:
        if req.attempt == 1 and int(req.key[:8], 16) % self.rate_limit_mod == 0:
            return "rate_limit"
        spec = self._schema(req)
        if spec is not None and spec["name"] == "role_profile" and "GLITCH" in req.last_content:
            with self.lock:
                if self.glitched[req.key] < self.glitch_times:
                    self.glitched[req.key] += 1
                    self.malformed[req.key] = "json" if "GLITCH-JSON" in req.last_content else "schema"
                    return "invalid_content"
        return super().fault(req)

    def chat_content(self, req: Request) -> str:
        spec = self._schema(req)
        if spec is None:
            return "Plain text answer."
        return json.dumps(_instance(spec["schema"], spec["schema"], random.Random(req.key), name=""))

    def bad_content(self, req: Request, content: str) -> str:
        if "GLITCH-SCHEMA" in req.last_content:
            obj = json.loads(content)
            obj.pop("speech_style")
            obj["speech_examples"] = "not a list"
            return json.dumps(obj)
        return content[: len(content) // 2]  # truncated: not JSON


def _instance(node: dict[str, Any], root: dict[str, Any], rng: random.Random, name: str) -> Any:
    """A schema-valid value (objects, arrays with min/maxItems, strings, $ref)."""
    if "$ref" in node:
        ref = node["$ref"].split("/")[-1]
        return _instance(root["$defs"][ref], root, rng, name)
    t = node.get("type")
    if t == "object":
        return {k: _instance(v, root, rng, k) for k, v in node["properties"].items()}
    if t == "array":
        lo, hi = node.get("minItems", 1), node.get("maxItems", 3)
        return [_instance(node["items"], root, rng, name) for _ in range(rng.randint(lo, hi))]
    if t == "string":
        if name == "role_name":
            return " ".join(w.capitalize() for w in rng.sample(_VOCAB, 2))
        text = " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(8, 18))).capitalize() + "."
        # Narration in about half of the role's lines, so the no-narration policy has work to do.
        if name in ("reply", "role", "opening", "first_reply", "second_reply") and rng.random() < 0.5:
            text = "(nods slowly) " + text
        return text
    if t == "integer":
        return rng.randint(0, 9)
    if t == "boolean":
        return rng.random() < 0.5
    raise AssertionError(f"fake server cannot build schema node {node}")


# ------------------------------------------------------------------ small inputs

_PERSONAS = [
    "A pastry chef who runs a tiny bakery and teaches bread making on weekends.",
    "An amateur astronomer who photographs galaxies from a backyard observatory.",
    "A retired football coach who still scouts young players in his town.",
    "A marine biologist studying coral reefs and ocean temperature.",
    "A tax lawyer who explains regulations to small business owners.",
    "A jazz pianist touring small clubs and writing melodies at night.",
    "A beekeeper who sells honey and studies pollinating insects.",
    "A railway engineer who maintains old steam locomotives.",
    "A pastry chef who runs a tiny bakery and teaches bread making on weekends.",  # duplicate
    "A mountain guide leading climbers through glaciers GLITCH-JSON.",
    "A museum curator of medieval armour GLITCH-SCHEMA.",
    "A children's librarian who runs storytelling hours.",
    "A volcano scientist who monitors eruptions and lava flows.",
    "short",  # too short
]

_TOPICS = [
    ("how long should bread dough rise", "bread dough rises for one to two hours", "Bread dough usually rises for one to two hours in a warm kitchen until doubled."),
    ("what temperature to bake croissants", "around 200 degrees celsius", "Croissants bake at around 200 degrees Celsius until golden pastry layers form."),
    ("what is a spiral galaxy", "a galaxy with spiral arms of stars", "A spiral galaxy has a central bulge and spiral arms of stars and gas."),
    ("how far is the andromeda galaxy", "about 2.5 million light years", "The Andromeda galaxy is about 2.5 million light years away from Earth."),
    ("how many players on a football team", "eleven players", "A football team fields eleven players including the goalkeeper."),
    ("what is the offside rule in football", "a player is offside when nearer the goal line than the second last defender", "In football a player is offside when nearer the opponents goal line than the ball and the second last defender."),
    ("why do coral reefs bleach", "warm ocean temperature stresses the coral", "Coral reefs bleach when warm ocean temperature stresses coral and they expel algae."),
    ("what deduction can small business owners claim", "home office and equipment costs", "Small business owners can claim tax deductions for home office and equipment costs under the regulations."),
    ("who invented the jazz piano stride style", "harlem pianists such as james p johnson", "Stride jazz piano style grew among Harlem pianists such as James P Johnson."),
    ("how do bees make honey", "bees evaporate nectar in the hive", "Bees make honey by collecting nectar and evaporating it in the hive."),
    ("how does a steam locomotive work", "steam pushes pistons that turn the wheels", "In a steam locomotive, boiler steam pushes pistons that turn the driving wheels."),
    ("what causes volcano eruptions", "magma pressure builds up beneath the volcano", "Volcano eruptions happen when magma and gas pressure builds beneath the surface."),
    ("how fast does lava flow", "usually a few kilometres per hour", "Lava flow is usually slow, a few kilometres per hour, though some lava runs faster."),
    ("what is a children's storytelling hour", "a library session of reading stories aloud to children", "A storytelling hour is a library session reading stories aloud to children."),
    ("how are glaciers formed", "snow compacts into ice over many years", "Glaciers form when snow compacts into ice over many years in mountain regions."),
    ("what is medieval plate armour made of", "steel plates", "Medieval plate armour was made of shaped steel plates joined by straps."),
    ("what is the capital of australia", "canberra", "Canberra is the capital city of Australia."),
    ("how do vaccines work", "they train the immune system", "Vaccines train the immune system to recognise a pathogen."),
    ("what is a blockchain", "a distributed ledger", "A blockchain is a distributed ledger of linked records."),
    ("how much does a blue whale weigh", "up to 150 tonnes", "A blue whale can weigh up to 150 tonnes."),
    ("who wrote pride and prejudice", "jane austen", "Pride and Prejudice was written by Jane Austen."),
    ("what is photosynthesis", "plants turning light into chemical energy", "Photosynthesis lets plants turn light into chemical energy."),
    ("how tall is mount everest", "8849 metres", "Mount Everest is 8849 metres tall."),
    ("what is inflation in economics", "a general rise in prices", "Inflation is a general rise in prices over time."),
]

_UNANSWERABLE = [
    ("what flour did the first bakery in paris use", "Bakeries in Paris grew famous for baguettes and pastries."),
    ("what colour was the first telescope lens", "Telescopes use lenses or mirrors to gather light from galaxies."),
    ("which football coach invented the corner kick", "Football coaches plan training sessions for players."),
    ("how many corals live in the deepest trench", "Coral reefs are found in warm shallow ocean water."),
    ("what song did the first jazz pianist play", "Jazz piano music developed in American clubs."),
    ("what was the name of the first honey bee", "Bees live in colonies with a queen and workers."),
    ("what is the password of the volcano observatory", "Volcano observatories monitor eruptions and lava."),
    ("how many steam locomotives were painted green in 1901", "Steam locomotives were common on railways in the 1900s."),
    ("what is the favourite book of every librarian", "Librarians help readers find books and run storytelling."),
    ("which tax lawyer wrote the first regulation", "Tax regulations are written by governments."),
]


def write_inputs(root: Path) -> dict[str, Path]:
    """Personas (.jsonl) and an MS MARCO-shaped MRC pool (.jsonl) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    personas = root / "personas.jsonl"
    personas.write_text("".join(json.dumps({"persona": p}) + "\n" for p in _PERSONAS))
    rows = []
    for i, (q, a, passage) in enumerate(_TOPICS):
        rows.append({"query_id": 1000 + i, "query": q, "answers": [a], "passages": {"is_selected": [0, 1], "passage_text": ["An unrelated note about weather and travel.", passage], "url": ["u0", "u1"]}, "query_type": "DESCRIPTION", "wellFormedAnswers": []})
    for i, (q, passage) in enumerate(_UNANSWERABLE):
        rows.append({"query_id": 2000 + i, "query": q, "answers": ["No Answer Present."], "passages": {"is_selected": [0, 0], "passage_text": [passage, "Another passage that does not say."], "url": ["u0", "u1"]}, "query_type": "DESCRIPTION", "wellFormedAnswers": []})
    mrc = root / "mrc.jsonl"
    mrc.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"personas": personas, "mrc": mrc}


KINDS = ("free_chat", "mrc_dialogue", "answer", "no_answer", "refusal", "attempt", "multi_turn_refuse", "multi_turn_attempt", "nested_format", "nested_content", "system_refusal")


def small_overrides(base_url: str, out_dir: Path, inputs: dict[str, Path], **extra: Any) -> list[str]:
    """Hydra overrides for a small run (~60 requests) against the fake server."""
    ov = [
        f"out_dir={out_dir}", "progress=false",
        "personas.source=file", f"personas.path={inputs['personas']}", "personas.n=12",
        "mrc.source=file", f"mrc.path={inputs['mrc']}", "mrc.n_answerable=24", "mrc.n_unanswerable=10",
        f"generator.base_url={base_url}", "generator.model=fake-gen", f"generator.api_key_env={API_KEY_ENV}",
        "generator.concurrency=4", "generator.backoff_s=0.01", "generator.max_retries=4", "generator.timeout_s=20",
        "synth/embedder=sfr_mistral", f"embedder.base_url={base_url}", "embedder.model=fake-embed",
        f"embedder.api_key_env={API_KEY_ENV}", "embedder.batch_size=8", "embedder.backoff_s=0.01", "embedder.query_prefix=''",
        "match.top_k=2", "match.chunk_size=5",
        "dialogues.free_chat_exchanges=[2,3]", "assemble.test_fraction=0.25",
        *(f"dialogues.quotas.{k}=4" for k in KINDS),
    ]
    ov += [f"{k}={v}" for k, v in extra.items()]
    return ov


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import rolemrc.synth.config  # noqa: F401  (registers synthesize_schema)

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hcompose(config_name="synthesize", overrides=overrides)


def run_pipeline(overrides: list[str]) -> dict[str, Any]:
    from rich.console import Console

    from rolemrc.synth.config import load_config
    from rolemrc.synth.pipeline import run

    return run(load_config(compose(overrides)), console=Console(width=160, force_terminal=False))


