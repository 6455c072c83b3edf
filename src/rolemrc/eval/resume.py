"""``python evaluate.py out_dir=<dir>``: resume with the config that folder was made with.

Every evaluation saves its config (unresolved, ``out_dir`` written out) and Hydra's group
choices to ``<out_dir>/run_config.yaml`` before it starts; folders from before that hold
``.hydra/config.yaml`` when ``out_dir`` was Hydra's run folder, which is read instead (unless
this command's Hydra just rewrote it). When ``out_dir`` holds a saved config, the run uses it;
overrides on the command line apply on top of it, and one that changes a saved value while the
folder holds results (generations, metrics, verdicts, summary) is an error naming the key:
finished results are never silently rewritten with other settings. Exempt: the keys in
:data:`RUNTIME` (how fast, where, how loud; they change no result), and adding a judge to a
folder evaluated without one (``judge=openai ...`` when the saved ``judge.backend`` is none:
nothing judged is rewritten).

Rerunning the same command resumes too (:func:`continue_eval_argv`, called by ``evaluate.py``
before Hydra starts): with neither ``out_dir`` nor ``hydra.run.dir`` given, the newest folder next
to the one Hydra would create (``outputs/evaluate/*``) whose saved config is this command's
config (the :data:`RUNTIME` keys may differ) is continued in place, so generation, the judge and
every suite ask only for what is missing. A folder whose local ``model.path`` changed after it
was last evaluated is not continued (a retrained export is evaluated afresh).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolemrc.config import EvaluateConfig
from rolemrc.errors import ConfigError
from rolemrc.fileio import atomic_write_text

log = logging.getLogger(__name__)

SAVED = "run_config.yaml"
RESULTS = ("generations.jsonl", "dialogues.jsonl", "metrics.json", "judge.jsonl", "summary.md")
# Keys that change no result: they may differ from the saved run (the new value is used).
RUNTIME = (
    "out_dir", "run_dir", "logger",
    "generation.batch_size", "generation.device", "generation.cpu_threads", "generation.progress",
    "generation.vllm_kwargs",
    # generation.backend=openai: how requests are sent, not what is asked (model, base_url, tokens are results)
    "generation.concurrency", "generation.timeout_s", "generation.max_attempts", "generation.max_requests",
    "generation.backoff_s", "generation.max_backoff_s", "generation.api_key_env", "generation.cache_dir",
    "judge.concurrency", "judge.timeout_s", "judge.max_attempts", "judge.max_requests", "judge.backoff_s",
    "judge.max_backoff_s", "judge.base_url", "judge.api_key_env", "judge.device",
    "metrics.bertscore.batch_size", "metrics.bertscore.device",
)
_MISSING = "<not set>"


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def load_saved(out_dir: Path, hydra_output_dir: Path) -> tuple[dict[str, Any], dict[str, Any], Path] | None:
    """``(config, group choices, file)`` saved in ``out_dir``, or None."""
    saved = out_dir / SAVED
    if saved.is_file():
        doc = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
        if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
            raise ConfigError(f"{saved}: not a saved evaluation config (expected keys config and choices)")
        return doc["config"], doc.get("choices") or {}, saved
    legacy = out_dir / ".hydra" / "config.yaml"
    if legacy.is_file() and out_dir.resolve() != hydra_output_dir.resolve():  # not the one Hydra just wrote
        config = OmegaConf.to_container(OmegaConf.load(legacy), resolve=False)
        choices: dict[str, Any] = {}
        hydra_yaml = out_dir / ".hydra" / "hydra.yaml"
        if hydra_yaml.is_file():
            choices = OmegaConf.to_container(OmegaConf.load(hydra_yaml), resolve=False)["hydra"]["runtime"]["choices"]
        return config, choices, legacy
    return None


def has_results(out_dir: Path) -> bool:
    return any((out_dir / name).is_file() and (out_dir / name).stat().st_size > 0 for name in RESULTS)


def _value(node: Any, key: str) -> Any:
    value = OmegaConf.select(OmegaConf.create(node) if isinstance(node, dict) else node, key,
                             default=_MISSING, throw_on_resolution_failure=False)
    return OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value


def resume_config(cfg: DictConfig) -> DictConfig:
    """The config to run: ``cfg`` (the command line) on a new folder; on a folder with a saved
    config, that config with the command line's overrides on top (see the module). Saves the
    result to ``<out_dir>/run_config.yaml``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser


    hc = HydraConfig.get()
    out_dir = Path(str(cfg.out_dir))
    choices_now = {k: v for k, v in OmegaConf.to_container(hc.runtime.choices).items() if not k.startswith("hydra")}
    found = load_saved(out_dir, Path(hc.runtime.output_dir))
    if found is None:
        config = OmegaConf.to_container(cfg, resolve=False)
        effective = cfg
    else:
        config, choices_then, source = found
        overrides = OverridesParser.create().parse_overrides(list(hc.overrides.task))
        effective_node = OmegaConf.create(config)
        conflicts: list[str] = []
        saved_judge = _value(config, "judge.backend")
        for o in overrides:
            key = o.key_or_group
            if key.startswith("hydra.") or key == "hydra":
                continue
            if key in choices_now:  # a config group: same choice keeps the saved node (and its field overrides)
                then, now = choices_then.get(key, _MISSING), choices_now[key]
                if then == now:
                    continue
                shown_then, shown_now = then, now
            else:
                shown_then, shown_now = _value(config, key), _value(cfg, key)
                if shown_then == shown_now:
                    continue
            OmegaConf.update(effective_node, key, _value(cfg, key), merge=False, force_add=True)
            adding_judge = _under(key, ("judge",)) and saved_judge == "none"
            if not _under(key, RUNTIME) and not adding_judge:
                conflicts.append(f"{key} (saved {shown_then!r}, given {shown_now!r})")
        if conflicts and has_results(out_dir):
            raise ConfigError(
                f"out_dir={out_dir} holds results made with another config ({source}); the command line changes "
                f"{'; '.join(conflicts)}. Resume with `python evaluate.py out_dir={out_dir}` alone, or use a new "
                "out_dir")
        effective_node.out_dir = str(out_dir)
        config = OmegaConf.to_container(effective_node, resolve=False)
        try:
            effective = OmegaConf.merge(OmegaConf.structured(EvaluateConfig), effective_node)
        except Exception as err:  # a key this version no longer has, a value of the wrong type
            first = str(err).splitlines()[0]
            raise ConfigError(f"{source}: the saved config does not fit this version's evaluate config: {first}") from err
        OmegaConf.set_struct(effective, True)
        log.info("out_dir=%s: resuming with the config saved in %s", out_dir, source)
        print(f"resuming {out_dir} with its saved config ({source.relative_to(out_dir)})", flush=True)
        choices_now = {**choices_then, **{k: v for k, v in choices_now.items() if k in
                                          {o.key_or_group for o in overrides}}}
    config["out_dir"] = str(out_dir)
    header = ("# The config this folder's results were made with (evaluate.py). `python evaluate.py "
              "out_dir=<this folder>` resumes with it.\n")
    atomic_write_text(out_dir / SAVED, header + OmegaConf.to_yaml({"config": config, "choices": choices_now}))
    return effective


# ---------------------------------------------------------------- the same command again


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def same_evaluation(config: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether two evaluation configs (unresolved, as :data:`SAVED` holds them) ask for the same
    results: equal but for the :data:`RUNTIME` keys."""
    a, b = _flat(config), _flat(saved)
    keys = {k for k in a.keys() | b.keys() if not _under(k, RUNTIME)}
    return all(a.get(k, _MISSING) == b.get(k, _MISSING) for k in keys)


def _newest_mtime(path: Path) -> float:
    """The newest modification time of a model folder's files (one level down too), or of a file."""
    if path.is_file():
        return path.stat().st_mtime
    times = [p.stat().st_mtime for p in path.glob("*") if p.is_file()]
    times += [p.stat().st_mtime for p in path.glob("*/*") if p.is_file()]
    return max(times, default=0.0)


def find_evaluation(config: dict[str, Any], root: Path) -> Path | None:
    """The newest folder under ``root`` whose saved config asks for the same results as
    ``config`` (see the module), or None."""
    model_path = _value(config, "model.path")
    local = Path(model_path) if isinstance(model_path, str) and Path(model_path).exists() else None
    for folder in sorted((p for p in root.iterdir() if p.is_dir()), reverse=True):
        saved = folder / SAVED
        if not saved.is_file():
            continue
        try:
            doc = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
        except Exception as err:  # an unreadable file names itself; the folder is no candidate
            log.warning("skipping %s: %s", saved, str(err).splitlines()[0])
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
            continue
        if not same_evaluation(config, doc["config"]):
            continue
        if local is not None and _newest_mtime(local) > saved.stat().st_mtime:
            print(f"{folder} evaluated model.path={model_path} before it changed: evaluating it afresh", flush=True)
            return None
        return folder
    return None


def continue_eval_argv(argv: Sequence[str], config_dir: str | Path, config_name: str = "evaluate") -> list[str]:
    """``argv`` with ``hydra.run.dir=<folder>`` added when the same command already has a folder
    to continue (see the module); otherwise ``argv`` unchanged. Left alone: an explicit
    ``out_dir`` or ``hydra.run.dir``, multirun and Hydra's flags (``--cfg``, ``--help``, ...), and
    a command line Hydra will refuse (it reports that itself)."""
    argv = list(argv)
    args = argv[1:]
    if any(a.startswith("-") for a in args):
        return argv
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001 - @hydra.main reports a bad override the usual way
        return argv
    if any(o.key_or_group in ("out_dir", "hydra.run.dir") for o in overrides):
        return argv
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name, overrides=args, return_hydra_config=True)
    except Exception:  # noqa: BLE001 - @hydra.main reports a bad override the usual way
        return argv
    finally:
        GlobalHydra.instance().clear()
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} and ${now:...} in hydra.run.dir
    would_be = Path(str(cfg.hydra.run.dir))
    if (would_be / SAVED).is_file() or not would_be.parent.is_dir():
        return argv  # Hydra reuses its folder anyway (a requeued SLURM job), or nothing to continue
    config = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    found = find_evaluation(config, would_be.parent)
    if found is None:
        return argv
    print(f"continuing {found} (this command's folder; out_dir=<folder> names another, hydra.run.dir=<new folder> "
          "starts afresh)", flush=True)
    return [*argv, f'hydra.run.dir="{found}"']


_KEPT_WHEN_EMPTY = {".hydra", SAVED, "generation_settings.json"}


def _holds_results(folder: Path) -> bool:
    """Whether a run folder holds anything but what every start writes (Hydra's files, logs,
    the saved config): generations, verdicts, caches, reports."""
    for entry in folder.iterdir():
        if entry.name in _KEPT_WHEN_EMPTY or entry.suffix == ".log":
            continue
        if entry.is_dir() and not any(p.is_file() for p in entry.rglob("*")):
            continue
        return True
    return False


@contextmanager
def no_empty_folder(*folders: Path) -> Iterator[None]:
    """Remove each of ``folders`` that a failed run (an exception, Ctrl-C) leaves without results
    and that held none when it started: the error was printed; an empty folder would only be
    found and continued by the next run of the same command, or litter ``outputs/``."""
    fresh = [f for f in dict.fromkeys(folders) if not f.is_dir() or not _holds_results(f)]
    try:
        yield
    except BaseException as err:
        if not (isinstance(err, SystemExit) and err.code in (0, None)):
            for folder in fresh:
                if folder.is_dir() and not _holds_results(folder):
                    shutil.rmtree(folder, ignore_errors=True)
        raise
