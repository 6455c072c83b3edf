"""The five stages, run in order: personas -> profiles -> match -> dialogues -> assemble.

Each stage reads its predecessors' folders under ``out_dir``, writes its own, prints one stats
line and leaves a marker with a fingerprint of everything that shaped it. A rerun skips stages
whose fingerprint is unchanged; a changed or unfinished stage is redone, and its requests that
already finished come from the request cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from rolemrc.synth import dialogues as dlg
from rolemrc.synth import profiles as prof
from rolemrc.api import BudgetExhausted, api_key
from rolemrc.data.schemas import DataError
from rolemrc.errors import UserError
from rolemrc.registry import Registry
from rolemrc.synth import roleplay
from rolemrc.synth.assets import Assets
from rolemrc.synth.client import (
    Cache, ChatRequest, ChatResult, Generator, RemoteEmbedder, Usage, make_budget,
)
from rolemrc.synth.config import (
    ROLELLM_STAGES, ROLEMRC_STAGES, STAGES, AssembleConfig, BudgetConfig, DialoguesConfig, EmbedderConfig,
    GeneratorConfig, MatchConfig, MRCConfig, PersonasConfig, ProfilesConfig, SynthConfig,
)
from rolemrc.synth.embed import LocalEmbedder
from rolemrc.synth.records import check_pair, check_sft, check_test
from rolemrc.synth.search import extreme_inner_product
from rolemrc.synth.sources import load_mix, load_mrc, load_personas, standin_mrc, standin_personas
from rolemrc.synth.store import StageDir, fingerprint, read_jsonl, write_jsonl
from rolemrc.tasks import TEST_TASKS


# The config groups a stage reads, handed to its runner and its fingerprint after the context, in
# this order; a stage not listed reads the group of its own name.
STAGE_GROUPS: dict[str, tuple[str, ...]] = {"match": ("mrc", "match", "embedder")}


class Context:
    """What the stages share (each is handed its own groups beside it, :data:`STAGE_GROUPS`): the
    run's folder, seed and dry-run flag, the assets, the chat endpoint (``generator``) and the
    request cache and budget (``limits``, counted in ``budget``) every request goes through,
    output and progress."""

    def __init__(self, out: Path, console: Console, progress: Optional[Progress], *, assets: Assets, cache: Cache,
                 generator: GeneratorConfig, limits: BudgetConfig, seed: int, dry_run: bool) -> None:
        self.out, self.console, self.progress, self.assets, self.cache = out, console, progress, assets, cache
        self.generator, self.limits, self.seed, self.dry_run = generator, limits, seed, dry_run
        self.budget = make_budget(limits)
        self.usage: dict[str, Usage] = {}
        self.fps: dict[str, str] = {}
        self.missing: dict[str, list[dict[str, Any]]] = {}  # stage -> records without an answer
        self.standins: list[str] = []  # dry run: inputs that could not be read, planned with stand-ins

    def stage(self, name: str) -> StageDir:
        return StageDir(self.out, name)

    def write_missing(self, stage: str) -> int:
        """``<stage>/missing.jsonl``: the records without a usable answer (stage, id, reason);
        printed, and their count returned (the stage's ``missing`` stat)."""
        recs = self.missing.get(stage, [])
        write_jsonl(self.stage(stage).file("missing.jsonl"), recs)
        if recs:
            why = Counter(str(r["reason"]) for r in recs)
            self.console.print(escape(
                f"{stage}: {len(recs)} record(s) without a usable answer after retries "
                f"({', '.join(f'{k} {v}' for k, v in why.items())}): "
                f"{', '.join(r['id'] for r in recs[:8])}{' ...' if len(recs) > 8 else ''}; "
                f"see {self.stage(stage).file('missing.jsonl')}"), style="yellow")
        return len(recs)

    def bar(self, label: str, total: int) -> Callable[[int], None]:
        if self.progress is None:
            return lambda n: None
        task = self.progress.add_task(label, total=total)
        return lambda n: self.progress.advance(task, n)  # type: ignore[union-attr]

    def upstream(self, name: str) -> str:
        """Fingerprint of a finished earlier stage (from this run or its marker); a stage that
        finished with records missing adds their count, so once a rerun fills them in, the
        stages after it are redone."""
        if name not in self.fps:
            m = self.stage(name).require()
            self.fps[name] = output_fingerprint(m["fingerprint"], m["stats"].get("missing", 0))
        return self.fps[name]

    def generate(self, stage: str, requests: list[ChatRequest]) -> list[Optional[str]]:
        """Run chat requests concurrently (cache first); answers in request order, None for a
        request without a usable answer after every retry (recorded in ``missing``).

        Raises :class:`rolemrc.api.BudgetExhausted` when the budget ran out, and RuntimeError when the server
        refused the key or the URL (HTTP 401/403/404: later requests are not sent), both after
        every request in flight has finished and been cached."""
        advance = self.bar(f"{stage}: requests", len(requests))
        usage = self.usage.setdefault(stage, Usage())

        async def go() -> tuple[list[ChatResult], Optional[str]]:
            gen = Generator(self.generator, self.limits, self.budget, self.cache, dry_run=self.dry_run)

            async def one(r: ChatRequest) -> ChatResult:
                out = await gen.chat(r)
                advance(1)
                return out

            try:
                return list(await asyncio.gather(*(one(r) for r in requests))), gen.halted
            finally:
                await gen.close()
                usage.add(gen.usage)

        results, halted = asyncio.run(go())
        if halted:
            raise RuntimeError(f"{stage}: {halted} at {self.generator.base_url}; later requests were not sent "
                               "(check generator.base_url, generator.model and the API key); finished answers are cached")
        spent = [r for r in results if r.kind == "budget_exhausted"]
        if spent:
            raise BudgetExhausted(spent[0].error or "budget exhausted")
        for r in results:
            if r.text is None:
                self.missing.setdefault(stage, []).append(
                    {"stage": stage, "id": r.tag, "reason": r.kind, "error": r.error, "attempts": r.attempts})
        return [r.text for r in results]


class SynthIncomplete(UserError, RuntimeError):
    """Records without a usable answer after every retry: the rest was written; a rerun of the
    same command asks only for the missing ones."""


def output_fingerprint(fp: str, missing: int) -> str:
    """What later stages see of a stage: its fingerprint, plus how many records it lacks."""
    return f"{fp}+missing{missing}" if missing else fp


def _generator_fp(g: GeneratorConfig) -> dict[str, Any]:
    # Where the server lives and how hard we push it do not change what it returns.
    return {k: getattr(g, k) for k in ("model", "temperature", "top_p", "max_tokens", "seed", "structured_output", "extra_body")}


# ------------------------------------------------------------------ stages


def _read_source(ctx: Context, what: str, key: str, c: Any, read: Callable[..., Any], standin: Callable[..., Any]) -> Any:
    """``read(c, seed)``; a dry run whose hub source ``c`` cannot be read (offline) plans with
    ``standin(c)`` instead, and says so."""
    try:
        return read(c, ctx.seed)
    except (ConnectionError, OSError) as err:  # the hub unreachable (offline): datasets raises these
        if not (ctx.dry_run and c.source == "hub"):
            raise
        ctx.standins.append(what)
        ctx.console.print(escape(f"dry run: {key}.path={c.path} (hub) cannot be read here ({type(err).__name__}: "
                                 f"{err}); planning with stand-in {what} (request counts are the real ones, token "
                                 "estimates rough)"), style="yellow")
        return standin(c)


def _keep_valid(ctx: Context, stage: str, kept: str, answers: list[Optional[str]],
                finish: Callable[[int, str], tuple[Any, Any]], reason: Callable[[Any], str],
                ) -> tuple[list[Any], list[Any], dict[str, int]]:
    """Answer ``i`` checked by ``finish(i, answer)`` (-> valid record, or None and the invalid one):
    the valid ones written to ``<stage>/<kept>``, the others to ``<stage>/invalid.jsonl`` and
    counted by ``reason``; returns both and the counts. A request without a usable answer after
    every retry is skipped (reported as missing, asked again on a rerun)."""
    good, bad = [], []
    for i, text in enumerate(answers):
        if text is not None:
            ok, invalid = finish(i, text)
            if ok is not None:
                good.append(ok)
            else:
                bad.append(invalid)
    write_jsonl(ctx.stage(stage).file(kept), good)
    write_jsonl(ctx.stage(stage).file("invalid.jsonl"), bad)
    return good, bad, dict(Counter(reason(b) for b in bad))


def run_personas(ctx: Context, c: PersonasConfig) -> dict[str, Any]:
    personas, stats = _read_source(ctx, "personas", "personas", c, load_personas, standin_personas)
    if not personas:
        raise DataError(f"personas: no persona read from {c.path} "
                        f"({', '.join(f'{k}={v}' for k, v in stats.items())})")
    write_jsonl(ctx.stage("personas").file("personas.jsonl"), personas)
    return {"personas": len(personas), **stats}


def run_profiles(ctx: Context, c: ProfilesConfig) -> dict[str, Any]:
    personas = list(read_jsonl(ctx.stage("personas").file("personas.jsonl")))
    prof.example_profile(ctx.assets)
    min_chars = c.min_section_chars
    answers = ctx.generate("profiles", [prof.request(ctx.assets, p, min_chars) for p in personas])
    good, bad, reasons = _keep_valid(ctx, "profiles", "profiles.jsonl", answers,
                                     lambda i, text: prof.finish(personas[i], text, min_chars), lambda b: b["reason"])
    d = ctx.stage("profiles")
    missing = ctx.write_missing("profiles")
    if not good:
        raise RuntimeError(f"profiles: none of the {len(personas)} personas got a valid profile ({reasons or ''}"
                           f"{missing} missing); see {d.file('invalid.jsonl')} and {d.file('missing.jsonl')}")
    return {"personas": len(personas), "profiles": len(good), "invalid": len(bad), "invalid_by_reason": reasons,
            "missing": missing}


def _embed(ctx: Context, e: EmbedderConfig, texts: list[str], is_query: bool, label: str) -> np.ndarray:
    if ctx.standins:
        # Dry run on stand-in inputs: matches are meaningless, so nothing is embedded.
        return np.random.default_rng(len(texts)).standard_normal((len(texts), 8)).astype(np.float32)
    advance = ctx.bar(f"match: embed {label}", len(texts))
    if e.backend == "openai":
        usage = ctx.usage.setdefault("match", Usage())

        async def go() -> np.ndarray:
            emb = RemoteEmbedder(e, ctx.limits, ctx.budget, ctx.cache, dry_run=ctx.dry_run)
            try:
                return await emb.embed(texts, is_query, label, advance)
            finally:
                await emb.close()  # folds the client's counts into emb.usage
                usage.add(emb.usage)

        return asyncio.run(go())
    # In-process embedding costs no requests; a dry run computes it too so that matches (and
    # hence which dialogue requests are already cached) are the real ones.

    return LocalEmbedder.get(e).embed(texts, is_query, advance)


def run_match(ctx: Context, mrc: MRCConfig, match: MatchConfig, embedder: EmbedderConfig) -> dict[str, Any]:
    profiles = list(read_jsonl(ctx.stage("profiles").file("profiles.jsonl")))
    pool, mstats = _read_source(ctx, "MRC items", "mrc", mrc, load_mrc, standin_mrc)
    if not any(m["answerable"] for m in pool):
        raise DataError(f"match: no answerable MRC item in {mrc.path} (is mrc.no_answer_marker right?)")
    d = ctx.stage("match")
    write_jsonl(d.file("mrc_pool.jsonl"), pool)
    ptexts = [dlg.load_profile(p).matching_text(match.profile_sections) for p in profiles]
    if match.mrc_text == "question":
        mtexts = [m["question"] for m in pool]
    else:
        mtexts = [m["question"] + "\n" + next((t for t, s in zip(m["passages"], m["selected"]) if s), m["passages"][0]) for m in pool]
    pe = _embed(ctx, embedder, ptexts, True, "profiles")
    me = _embed(ctx, embedder, mtexts, False, "mrc")
    if ctx.dry_run and pe.shape[1] != me.shape[1]:
        # One side came from the cache, the other is a dry-run stand-in: any common shape will do.
        rng = np.random.default_rng(ctx.seed)
        pe, me = rng.standard_normal((len(ptexts), 8)).astype(np.float32), rng.standard_normal((len(mtexts), 8)).astype(np.float32)
    np.save(d.file("profile_emb.npy"), pe)
    np.save(d.file("mrc_emb.npy"), me)
    result: dict[str, dict[str, Any]] = {p["id"]: {"profile_id": p["id"], "related": {}, "unrelated": {}} for p in profiles}
    scores: dict[str, list[float]] = {"related": [], "unrelated": []}
    for part, flag in (("answerable", True), ("unanswerable", False)):
        idx = np.array([i for i, m in enumerate(pool) if m["answerable"] is flag], dtype=np.int64)
        if ctx.standins:
            idx = idx[: max(64, match.top_k)]  # stand-in inputs: any match will do, found quickly
        for p in profiles:
            result[p["id"]]["related"][part] = []
            result[p["id"]]["unrelated"][part] = []
        if len(idx) == 0:
            continue
        found = extreme_inner_product(pe, me[idx], match.top_k, match.chunk_size)
        for qi, p in enumerate(profiles):
            for rel, key in (("related", "max"), ("unrelated", "min")):
                hits = [{"id": pool[idx[j]]["id"], "score": float(s)} for j, s in zip(found[f"{key}_idx"][qi], found[f"{key}_score"][qi])]
                result[p["id"]][rel][part] = hits
                scores[rel].append(hits[0]["score"])
    write_jsonl(d.file("matches.jsonl"), (result[p["id"]] for p in profiles))
    return {
        "profiles": len(profiles), **{f"mrc_{k}": v for k, v in mstats.items()},
        "mean_top_score": round(float(np.mean(scores["related"])), 4) if scores["related"] else None,
        "mean_bottom_score": round(float(np.mean(scores["unrelated"])), 4) if scores["unrelated"] else None,
    }


def run_dialogues(ctx: Context, c: DialoguesConfig) -> dict[str, Any]:
    profiles = {p["id"]: dlg.load_profile(p) for p in read_jsonl(ctx.stage("profiles").file("profiles.jsonl"))}
    pool = {m["id"]: m for m in read_jsonl(ctx.stage("match").file("mrc_pool.jsonl"))}
    matches = {m["profile_id"]: m for m in read_jsonl(ctx.stage("match").file("matches.jsonl"))}
    plans, short = dlg.plan(c, list(profiles), matches, ctx.seed)
    builder = dlg.Builder(c, ctx.assets, ctx.seed)
    built = [builder.build(p, profiles[p.profile_id], pool.get(p.mrc_id) if p.mrc_id else None) for p in plans]
    answers = ctx.generate("dialogues", [b.request for b in built])
    items, bad, reasons = _keep_valid(ctx, "dialogues", "items.jsonl", answers, lambda i, text: built[i].finish(text),
                                      lambda x: f"{x['kind']}:{x['reason']}")
    stats = {"planned": len(plans), "items": len(items), "invalid": len(bad), "invalid_by_reason": reasons,
             "missing": ctx.write_missing("dialogues"), **builder.counters}
    if short:
        # e.g. no unanswerable MRC item in the pool: say so rather than silently build fewer.
        stats["unbuildable_no_match"] = short
        ctx.console.print(escape(f"dialogues: no matching MRC item for kinds {short}; raise mrc.n_unanswerable / n_answerable"), style="yellow")
    return stats


def _test_count(n: int, frac: float, cap: Optional[int]) -> int:
    if n < 2 or frac <= 0:
        return 0
    k = max(1, round(n * frac))
    k = min(k, n - 1)  # keep at least one item of every task for training
    return min(k, cap) if cap is not None else k


def _no_test_reason(by_task: dict[str, list[Any]], frac: float, cap: Optional[int]) -> str:
    """Why ``assemble.test_fraction`` > 0 held out no test item."""
    key = f"assemble.test_fraction={frac}"
    tasks = {t: len(g) for t, g in by_task.items() if t in TEST_TASKS}
    if not tasks:
        return f"{key} holds out nothing: the dialogues hold no item of a RoleMRC test task"
    if cap == 0:
        return f"{key} holds out nothing: assemble.test_max_per_task=0"
    return (f"{key} holds out nothing: every test task has fewer than 2 items ("
            + ", ".join(f"{t}: {n}" for t, n in sorted(tasks.items()))
            + ") and each keeps one for training; raise the dialogue quotas or set assemble.test_fraction=0")


def run_assemble(ctx: Context, a: AssembleConfig) -> dict[str, Any]:
    items = list(read_jsonl(ctx.stage("dialogues").file("items.jsonl")))
    by_task: dict[str, list[dict[str, Any]]] = {}
    for it in items:
        by_task.setdefault(it["task"], []).append(it)
    test, train = [], []
    for task in sorted(by_task):
        group = by_task[task]
        k = _test_count(len(group), a.test_fraction, a.test_max_per_task) if task in TEST_TASKS else 0
        order = list(range(len(group)))
        random.Random(f"{ctx.seed}:test:{task}").shuffle(order)
        held = set(order[:k])
        for i, it in enumerate(group):
            (test if i in held else train).append(it)
    if a.test_fraction > 0 and not test:
        ctx.console.print(escape(f"warning: {_no_test_reason(by_task, a.test_fraction, a.test_max_per_task)}; "
                                 "test.jsonl is empty"), style="yellow")
    sft, pairs = [], []
    rng = random.Random(f"{ctx.seed}:pairs")
    for it in train:
        to_pairs = it["pair"] is not None and (a.pairs == "both" or rng.random() < a.pair_fraction)
        to_sft = it["pair"] is None or a.pairs == "both" or not to_pairs
        if to_sft:
            sft.append({"task": it["task"], "conversations": it["conversation"]})
        if to_pairs:
            pairs.append({"task": it["task"], **it["pair"]})
    test_recs = []
    for it in test:
        rec = {"task": it["task"], "question": it["pair"]["prompt"], "reference": it["pair"]["chosen"]}
        if "rule" in it:
            rec["rule"] = it["rule"]
        test_recs.append(rec)
    mixed: dict[str, int] = {}
    for i, src in enumerate(a.mix):
        recs, skipped = load_mix(src, ctx.seed + i)
        (pairs if src.into == "pairs" else sft).extend(recs)
        mixed[src.task] = mixed.get(src.task, 0) + len(recs)
        if skipped:
            mixed[f"{src.task}:skipped"] = skipped
    if a.shuffle:
        random.Random(f"{ctx.seed}:shuffle:sft").shuffle(sft)
        random.Random(f"{ctx.seed}:shuffle:pairs").shuffle(pairs)
    # The readers take these files as they are: check every record before writing.
    for i, r in enumerate(sft):
        check_sft(r, f"sft.jsonl:{i + 1}")
    for i, r in enumerate(pairs):
        check_pair(r, f"pairs.jsonl:{i + 1}")
    for i, r in enumerate(test_recs):
        check_test(r, f"test.jsonl:{i + 1}", TEST_TASKS)
    d = ctx.stage("assemble")
    write_jsonl(d.file("sft.jsonl"), sft)
    write_jsonl(d.file("pairs.jsonl"), pairs)
    write_jsonl(d.file("test.jsonl"), test_recs)
    counts: dict[str, dict[str, int]] = {}
    kind_of = {it["task"]: it["kind"] for it in items}
    for name, recs in (("sft", sft), ("pairs", pairs), ("test", test_recs)):
        for r in recs:
            c = counts.setdefault(r["task"], {"kind": kind_of.get(r["task"], "mix"), "sft": 0, "pairs": 0, "test": 0})  # type: ignore[dict-item]
            c[name] += 1
    return {"sft": len(sft), "pairs": len(pairs), "test": len(test_recs), "mixed": mixed, "counts": counts}


RUNNERS: Registry[Callable[..., dict[str, Any]]] = Registry("stages", doc="synthesize.py's stages (stages=[...])")
RUNNERS.register("personas", run_personas)
RUNNERS.register("profiles", run_profiles)
RUNNERS.register("match", run_match)
RUNNERS.register("dialogues", run_dialogues)
RUNNERS.register("assemble", run_assemble)
RUNNERS.register("context_instruct", roleplay.run_context_instruct)  # RoleLLM's two
RUNNERS.register("rolegpt", roleplay.run_rolegpt)


def stage_fingerprint(ctx: Context, name: str, *groups: Any) -> str:
    """What stage ``name``'s output depends on: its ``groups`` (:data:`STAGE_GROUPS`), the stage it
    reads, the generator, the assets and the seed, as far as each shapes it."""
    own, gen = [dataclasses.asdict(g) for g in groups], _generator_fp(ctx.generator)
    if name == "personas":
        return fingerprint(name, *own, ctx.seed)
    if name == "profiles":
        return fingerprint(name, ctx.upstream("personas"), gen, *own, ctx.assets.fingerprint())
    if name == "match":
        mrc, match, e = own
        e = {k: v for k, v in e.items() if k not in ("base_url", "api_key_env", "concurrency", "timeout_s", "max_retries", "backoff_s", "max_backoff_s", "device")}
        return fingerprint(name, ctx.upstream("profiles"), mrc, match, e, ctx.seed)
    if name == "dialogues":
        return fingerprint(name, ctx.upstream("match"), gen, *own, ctx.assets.fingerprint(), ctx.seed)
    if name == "assemble":
        return fingerprint(name, ctx.upstream("dialogues"), *own, ctx.seed)
    if name in ROLELLM_STAGES:
        return roleplay.stage_fingerprint(ctx, name, *groups, gen)
    raise ValueError(name)


# ------------------------------------------------------------------ reporting


def _fmt(stats: dict[str, Any]) -> str:
    parts = []
    for k, v in stats.items():
        if k == "counts":
            continue
        if isinstance(v, dict):
            if v:
                parts.append(f"{k}=" + ",".join(f"{a}:{b}" for a, b in v.items()))
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


def summary_table(counts: dict[str, dict[str, Any]], paper: dict[str, Any]) -> Table:
    """Counts per task type, grouped as in the paper, beside the paper's sizes (Table 2)."""
    t = Table(title="RoleMRC synthesis: items per task (paper sizes for comparison)")
    for col in ("group / task", "SFT", "pairs", "test", "paper SFT"):
        t.add_column(col, justify="left" if col.startswith("group") else "right")
    total = {"sft": 0, "pairs": 0, "test": 0}
    seen = set()
    for g in paper["groups"].values():
        rows = sorted((task, c) for task, c in counts.items() if c["kind"] in g["kinds"])
        gsum = {k: sum(c[k] for _, c in rows) for k in total}
        t.add_row(f"[bold]{g['label']}[/bold]", *(str(gsum[k]) for k in total), f"{g['sft']:,}")
        for task, c in rows:
            seen.add(task)
            t.add_row(f"  {task}", str(c["sft"]), str(c["pairs"]), str(c["test"]), "")
        for k in total:
            total[k] += gsum[k]
    mix = sorted((task, c) for task, c in counts.items() if task not in seen)
    if mix:
        t.add_row("[bold]Mixed-in sources[/bold]", "", "", "", "")
        for task, c in mix:
            t.add_row(f"  {task}", str(c["sft"]), str(c["pairs"]), str(c["test"]), "")
            for k in total:
                total[k] += c[k]
    pt = paper["totals"]
    t.add_row("[bold]Total[/bold]", str(total["sft"]), str(total["pairs"]), str(total["test"]), f"{pt['sft']:,} (+{pt['pairs']:,} pairs, {pt['test']:,} test)")
    if "mix" in paper:
        t.add_row("RoleMRC-mix (paper)", "", "", "", f"{paper['mix']['sft']:,} (+{paper['mix']['pairs']:,} pairs)")
    return t


def dry_run_table(usage: dict[str, Usage], g: GeneratorConfig) -> Table:
    t = Table(title="dry run: requests a real run would make")
    for col in ("stage", "requests", "cached", "to send", "est. prompt tokens", "est. completion tokens", "est. cost (USD)"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    priced = g.price_input_per_m is not None and g.price_output_per_m is not None
    tot = Usage()
    total_cost = 0.0
    for stage, u in usage.items():
        tot.add(u)
        cost = ""
        if priced:
            usd = (u.est_prompt_tokens * g.price_input_per_m + u.est_completion_tokens * g.price_output_per_m) / 1e6
            total_cost += usd
            cost = f"{usd:.2f}"
        t.add_row(stage, str(u.requests), str(u.cached), str(u.requests - u.cached), f"{u.est_prompt_tokens:,}", f"{u.est_completion_tokens:,}", cost)
    t.add_row("[bold]total[/bold]", str(tot.requests), str(tot.cached), str(tot.requests - tot.cached), f"{tot.est_prompt_tokens:,}", f"{tot.est_completion_tokens:,}",
              f"[bold]{total_cost:.2f}[/bold]" if priced else "n/a (no generator.price_*_per_m)")
    return t


def print_whole(console: Console, table: Table) -> None:
    """A table printed at its natural width: when output is no terminal (``> log``) Rich assumes
    80 columns and would cut columns and totals short."""
    from rich.measure import Measurement

    if console.is_terminal:
        console.print(table)
        return
    width = Measurement.get(console, console.options.update(width=10_000), table).maximum
    before = console.width
    console.width = max(before, width)  # print(width=...) cannot go past the console's own width
    try:
        console.print(table)
    finally:
        console.width = before


def _hydra_path(path: Path) -> str:
    """A path as a Hydra override value: quoted where Hydra's grammar would read its characters."""
    text = str(path)
    return text if re.fullmatch(r"[\w./~+-]+", text) else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def train_commands(out: Path, results: dict[str, Any], train_py: str = "train.py") -> list[str]:
    """``python train.py ...`` for each finished output of this run that holds records (one
    shell line each, data paths absolute and quoted; ``train_py`` as the synthesis script was named)."""
    commands = []
    if "assemble" in results:
        stats = results["assemble"]
        if stats.get("sft", 0) or stats.get("pairs", 0):
            data_dir = (out / "assemble").resolve()
            commands.append(shlex.join(["python", train_py, "data=local", f"data.dir={_hydra_path(data_dir)}"]))
    for stage in ROLELLM_STAGES:
        sft = (out / stage / "sft.jsonl").resolve()
        if stage in results and sft.is_file() and sft.stat().st_size > 0:
            commands.append(shlex.join(["python", train_py, f"data.sft=[{{path: {_hydra_path(sft)}}}]"]))
    return commands


def _real_run_command(command: Optional[list[str]]) -> Optional[str]:
    """The command line that started a dry run, without its ``dry_run=true``."""
    if not command:
        return None
    kept = [a for a in command[1:] if not re.fullmatch(r"\+*dry_run=(true|True|1)", a)]
    return shlex.join(["python", command[0], *kept])


def run(cfg: SynthConfig, console: Optional[Console] = None, command: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the configured stages; returns {stage: stats} (dry run: {stage: usage}).

    ``command``: the script and its arguments as typed (``sys.argv``), for the command lines
    printed at the end (a dry run's real run, an incomplete run's rerun)."""
    console = console or Console()
    show = console.is_terminal if cfg.progress is None else cfg.progress
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        if cfg.dry_run:
            # Stages run for real on stand-in answers, in a scratch folder, with the cache read-only.
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rolemrc-dry-")))
        else:
            out = Path(cfg.out_dir)
            out.mkdir(parents=True, exist_ok=True)
        progress = None
        if show:
            progress = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True))
        ctx = Context(out, console, progress, assets=Assets(cfg.assets_dir),
                      cache=Cache(Path(cfg.cache_dir or Path(cfg.out_dir) / "cache"), read_only=cfg.dry_run),
                      generator=cfg.generator, limits=cfg.budget, seed=cfg.seed, dry_run=cfg.dry_run)
        names = [s for s in STAGES if s in cfg.stages]
        if not cfg.dry_run:
            # A key the run will need is checked before any stage starts, naming its variable.
            if {"profiles", "dialogues", *ROLELLM_STAGES} & set(names):
                api_key(cfg.generator.api_key_env, "generator")
            if "match" in names and cfg.embedder.backend == "openai":
                api_key(cfg.embedder.api_key_env, "embedder")
        if cfg.dry_run and names:
            # The scratch folder starts empty: run every stage of the RoleMRC chain up to the last
            # one asked for (the RoleLLM stages read no other stage).
            chain = [s for s in names if s in ROLEMRC_STAGES]
            names = (list(ROLEMRC_STAGES[: ROLEMRC_STAGES.index(chain[-1]) + 1]) if chain else []) + \
                [s for s in names if s not in ROLEMRC_STAGES]
        for name in names:
            groups = [getattr(cfg, g) for g in STAGE_GROUPS.get(name, (name,))]
            d = ctx.stage(name)
            fp = stage_fingerprint(ctx, name, *groups)
            if not cfg.force and not cfg.dry_run and d.done(fp):
                stats = d.marker()["stats"]  # type: ignore[index]
                ctx.fps[name] = output_fingerprint(fp, stats.get("missing", 0))
                console.print(escape(f"[{name}] up to date: {_fmt(stats)}"), style="dim")
                results[name] = stats
                continue
            t0 = time.perf_counter()
            d.start()
            stats = RUNNERS[name](ctx, *groups)
            u = ctx.usage.get(name)
            if u is not None:
                stats["usage"] = {"requests": u.requests, "cached": u.cached, "sent": u.sent, "retries": u.retries,
                                  "rate_limited": u.rate_limited, "failed": u.failed, "faults": dict(u.faults),
                                  "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}
            stats["seconds"] = round(time.perf_counter() - t0, 2)
            d.finish(fp, stats)  # with records missing, the marker does not count as done: a rerun redoes it
            ctx.fps[name] = output_fingerprint(fp, stats.get("missing", 0))
            results[name] = stats
            line = f"[{name}] {_fmt({k: v for k, v in stats.items() if k not in ('usage', 'seconds')})}"
            if u is not None:
                line += f" | {u.line(cfg.dry_run)}"
            # A dry run's folder is scratch, deleted at exit: not named as where anything is.
            where = "(dry run: nothing kept)" if cfg.dry_run else f"-> {d.path}"
            console.print(escape(f"{line} | {stats['seconds']}s {where}"), soft_wrap=True)
        if cfg.dry_run:
            print_whole(console, dry_run_table(ctx.usage, cfg.generator))
            real = _real_run_command(command)
            console.print(escape(f"dry run: nothing was written; the real run writes into {Path(cfg.out_dir).resolve()}"
                                 + (f": {real}" if real else " (the same command without dry_run=true)")),
                          soft_wrap=True)
            return {k: dataclasses.asdict(v) for k, v in ctx.usage.items()}
        if "assemble" in results:
            console.print(summary_table(results["assemble"]["counts"], ctx.assets.paper))
        # train.py beside synthesize.py, named the way synthesize.py was: the command works where this one did
        commands = train_commands(out, results, str(Path(command[0]).with_name("train.py")) if command else "train.py")
        for train in commands:  # soft_wrap: a command is never broken across lines (it must paste whole)
            console.print(escape(f"train on it as it is: {train}"), soft_wrap=True)
        if not commands and results:
            console.print(escape(f"no records kept in {out.resolve()}: nothing to train on yet"), style="yellow",
                          soft_wrap=True)
        missing = {n: st["missing"] for n, st in results.items() if isinstance(st, dict) and st.get("missing")}
        if missing:
            # Promised records are missing: never exit 0 (what was built is written and kept).
            rerun = shlex.join(["python", command[0], *command[1:]]) if command else "the same command"
            raise SynthIncomplete(
                "synthesis incomplete: " + ", ".join(f"{n} {k} record(s) missing" for n, k in missing.items())
                + f" after every retry (ids and reasons in {out}/<stage>/missing.jsonl); the other records are written;"
                f" to ask only for the missing ones, rerun: {rerun}")
    return results
