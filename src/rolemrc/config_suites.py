"""Config schemas of the RoleLLM pieces and the paper's out-of-distribution evaluations:
RoCIT role profiles (``data.roles``, a source's ``roles``), RoleBench (``data.rolebench``),
CharacterLLM (``data.characterllm``), lm-evaluation-harness benchmarks (``benchmarks``) and
the model they are compared with (``compare``). Used by :mod:`rolemrc.config`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf

from rolemrc.errors import ConfigError


@dataclass
class RolesConfig:
    """RoCIT: a role's profile -> its system instruction (:mod:`rolemrc.data.roles`)."""

    # Profile files: RoleBench's desc.json ({name: description}) or JSON/JSONL records
    # {name, description, catchphrases, dialogue}; [] = the role's name only.
    profiles: list[str] = field(default_factory=list)
    template: Optional[str] = None  # str.format with {name} {description} {catchphrases} {dialogue}; None: ours
    few_shot: int = 2  # dialogue lines of a profile put into the instruction
    strict: bool = True  # with profiles given, a role that has none is an error (file:line)


@dataclass
class RoleBenchConfig:
    """RoleBench's public layout under ``root`` (``rolebench-eng/...``, ``rolebench-zh/...``,
    ``profiles-*/desc.json``); see :mod:`rolemrc.eval.rolebench`."""

    root: str = MISSING
    # Any of instruction_generalization_eng, role_generalization_eng, instruction_generalization_zh.
    splits: list[str] = field(
        default_factory=lambda: ["instruction_generalization_eng", "role_generalization_eng",
                                 "instruction_generalization_zh"]
    )
    # RAW: the original answers of the general instructions, per language, relative to root
    # (rows {question, answer}); null: RAW is not reported.
    raw_answers: dict[str, Optional[str]] = field(
        default_factory=lambda: {"eng": "instructions-eng/instructions-general.jsonl",
                                 "zh": "instructions-zh/instructions-general.jsonl"}
    )
    raw_question_field: str = "question"
    raw_answer_field: str = "answer"
    chinese_tokenizer: str = "char"  # char (one token per character) | whitespace


@dataclass
class CharacterLLMConfig:
    """CharacterLLM's public test layout under ``root``; see :mod:`rolemrc.eval.characterllm`."""

    root: str = MISSING
    characters: list[str] = field(
        default_factory=lambda: ["Beethoven", "Caesar", "Cleopatra", "Hermione", "Martin", "Newton", "Socrates",
                                 "Spartacus", "Voldemort"]
    )
    settings: list[str] = field(default_factory=lambda: ["single", "turns"])
    turns: int = 5  # questions per multi-turn session (consecutive questions of one topic)
    questions: Optional[int] = None  # per character and setting; None: all
    profile_chars: int = 600  # profile characters put into the role's system instruction (RoCIT description)
    dimensions: list[str] = field(
        default_factory=lambda: ["memorization", "values", "personality", "hallucination", "stability"]
    )


@dataclass
class PersonaGymConfig:
    """PersonaGym's released layout under ``root`` (a clone of its repository); see
    :mod:`rolemrc.eval.bench.personagym`."""

    root: str = MISSING
    benchmark: str = "benchmark-v1"  # questions/<benchmark>/<persona>.json
    personas: Optional[list[str]] = None  # None: every questions file of the benchmark
    tasks: list[str] = field(
        default_factory=lambda: ["Expected Action", "Linguistic Habits", "Persona Consistency", "Toxicity",
                                 "Action Justification"]
    )
    questions: Optional[int] = None  # first N questions per persona and task; None: all
    system: str = "You are {persona}. Answer as this person would, and stay in this identity throughout."
    group_size: int = 5  # questions scored in one judge request (the authors' 5)
    score_examples: str = "released"  # released | per_question | none
    # Judges averaged per group (each merged over `judge`); []: `judge` alone.
    judges: list[Any] = field(default_factory=list)
    examples_judge: Optional[dict[str, Any]] = None  # the model writing score examples (over `judge`); None: judges[0]


@dataclass
class RewardJudgeConfig:
    """A released reward model used as a local judge (CharacterEval's BaichuanCharRM): one forward
    pass per (reply, metric), the score read from one output (:mod:`rolemrc.eval.bench.reward`)."""

    path: Optional[str] = None  # the model folder (or hub id, fetched beforehand)
    # The model's class in the folder's own code, "<module>.<Class>" (e.g. modeling_baichuan.BaichuanCharRM),
    # loaded from that folder; None: AutoModelForSequenceClassification
    model_class: Optional[str] = None
    tokenizer_class: Optional[str] = None  # likewise "<module>.<Class>"; None: AutoTokenizer
    output: Any = "logits"  # the output holding the score: "logits" or an index into the model's outputs
    scale: float = 1.0  # score = output * scale + offset
    offset: float = 0.0
    max_length: int = 4096  # longer inputs keep their last max_length tokens
    dtype: str = "auto"
    device: Optional[str] = None  # None: cuda when available, else cpu


@dataclass
class CharacterEvalConfig:
    """CharacterEval's released files under ``root``; see :mod:`rolemrc.eval.bench.charactereval`."""

    root: str = MISSING  # holds test_data.jsonl, character_profiles.json, id2metric.jsonl
    metrics: Optional[list[str]] = None  # English metric names (id2metric's); None: all
    limit: Optional[int] = None  # the first N examples; None: all
    # The conversation sent to the model: the profile + `instruction` as the first user turn, `acknowledgement`
    # as the first assistant turn (+ `opening` and the role's first line when the role speaks first).
    instruction: str = "Play the character {role} described above and continue the dialogue as {role}."
    acknowledgement: str = "Understood. I am {role} now."
    opening: str = " I speak first: "
    first_line_only: bool = True  # score the reply's first line only, as the authors' transform does
    reward_model: RewardJudgeConfig = field(default_factory=lambda: RewardJudgeConfig(
        model_class="modeling_baichuan.BaichuanCharRM", tokenizer_class="tokenization_baichuan.BaichuanTokenizer",
        output=1, scale=4.0, offset=1.0, dtype="bfloat16"))


@dataclass
class CharacterBenchConfig:
    """CharacterBench's released test files under ``root``; see :mod:`rolemrc.eval.bench.characterbench`."""

    root: str = MISSING  # eval_data/raw_data: <dimension>_test.json
    languages: list[str] = field(default_factory=lambda: ["zh", "en"])
    dimensions: Optional[list[str]] = None  # file names without _test.json; None: all thirteen
    limit: Optional[int] = None  # per file; None: all rows
    templates: Optional[str] = None  # the judge prompts: YAML {zh: {<dimension>: str}, en: {...}}
    # Generation: None = a system message with both profiles and the dialogue as chat turns; or a file
    # holding one user message with {character_profile} {user_profile} {dialogue}
    prompt_template: Optional[str] = None
    json_reply: bool = False  # take the "response" field of a JSON reply (the authors' prompt asks for one)
    judge_system: str = "You are a helpful assistant."  # the judge's system message (the authors' script)


@dataclass
class SideModelConfig:
    """A model that CoSER's scene simulation asks besides the evaluated one (the Environment, the
    next-speaker pick); the keys mean what they mean under ``judge``."""

    backend: str = "openai"  # openai | hf (a local model; model null = the evaluated one)
    model: Optional[str] = None  # environment: gpt-4o, nsp: gpt-4o-mini (the authors' defaults)
    max_tokens: int = 512  # the authors' limit for every agent's turn
    temperature: float = 0.0
    dtype: str = "auto"
    device: Optional[str] = None
    base_url: Optional[str] = None
    api_key_env: Optional[str] = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout_s: float = 120.0
    max_attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None


@dataclass
class CoserConfig:
    """CoSER given-circumstance acting (:mod:`rolemrc.eval.bench.coser`)."""

    test_file: str = MISSING  # CoSER's data/test/test_set.json
    # YAML holding the prompts (character, environment, nsp, judge, dimensions): the authors' text, which
    # rolemrc does not ship; the sample's is rolemrc's own short stand-in
    templates: str = MISSING
    limit: Optional[int] = None  # the first N scenes; None: all (evaluate's `limit` if set)
    max_rounds: int = 20  # turns per scene (each: one speaker, then the next-speaker pick)
    end_after: int = 5  # <END CHAT> ends a scene only from round end_after (0-based) on
    seed: int = 42  # the random pick that replaces an unusable next-speaker answer (per scene)
    # who plays the Environment and who picks the next speaker (the authors' defaults)
    environment: SideModelConfig = field(default_factory=lambda: SideModelConfig(model="gpt-4o"))
    nsp: SideModelConfig = field(default_factory=lambda: SideModelConfig(model="gpt-4o-mini"))


@dataclass
class BenchmarksConfig:
    """General-ability benchmarks through lm-evaluation-harness (:mod:`rolemrc.eval.general`)."""

    name: str = MISSING
    # lm-eval task names (its registry; data from the datasets cache) or YAML task files
    # (relative data_files resolved against the YAML's folder), or {task, metric} mappings.
    tasks: list[Any] = field(default_factory=list)
    include_path: Optional[str] = None  # a folder of more lm-eval task YAMLs
    batch_size: Any = "auto"
    max_batch_size: Optional[int] = 64
    max_length: Optional[int] = None  # None: the model's
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None  # items per task (or a fraction); None: all (evaluate's `limit` if set)
    device: Optional[str] = None  # None: cuda when available, else cpu


@dataclass
class CompareConfig:
    path: Optional[str] = None  # the starting model for General Δ (model.path = the trained one)


SUITE_SCHEMAS = {"data.rolebench": RoleBenchConfig, "data.characterllm": CharacterLLMConfig,
                 "data.personagym": PersonaGymConfig,
                 "benchmarks": BenchmarksConfig, "compare": CompareConfig,
                 "data.charactereval": CharacterEvalConfig, "data.characterbench": CharacterBenchConfig,
                 "data.coser": CoserConfig}


def check_suite_keys(cfg: Any) -> None:
    """Refuse keys the suites' schemas do not have. A plain override of an unknown key already
    fails at compose time, but Hydra's ``+key=value`` lifts the schema's check, so
    ``+data.rolebench.splitz=[...]`` would otherwise be carried along and never read: a
    :class:`ConfigError` naming the key (and the nearest known one)."""
    for where, schema in SUITE_SCHEMAS.items():
        node = OmegaConf.select(cfg, where) if OmegaConf.is_config(cfg) else None
        if node is None or not OmegaConf.is_dict(node):
            continue
        known = [f.name for f in fields(schema)]
        unknown = [str(k) for k in node if k not in known]
        if unknown:
            near = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"did you mean {where}.{near[0]}? " if near else ""
            raise ConfigError(f"{where}.{unknown[0]} is not a key of {where} ({schema.__name__}); {hint}"
                              f"its keys: {', '.join(known)}")
