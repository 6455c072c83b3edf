"""Hydra's own errors, raised while it parses the command line and composes the config (before an
entry script's main runs), as one ``error: <message>`` line and exit status 1, as rolemrc's own
(:mod:`rolemrc.errors`):

- a key that does not exist (``trainer.max_step=5``, ``limt=4``): Hydra would advise appending it
  with ``+``, which the schema then refuses; instead the nearest known key
  (``did you mean trainer.max_steps?``) or the node's keys;
- a group option that does not exist (``objective=dpp``): the nearest option and the options,
  without the ``<name>_schema`` entries that only type a group's files;
- a value of the wrong type, an override that does not parse: Hydra's message on one line;
- a SLURM launcher (``-m hydra/launcher=slurm``) on a machine without SLURM, or whose ``sbatch`` refuses
  the jobs: what to run instead.

:func:`install` (called by :func:`rolemrc.config.register`) wraps Hydra 1.3's ``run_and_report``,
through which Hydra runs the composition and the job; a Hydra without it is left as it is."""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Callable, Iterable
from typing import Any

SCHEMA_SUFFIX = "_schema"  # a group option that only types the group's files (objective/<name>_schema)


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The known word closest to ``word`` (difflib), or None when none is close."""
    near = difflib.get_close_matches(word, list(known), n=1)
    return near[0] if near else None


def live_options(options: Iterable[str]) -> list[str]:
    """A group's options a user may choose: ``<name>_schema`` entries (the schema of ``<name>``'s
    file) left out."""
    found = list(options)
    return [o for o in found if not (o.endswith(SCHEMA_SUFFIX) and o[: -len(SCHEMA_SUFFIX)] in found)]


def _known_keys(cause: Any) -> tuple[list[str], str]:
    """(the keys of the node a missing key was looked up in, that node's schema name or "")."""
    schema = getattr(cause, "object_type", None)
    if dataclasses.is_dataclass(schema):
        return [f.name for f in dataclasses.fields(schema)], schema.__name__
    node = getattr(cause, "parent_node", None)
    try:
        return [str(k) for k in node.keys()], ""  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no node to read keys from: no suggestion
        return [], ""


# Where else a key that its node lacks exists: (node's dotted path, key) -> a hint, or None. The
# config module registers one (``objective.beta`` on ``objective=sft``: the objectives that have it).
KEY_ELSEWHERE: list[Callable[[str, str], str | None]] = []


def unknown_key_line(override_key: str, cause: Any) -> str:
    """``<key> is not a config key (<Schema>); did you mean <nearest>?`` for an override of a key
    its node lacks (``cause``: OmegaConf's ConfigKeyError/ConfigAttributeError)."""
    full = str(getattr(cause, "full_key", None) or override_key)
    parent, _, name = full.rpartition(".")
    known, schema = _known_keys(cause)
    where = f" ({schema})" if schema else ""
    near = nearest(name, known)
    if near is not None:
        hint = f"did you mean {parent + '.' if parent else ''}{near}?"
    else:
        hint = f"its keys: {', '.join(known)}" if known else "it has no keys to set"
    if near is None:
        hint += "".join(f"; {found}" for found in (h(parent, name) for h in KEY_ELSEWHERE) if found)
    return f"{full} is not a config key{where}; {hint}"


def missing_option_line(missing: str, options: Iterable[str] | None) -> str:
    """``<group>=<name> is not an option of <group>; did you mean <group>=<nearest>? (options: ...)``."""
    group, _, name = missing.rpartition("/")
    shown = live_options(options or [])
    if not group:
        return f"no config named {name!r}"
    near = nearest(name, shown)
    hint = f"did you mean {group}={near}? " if near is not None else ""
    listed = f"(options: {', '.join(shown)})" if shown else f"(the group {group} has no options)"
    return f"{group}={name} is not an option of {group}; {hint}{listed}"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def sbatch_refusal(err: BaseException) -> str | None:
    """submitit's error when ``sbatch`` itself refuses the sweep's array job (SLURM installed but not
    reachable, a partition or account it rejects): sbatch's own last words, on one line."""
    cause = err.__cause__
    cmd = getattr(cause, "cmd", None)
    if type(err).__name__ != "FailedJobError" or not isinstance(cmd, (list, tuple)) or not cmd:
        return None
    if str(cmd[0]).rsplit("/", 1)[-1] != "sbatch":
        return None
    said = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = said[-1] if said else "no message"
    return (f"hydra/launcher=slurm: sbatch refused the sweep's jobs ({last}): check that SLURM answers here "
            "(sinfo), or run the sweep with hydra/launcher=local")


def one_line(err: BaseException) -> str | None:
    """The ``error:`` line (without the prefix) for an exception raised by Hydra or its launcher
    before or around the job, or None for anything else (a bug keeps its traceback)."""
    from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(err, RuntimeError) and 'Could not detect "srun"' in str(err):  # submitit's SLURM executor
        return ("hydra/launcher=slurm submits each job of the sweep with SLURM, which this machine does not have "
                "(no srun on PATH): run the command on a SLURM login node, or run the sweep here with "
                "hydra/launcher=local (or without a hydra/launcher override: one job after another)")
    refused = sbatch_refusal(err)
    if refused is not None:
        return refused
    if not isinstance(err, CompactHydraException):
        return None
    message = str(err)
    cause = err.__cause__
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "Could not find" in message:
        return missing_option_line(err.missing_cfg_file, err.options)
    if message.startswith("Could not override '") and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        return unknown_key_line(message.split("'")[1], cause)
    if isinstance(err, OverrideParseException):  # the grammar's complaint, then Hydra's link to the grammar
        said = [line.strip() for line in message.splitlines()
                if line.strip() and not line.startswith(("Error parsing override", "See https://"))]
        return (f"cannot read the override {err.override!r}: {'; '.join(said) or _first_line(err)} (the syntax: "
                "https://hydra.cc/docs/advanced/override_grammar/basic)")
    line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    if isinstance(cause, OmegaConfBaseException):
        line = f"{line}: {_first_line(cause)}"
    return line.removeprefix("Error merging override ")


def _one_line_errors(run_and_report: Callable[[Callable[[], Any]], Any]) -> Callable[[Callable[[], Any]], Any]:
    def wrapped(func: Callable[[], Any]) -> Any:
        def translated() -> Any:
            try:
                return func()
            except Exception as err:
                line = one_line(err)
                if line is None:
                    raise
                print(f"error: {line}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None

        return run_and_report(translated)

    wrapped._rolemrc = True  # type: ignore[attr-defined]
    return wrapped


def install(key_elsewhere: Callable[[str, str], str | None] | None = None) -> None:
    """Wrap Hydra's ``run_and_report`` (idempotent) so that the errors :func:`one_line` knows end
    the process with one ``error:`` line and exit status 1, also under ``HYDRA_FULL_ERROR=1``;
    ``key_elsewhere`` joins :data:`KEY_ELSEWHERE`."""
    if key_elsewhere is not None and key_elsewhere not in KEY_ELSEWHERE:
        KEY_ELSEWHERE.append(key_elsewhere)
    try:
        import hydra._internal.hydra as hydra_module
        import hydra._internal.utils as utils_module
    except ImportError:  # pragma: no cover - another Hydra layout
        return
    for module in (utils_module, hydra_module):
        current = getattr(module, "run_and_report", None)
        if current is not None and not getattr(current, "_rolemrc", False):
            module.run_and_report = _one_line_errors(current)  # type: ignore[attr-defined]
