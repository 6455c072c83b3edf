"""``python train.py <overrides> ckpt_path=last``: continue the interrupted run in its own folder.

Hydra names a new run folder (``outputs/<task_name>/<time>``) before ``train.py`` runs, so the
folder to continue must be picked before ``@hydra.main`` starts: :func:`continue_run_argv`
composes the command's config, looks at the run folders next to the one Hydra would create
(``outputs/<task_name>/*``) that hold a checkpoint, and when exactly one of them was made with
the same config (``.hydra/config.yaml``; the keys in :data:`IGNORED` may differ) adds
``hydra.run.dir=<that folder>`` to the command line. No such folder: a new run starts (the same
command starts and resumes). Ambiguous: several folders with this config, or folders made by
the same command line whose config has changed since (a config file edited), is an error that
lists them and the differing keys; name one with ``hydra.run.dir=<folder> ckpt_path=last``. A new
run's folder is decided here too (``hydra.run.dir`` added), so the folder printed is the one written.

Continuing a folder never rewrites its saved ``.hydra/config.yaml`` (Hydra is told not to write
``.hydra/``: ``hydra.output_subdir=null``); what a continuation changes is appended to
``.hydra/continuations.yaml`` beside it (:func:`record_continuation`), so the command that made
the run still finds it. ``hydra.run.dir=<run> ckpt_path=last`` on a folder holding a checkpoint
continues that run with its own saved command line (``.hydra/overrides.yaml``) under this
command's overrides: ``hydra.run.dir=<run> ckpt_path=last trainer.max_steps=70`` is the run's
config with ``trainer.max_steps=70`` (the model's keys may not change: its checkpoint and its
exports are of that model). A run folder without a checkpoint (its first save failed, or it was
killed before one) is continued the same way, from its start: its own config, its ``.hydra/``
kept. Every command this module or the recipe advises is of that form.

Left alone: a folder Hydra would reuse that already holds a checkpoint (a requeued SLURM job:
``outputs/<task_name>/<job id>``), multirun and ``--cfg``-style flags, and any ``ckpt_path``
other than ``last``. :func:`run_folder_lock` keeps a second training process out of a folder in use.
"""

from __future__ import annotations

import datetime
import logging
import os
import shlex
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolemrc.errors import ConfigError, UserError
from rolemrc.fileio import atomic_write_text
from rolemrc.warnings import launched_rank

log = logging.getLogger(__name__)

# Keys a resumed run may change: where it runs and how it resumes, how long it trains (raising
# trainer.max_steps continues a finished run), how often it checkpoints, the progress bar.
IGNORED = ("run_dir", "ckpt_path", "trainer.max_steps", "trainer.enable_progress_bar",
           "runtime.checkpoint_every_n_steps", "trainer.checkpoint_every_n_steps", "runtime.checkpoint_every_minutes",
           "runtime.device_memory_gb")
NEAR = 3  # a folder whose config differs in at most this many keys is named in a warning


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, (dict, list)):  # lists too: data sources are lists of dicts
        out: dict[str, Any] = {}
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            out.update(_flatten(v, f"{prefix}{k}."))
        if isinstance(node, list):
            out[f"{prefix}<len>"] = len(node)  # a list that grew or shrank differs
        return out
    return {prefix[:-1]: node}


def config_diff(new: Any, old: Any, ignore: Iterable[str] = IGNORED) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old value, new value)}`` for each key both configs have whose (unresolved)
    values differ. A key only one of them has was added or removed by a code update since the
    old run (a new option at its default): not a change of this run's settings."""
    a = _flatten(OmegaConf.to_container(new, resolve=False) if isinstance(new, DictConfig) else new)
    b = _flatten(OmegaConf.to_container(old, resolve=False) if isinstance(old, DictConfig) else old)
    skip = tuple(ignore)
    return {
        k: (b[k], a[k])
        for k in sorted(set(a) & set(b))
        if a[k] != b[k] and not any(k == s or k.startswith(s + ".") for s in skip)
    }


def _task_overrides(args: Sequence[str]) -> list[str]:
    """The command line's task overrides as Hydra saves them (``.hydra/overrides.yaml``), minus
    those a resume may change."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keep = []
    for o in OverridesParser.create().parse_overrides(list(args)):
        key = o.key_or_group
        if key.startswith("hydra.") or key == "hydra" or key in IGNORED:
            continue
        keep.append(o.input_line)
    return sorted(keep)


def _shown(diff: dict[str, tuple[Any, Any]], limit: int = 8) -> str:
    items = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


_looked_up: dict[Path, Path] = {}  # run folder -> its newest checkpoint, as found before Hydra started


def _find(folder: Path) -> Path | None:
    """The newest checkpoint of ``folder`` (:func:`~rolemrc.checkpointing.find_checkpoint`), kept
    for :func:`chosen_checkpoint`: a start looks each folder up once."""
    from rolemrc.checkpointing import find_checkpoint

    found = find_checkpoint(folder)
    if found is not None:
        _looked_up[folder.resolve()] = found
    return found


def chosen_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``run_dir``: the one found when this process chose the folder
    (before Hydra started), else looked up now."""
    from rolemrc.checkpointing import find_checkpoint

    found = _looked_up.pop(Path(run_dir).resolve(), None)
    return found if found is not None and found.exists() else find_checkpoint(run_dir)


def find_run_to_continue(cfg: DictConfig, would_be: Path, args: Sequence[str]) -> Path | None:
    """The run folder ``ckpt_path=last`` continues (see the module), or None for a new run
    (``would_be``, the folder Hydra would make, holds no checkpoint)."""
    root = would_be.parent
    if not root.is_dir():
        return None
    task = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    mine = _task_overrides(args)
    matches: list[Path] = []
    changed: list[tuple[Path, dict]] = []
    near: list[tuple[Path, dict]] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        saved = folder / ".hydra" / "config.yaml"
        if not saved.is_file() or _find(folder) is None:
            continue
        try:
            diff = config_diff(task, OmegaConf.load(saved))
        except Exception as err:  # an unreadable old config names the file; it is no candidate
            log.warning("ckpt_path=last: skipping %s: %s", saved, err)
            continue
        if not diff:
            matches.append(folder)
            continue
        overrides = folder / ".hydra" / "overrides.yaml"
        if overrides.is_file() and _task_overrides(OmegaConf.load(overrides)) == mine:
            changed.append((folder, diff))
        elif len(diff) <= NEAR:
            near.append((folder, diff))
    if len(matches) == 1:
        return matches[0]
    how = ("name the one to continue with hydra.run.dir=<folder> ckpt_path=last, or start a new run "
           "without ckpt_path=last")
    if len(matches) > 1:
        raise ConfigError(f"ckpt_path=last: {len(matches)} run folders of task_name={cfg.task_name} hold a checkpoint "
                          f"and this config: {', '.join(str(m) for m in matches)}; {how}")
    if changed:
        listed = "; ".join(f"{f} ({_shown(d)})" for f, d in changed)
        raise ConfigError(f"ckpt_path=last: the run folder(s) made by this command line were made with another "
                          f"config since changed (saved -> now): {listed}; {how}")
    for folder, diff in near:
        log.warning("ckpt_path=last: %s holds a checkpoint of a config that differs in %s; not continued (to "
                    "continue it: hydra.run.dir=%s ckpt_path=last)", folder, _shown(diff), folder)
    return None


NO_HYDRA_FILES = "hydra.output_subdir=null"  # a continued folder's .hydra/ is left as the run wrote it
CONTINUATIONS = "continuations.yaml"  # in <run>/.hydra: what each continuation changed


def _key(override: str) -> str:
    """An override's key as Hydra parses it (``+a.b=1`` -> ``a.b``, ``model=qwen`` -> ``model``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).key_or_group


def saved_overrides(run_dir: str | Path) -> list[str]:
    """The command-line overrides that made the run in ``run_dir`` (``.hydra/overrides.yaml``)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    return [str(o) for o in OmegaConf.load(path)] if path.is_file() else []


def rebased_overrides(run_dir: str | Path, args: Sequence[str]) -> list[str]:
    """The run's saved overrides under ``args`` (an override of the same key in ``args`` wins)."""
    mine = {_key(a) for a in args}
    return [o for o in saved_overrides(run_dir) if _key(o) not in mine] + list(args)


def _compose(config_dir: str | Path, config_name: str, args: Sequence[str]) -> DictConfig | None:
    """The command's config as @hydra.main would compose it, or None when Hydra would refuse it
    (then @hydra.main reports it the usual way)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            return compose(config_name, overrides=list(args), return_hydra_config=True)
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()


def _continue_folder(argv: list[str], args: list[str], folder: Path, config_dir: str | Path,
                     config_name: str, checkpoint: bool = True) -> list[str]:
    """``hydra.run.dir=<folder> ckpt_path=last <overrides>`` on a run folder (``checkpoint``:
    whether it holds one; without, it trains from the start): its saved command line under
    ``<overrides>``, its ``.hydra/`` left as it is (see the module)."""
    rebased = rebased_overrides(folder, args)
    cfg = _compose(config_dir, config_name, rebased)
    if cfg is None or cfg.get("ckpt_path") != "last":
        return argv
    saved = OmegaConf.load(folder / ".hydra" / "config.yaml")
    task = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    diff = config_diff(task, saved, ignore=("run_dir", "ckpt_path"))
    model = {k: v for k, v in diff.items() if k == "model" or k.startswith("model.")}
    if model:
        raise ConfigError(f"ckpt_path=last: {folder} is a run of another model ({_shown(model)}); its checkpoint "
                          f"and exports are of its own model: start a new run for this one "
                          f"(model.path={folder} starts from its weights)")
    changes = f" with {_shown(diff)}" if diff else ""
    if launched_rank() == 0:  # ranks a launcher starts (DDP) run this again with the same command line
        if checkpoint:
            print(f"ckpt_path=last: continuing {folder} (its saved config{changes})", flush=True)
        else:
            print(f"ckpt_path=last: {folder} holds no checkpoint: training it from the start with its saved "
                  f"config{changes}", flush=True)
    return [argv[0], *rebased, NO_HYDRA_FILES]


def continue_run_argv(argv: Sequence[str], config_dir: str | Path, config_name: str) -> list[str]:
    """``argv`` with ``hydra.run.dir=<the run to continue>`` added when ``ckpt_path=last``
    finds one, or the named folder's saved overrides when ``hydra.run.dir`` names a run with a
    checkpoint (see the module); otherwise ``argv`` unchanged."""
    argv = list(argv)
    args = argv[1:]
    if not args or any(a.startswith("-") for a in args):  # -m, --cfg, --help, -cn ...: Hydra's business
        return argv
    if not any(a.split("=", 1)[0].lstrip("+~") in ("ckpt_path", "experiment") for a in args):
        return argv  # ckpt_path=last can only come from the command line or an experiment file
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except OverrideParseException:  # e.g. an unquoted '=' in a value: @hydra.main reports it the usual way
        return argv
    named = [o for o in overrides if o.key_or_group == "hydra.run.dir"]
    if named:  # the user named the folder
        folder = Path(str(named[-1].value()))
        if (folder / ".hydra" / "config.yaml").is_file():  # a run folder: its own config, never the defaults
            return _continue_folder(argv, args, folder, config_dir, config_name, checkpoint=_find(folder) is not None)
        return argv
    cfg = _compose(config_dir, config_name, args)
    if cfg is None or cfg.get("ckpt_path") != "last":
        return argv
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} and ${now:...} in hydra.run.dir
    would_be = Path(str(cfg.hydra.run.dir))

    if _find(would_be) is not None:  # a requeued SLURM job: Hydra reuses its folder, left as it is
        print(f"ckpt_path=last: continuing {would_be}", flush=True)
        return [*argv, NO_HYDRA_FILES] if (would_be / ".hydra" / "config.yaml").is_file() else argv
    found = find_run_to_continue(cfg, would_be, args)
    if found is None:
        # The folder is named here, once: left to @hydra.main, ${now:...} would be read again a
        # few seconds later and the run would write another folder than the one printed.
        print(f"ckpt_path=last: no run of this config with a checkpoint in <run>/checkpoints under "
              f"{would_be.parent}: starting a new run in {would_be}", flush=True)
        return [*argv, f'hydra.run.dir="{would_be}"']
    print(f"ckpt_path=last: continuing {found}", flush=True)
    return [*argv, f'hydra.run.dir="{found}"', NO_HYDRA_FILES]


def continue_command(run_dir: str | Path, *extra: str, drop: Iterable[str] = ()) -> str:
    """The command that continues the run in ``run_dir``: ``python train.py hydra.run.dir=<run>
    ckpt_path=last``, this process's own overrides (those not saved with the run: a
    continuation's changes; without ``drop``'s keys) and ``extra``."""
    skip = {"ckpt_path", "hydra.run.dir", "hydra.output_subdir", *drop, *(_key(e) for e in extra)}
    saved = set(saved_overrides(run_dir))
    own = [o for o in _task_overrides_now() if o not in saved and _key(o) not in skip]
    return shlex.join(["python", "train.py", f"hydra.run.dir={run_dir}", "ckpt_path=last", *own, *extra])


def _task_overrides_now() -> list[str]:
    """This process's task overrides (Hydra's), empty outside a Hydra run."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def record_continuation(cfg: DictConfig) -> None:
    """Append what this continuation of ``cfg.run_dir`` changes from the run's saved config
    (and its command line) to ``<run>/.hydra/continuations.yaml``; the saved config stays as the
    run wrote it. Nothing when Hydra wrote ``.hydra/`` itself (a new run)."""
    from hydra.core.hydra_config import HydraConfig

    folder = Path(str(cfg.run_dir)) / ".hydra"
    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is not None:
        return
    if not (folder / "config.yaml").is_file():
        return
    task = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    diff = config_diff(task, OmegaConf.load(folder / "config.yaml"), ignore=("run_dir", "ckpt_path"))
    path = folder / CONTINUATIONS
    entries = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else []
    entries.append({"time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "overrides": _task_overrides_now(),
                    "changed": {k: {"saved": a, "now": b} for k, (a, b) in diff.items()}})
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(entries)))


LOCK_FILE = ".train.lock"


@contextmanager
def run_folder_lock(run_dir: str | Path) -> Iterator[None]:
    """Hold ``<run>/.train.lock`` while training in ``run_dir``: a second training process of the
    same folder (two ``ckpt_path=last`` starts) stops with one error line instead of writing the
    same steps twice. The lock (``flock``) goes with the process, however it ends; only rank 0
    (or a process no launcher started) takes it."""
    import fcntl

    if launched_rank() != 0:
        yield
        return
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise UserError(f"{folder} is in use by another training process (pid {holder}, lock "
                            f"{folder / LOCK_FILE}); wait for it to end, or train in another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
