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

Left alone: an explicit ``hydra.run.dir``, a folder Hydra would reuse that already holds a
checkpoint (a requeued SLURM job: ``outputs/<task_name>/<job id>``), multirun and ``--cfg``-style
flags, and any ``ckpt_path`` other than ``last``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolemrc.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

# Keys a resumed run may change: where it runs and how it resumes, how long it trains (raising
# trainer.max_steps continues a finished run), how often it checkpoints, the progress bar.
IGNORED = ("run_dir", "ckpt_path", "trainer.max_steps", "trainer.enable_progress_bar",
           "runtime.checkpoint_every_n_steps", "trainer.checkpoint_every_n_steps", "runtime.device_memory_gb")
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


def find_run_to_continue(cfg: DictConfig, would_be: Path, args: Sequence[str]) -> Path | None:
    """The run folder ``ckpt_path=last`` continues (see the module), or None for a new run."""
    from rolemrc.checkpointing import find_checkpoint

    if find_checkpoint(would_be) is not None:
        return None  # Hydra reuses this folder anyway (a requeued SLURM job)
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
        if not saved.is_file() or find_checkpoint(folder) is None:
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
        raise ConfigError(
            f"ckpt_path=last: {len(matches)} run folders of task_name={cfg.task_name} hold a checkpoint and this "
            f"config: {', '.join(str(m) for m in matches)}; {how}")
    if changed:
        listed = "; ".join(f"{f} ({_shown(d)})" for f, d in changed)
        raise ConfigError(
            f"ckpt_path=last: the run folder(s) made by this command line were made with another config since "
            f"changed (saved -> now): {listed}; {how}")
    for folder, diff in near:
        log.warning("ckpt_path=last: %s holds a checkpoint of a config that differs in %s; not continued (to "
                    "continue it: hydra.run.dir=%s ckpt_path=last)", folder, _shown(diff), folder)
    return None


def continue_run_argv(argv: Sequence[str], config_dir: str | Path, config_name: str) -> list[str]:
    """``argv`` with ``hydra.run.dir=<the run to continue>`` added when ``ckpt_path=last``
    finds one (see the module); otherwise ``argv`` unchanged."""
    argv = list(argv)
    args = argv[1:]
    if not args or any(a.startswith("-") for a in args):  # -m, --cfg, --help, -cn ...: Hydra's business
        return argv
    if not any(a.split("=", 1)[0].lstrip("+~") in ("ckpt_path", "experiment") for a in args):
        return argv  # ckpt_path=last can only come from the command line or an experiment file
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except OverrideParseException:  # e.g. an unquoted '=' in a value: @hydra.main reports it the usual way
        return argv
    if any(o.key_or_group == "hydra.run.dir" for o in overrides):
        return argv  # the user named the folder
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name, overrides=args, return_hydra_config=True)
    except Exception:
        return argv  # a bad override: @hydra.main reports it the usual way
    finally:
        GlobalHydra.instance().clear()
    if cfg.get("ckpt_path") != "last":
        return argv
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} and ${now:...} in hydra.run.dir
    would_be = Path(str(cfg.hydra.run.dir))
    from rolemrc.checkpointing import find_checkpoint

    if find_checkpoint(would_be) is not None:  # a requeued SLURM job: Hydra reuses its folder, left as it is
        print(f"ckpt_path=last: continuing {would_be}", flush=True)
        return argv
    found = find_run_to_continue(cfg, would_be, args)
    if found is None:
        # The folder is named here, once: left to @hydra.main, ${now:...} would be read again a
        # few seconds later and the run would write another folder than the one printed.
        print(f"ckpt_path=last: no run of this config with a checkpoint in <run>/checkpoints under "
              f"{would_be.parent}: starting a new run in {would_be}", flush=True)
        return [*argv, f'hydra.run.dir="{would_be}"']
    finished = finished_run_message(cfg, found)
    if finished is not None:
        print(finished, flush=True)
        raise SystemExit(0)  # nothing to do: no checkpoint re-saved, no export redone
    print(f"ckpt_path=last: continuing {found}", flush=True)
    return [*argv, f'hydra.run.dir="{found}"']


def finished_run_message(cfg: DictConfig, run_dir: str | Path) -> str | None:
    """For ``ckpt_path=last`` on a run whose newest checkpoint already reached this config's end
    (``trainer.max_steps``, or ``trainer.max_epochs`` of complete epochs): what to say instead of
    training (which would only save the same checkpoint again and redo the export), naming how
    to extend it. None when there is more to train (or no checkpoint)."""
    # rolemrc.checkpointing loads Lightning: this module runs before Hydra starts and stays light
    from rolemrc.checkpointing import find_checkpoint, read_checkpoint_entries
    from rolemrc.checkpointing.run_state import completed_epochs
    from rolemrc.checkpointing.verify import check_checkpoint, reading

    checkpoint = find_checkpoint(run_dir)
    if checkpoint is None:
        return None
    try:
        with reading(check_checkpoint(checkpoint)):
            state = read_checkpoint_entries(checkpoint, ("global_step", "loops"))
    except CheckpointError:
        return None  # not decided here: the run checks its checkpoint and names what is wrong with it
    step = int(state.get("global_step", 0))
    epochs = completed_epochs(state)  # an epoch max_steps cut short is not complete
    max_steps = cfg.trainer.get("max_steps", -1)
    max_epochs = cfg.trainer.get("max_epochs", None)
    by_steps = max_steps is not None and max_steps >= 0 and step >= max_steps
    by_epochs = max_epochs is not None and max_epochs >= 0 and epochs >= max_epochs
    if not (by_steps or by_epochs):
        return None
    reached = (f"trainer.max_steps={max_steps} reached at step {step}" if by_steps
               else f"trainer.max_epochs={max_epochs} complete epoch(s) at step {step}")
    how = (f"to train further, raise trainer.max_steps (e.g. trainer.max_steps={step * 2}) with the same overrides "
           f"and ckpt_path=last" if by_steps else
           f"to train more epochs: trainer.max_epochs={max_epochs + 1} hydra.run.dir={run_dir} ckpt_path=last")
    return f"ckpt_path=last: {run_dir} is finished ({reached}; checkpoint {checkpoint}); nothing to do. {how}"
