"""General Δ (RoleMRC paper, Table 5): general-purpose benchmarks through lm-evaluation-harness.

    python evaluate.py benchmarks=general model.path=<trained> compare.path=<start>
    python evaluate.py benchmarks=general_sample            # the shipped tiny tasks, offline

Each model (``model.path``, and ``compare.path`` when set; both resolved like every
``model.path``: exports, run folders, checkpoints of ours) is loaded once as a transformers
model and wrapped in lm-eval's ``HFLM`` (``batch_size: auto`` by default); every task in
``benchmarks.tasks`` is run with ``lm_eval.simple_evaluate``. A task is an lm-eval registry name
(``gsm8k``, ``mmlu``, ``arc_challenge``...; their data come from the ``datasets`` cache, so run
once where the hub is reachable or copy the cache, then ``HF_DATASETS_OFFLINE=1``), a YAML task
file (relative ``dataset_kwargs.data_files`` are resolved against the YAML's folder: the
shipped ``rolemrc/assets/lm_eval/*.yaml`` run fully offline), or ``{task, metric}`` to pick
the metric reported (default: the task's first metric, e.g. ``acc``).

The report lists each task's score for both models and Δ = model − compare, and the average Δ
over the tasks both have; the loggers get ``general/<task>/model`` and ``general/average_model``
(with ``compare.path`` also ``.../compare``, ``.../delta``, ``general/average_compare`` and
``general/average_delta``). A task whose data set cannot be fetched (offline, not cached) ends the
run with one ``error:`` line naming it (:class:`~rolemrc.errors.DataUnavailable`). Each model's
results are kept in ``<out_dir>/general/<which>.json`` and reused by a rerun with the same model
and settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rolemrc.parts import build_chat
from rolemrc.config import Replier, plain
from rolemrc.errors import ConfigError, DataUnavailable, InputNotFound
from rolemrc.eval.generation import load_eval_model, model_label
from rolemrc.fileio import atomic_write_json
from rolemrc.warnings import lm_eval_prints

log = logging.getLogger(__name__)

SKIP_KEYS = ("alias", "name", "sample_len", "samples")


def task_specs(tasks: list[Any]) -> list[tuple[str, Any, str | None]]:
    """``(name, what lm-eval gets: a name or a task dict, metric or None)`` per configured task."""
    import yaml

    out = []
    for i, entry in enumerate(tasks):
        metric = None
        if isinstance(entry, dict):
            if "task" not in entry:
                raise ConfigError(f"benchmarks.tasks[{i}]: a mapping needs 'task' (and optionally 'metric')")
            metric = entry.get("metric")
            entry = entry["task"]
        if not isinstance(entry, str) or not entry.strip():
            raise ConfigError(f"benchmarks.tasks[{i}]: expected a task name or a YAML file, got {entry!r}")
        if entry.endswith((".yaml", ".yml")):
            path = Path(entry).expanduser()
            if not path.is_file():
                raise InputNotFound(f"benchmarks.tasks[{i}]: task file not found: {path}")
            try:
                spec = yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not a plain YAML task ({e}); put such tasks in a folder and set "
                                  "benchmarks.include_path") from None
            if not isinstance(spec, dict) or "task" not in spec:
                raise ConfigError(f"{path}: an lm-eval task YAML needs a 'task' name")
            files = (spec.get("dataset_kwargs") or {}).get("data_files")
            if isinstance(files, dict):
                for split, f in files.items():
                    p = Path(f) if Path(f).is_absolute() else path.parent / f
                    if not p.is_file():
                        raise InputNotFound(f"{path}: dataset_kwargs.data_files.{split}: not found: {p}")
                    files[split] = str(p)
            out.append((str(spec["task"]), spec, metric))
        else:
            out.append((entry, entry, metric))
    if not out:
        raise ConfigError("benchmarks.tasks is empty")
    return out


def pick_metric(result: dict[str, Any], metric: str | None, task: str) -> tuple[str, float]:
    """``(metric key, value)`` of one task's lm-eval result."""
    keys = [k for k, v in result.items() if k not in SKIP_KEYS and "_stderr" not in k and isinstance(v, (int, float))]
    if metric is not None:
        keys = [k for k in keys if k == metric or k.split(",")[0] == metric]
        if not keys:
            raise ConfigError(f"benchmarks: task {task} reported no metric {metric!r} (has: {', '.join(result)})")
    if not keys:
        raise ValueError(f"lm-eval reported no metric for task {task}: {result}")
    return keys[0], float(result[keys[0]])


def run_model(b: Any, specs: list[tuple[str, Any, str | None]], model: Any, tokenizer: Any, label: str,
              out: Path, limit: int | None, seed: int) -> dict[str, Any]:
    """lm-eval on one model: ``{task: {"metric", "value", "all": {...}}}`` (cached in ``out``);
    ``limit``: the run's, when ``benchmarks.limit`` is null."""
    settings = {"model": label, "tasks": [s for _, s, _ in specs], "limit": b.limit, "num_fewshot": b.num_fewshot,
                "max_length": b.max_length}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    if out.is_file():
        old = json.loads(out.read_text(encoding="utf-8"))
        if old.get("key") == key:
            log.info("general: %s results reused from %s", label, out)
            return old["tasks"]
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=b.batch_size, max_batch_size=b.max_batch_size,
              max_length=b.max_length, trust_remote_code=False)
    # Indexing lm-eval's own task folder takes a while: only when a task is named from it.
    named = any(isinstance(s, str) for _, s, _ in specs)
    tm = _task_manager(TaskManager)(include_path=b.include_path or None, include_defaults=named)
    limit = b.limit if b.limit is not None else limit
    with lm_eval_prints():  # its batch-size print()s: the size found, logged once
        res = lm_eval.simple_evaluate(model=lm, tasks=[s for _, s, _ in specs], task_manager=tm, limit=limit,
                                      num_fewshot=b.num_fewshot, log_samples=False, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    if res is None:
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    tasks = {}
    for name, _, metric in specs:
        if name not in res["results"]:
            raise ValueError(f"lm-eval returned no result for task {name} (got: {', '.join(res['results'])})")
        r = res["results"][name]
        mkey, value = pick_metric(r, metric, name)
        tasks[name] = {"metric": mkey, "value": value, "n": r.get("sample_len"),
                       "all": {k: v for k, v in r.items() if isinstance(v, (int, float))}}
    atomic_write_json(out, {"key": key, "settings": settings, "tasks": tasks,
                            "lm_eval_version": res.get("lm_eval_version"), "n-shot": res.get("n-shot")})
    return tasks


OFFLINE_HINT = ("lm-eval reads a task's data through `datasets`: run once where the hub is reachable (or copy "
                "~/.cache/huggingface/datasets here) and set HF_DATASETS_OFFLINE=1, or list a local task YAML in "
                "benchmarks.tasks (dataset_path: json with dataset_kwargs.data_files, like "
                "rolemrc/assets/lm_eval/general_sample.yaml; benchmarks=general_sample runs offline)")


def _task_manager(base: type) -> type:
    """lm-eval's ``TaskManager`` loading the tasks one at a time, so that a data set that cannot
    be fetched (hub offline or unreachable, nothing cached) ends in a :class:`DataUnavailable`
    naming the task, instead of a ``ConnectionError`` traceback from ``datasets``."""
    from datasets.exceptions import DatasetNotFoundError

    class Tasks(base):  # type: ignore[misc, valid-type]
        def load(self, task_list: Any) -> dict[str, Any]:
            items = task_list if isinstance(task_list, list) else [task_list]
            out: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
            for spec in items:
                name = spec.get("task") if isinstance(spec, dict) else getattr(spec, "task_name", spec)
                try:
                    part = super().load([spec])
                except (ConnectionError, DatasetNotFoundError) as e:
                    what = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    raise DataUnavailable(f"benchmarks: task {name}: its data set cannot be loaded ({what}); "
                                          + OFFLINE_HINT) from None
                for key in out:
                    out[key].update(part.get(key) or {})
            return out

    return Tasks


def check_data_offline(b: Any, specs: list[tuple[str, Any, str | None]]) -> None:
    """Offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), the registry tasks' data sets must
    already be cached: load them once here, before any model loads, so a missing one ends the run
    in its :class:`DataUnavailable` line at once (task YAML files were checked by :func:`task_specs`).
    Online, lm-eval fetches them itself when it runs."""
    import os

    offline = any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
                  for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    named = [s for _, s, _ in specs if isinstance(s, str)]
    if not offline or not named:
        return
    from lm_eval.tasks import TaskManager

    _task_manager(TaskManager)(include_path=b.include_path or None, include_defaults=True).load(named)


def _compare_model(r: Replier, path: str) -> tuple[Any, Any]:
    model = OmegaConf.merge(r.model, {"path": path})
    chat = build_chat(model)
    return load_eval_model(replace(r, model=model), chat.tokenizer), chat.tokenizer


def evaluate(settings: Any, ctx: Any) -> dict[str, Any]:
    """``settings``: the ``benchmarks`` and ``compare`` groups."""
    b, compare, r = settings.benchmarks, settings.compare, ctx.replier
    specs = task_specs(plain(b.tasks))
    if b.batch_size != "auto" and not (isinstance(b.batch_size, int) and b.batch_size > 0):
        raise ConfigError(f"benchmarks.batch_size must be 'auto' or a positive integer, got {b.batch_size!r}")
    out = ctx.out_dir / "general"
    out.mkdir(parents=True, exist_ok=True)
    check_data_offline(b, specs)  # a data set missing offline is named before the model loads
    model = ctx.model if ctx.model is not None else load_eval_model(r, ctx.tokenizer)
    label = model_label(r)
    results = {"model": run_model(b, specs, model, ctx.tokenizer, label, out / "model.json", ctx.limit, r.seed)}
    if compare.path:
        cmodel, ctok = _compare_model(r, compare.path)
        results["compare"] = run_model(b, specs, cmodel, ctok, str(compare.path), out / "compare.json", ctx.limit,
                                       r.seed)
        del cmodel
    rows = {}
    deltas = []
    for name, _, _ in specs:
        a = results["model"][name]
        row = {"metric": a["metric"], "model": a["value"], "n": a["n"]}
        if "compare" in results:
            c = results["compare"][name]
            row["compare"] = c["value"]
            row["delta"] = a["value"] - c["value"]
            deltas.append(row["delta"])
        rows[name] = row
    return {
        "benchmarks": b.name,
        "model": label,
        "compare": compare.path,
        "tasks": rows,
        "average": {"model": sum(r["model"] for r in rows.values()) / len(rows),
                    **({"compare": sum(r["compare"] for r in rows.values()) / len(rows),
                        "delta": sum(deltas) / len(deltas)} if deltas else {})},
        "settings": {"batch_size": b.batch_size, "limit": b.limit if b.limit is not None else ctx.limit,
                     "num_fewshot": b.num_fewshot, "max_length": b.max_length, "harness": _version()},
        "raw": results,
    }


def _version() -> str:
    from importlib.metadata import version

    return f"lm-eval {version('lm-eval')}"


def _p(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def render(res: dict[str, Any]) -> str:
    cmp = res["compare"] is not None
    lines = [f"## General benchmarks ({res['benchmarks']}; RoleMRC paper Table 5, General Δ)", "",
             f"{res['settings']['harness']}, scores x 100; model = {res['model']}"
             + (f", compare = {res['compare']}, Δ = model - compare." if cmp else "."), ""]
    if cmp:
        lines += ["| benchmark | metric | model | compare | Δ |", "|---|---|---|---|---|"]
        for name, r in res["tasks"].items():
            lines.append(f"| {name} | {r['metric']} | {_p(r['model'])} | {_p(r['compare'])} | {100 * r['delta']:+.2f} |")
        avg = res["average"]
        lines.append(f"| average | | {_p(avg['model'])} | {_p(avg['compare'])} | {100 * avg['delta']:+.2f} |")
    else:
        lines += ["| benchmark | metric | model |", "|---|---|---|"]
        for name, r in res["tasks"].items():
            lines.append(f"| {name} | {r['metric']} | {_p(r['model'])} |")
        lines.append(f"| average | | {_p(res['average']['model'])} |")
    lines.append("")
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, r in res["tasks"].items():
        out[f"general/{name}/model"] = r["model"]
        if "delta" in r:
            out[f"general/{name}/compare"] = r["compare"]
            out[f"general/{name}/delta"] = r["delta"]
    avg = res["average"]
    out["general/average_model"] = avg["model"]
    if "delta" in avg:
        out["general/average_compare"] = avg["compare"]
        out["general/average_delta"] = avg["delta"]
    return out
