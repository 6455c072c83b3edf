"""Start-up at the real data scale: first and second start of a training run on N RoleMRC-shaped
SFT records (~5 KB each, made deterministically from the shipped sample), for

- ``rolemrc``: ``train.py`` with the encoded-row store (``data.cache=true``, the default): the
  first start builds the store, the second maps it;
- ``rolemrc data.cache=false``: encodes into memory at every start (what every start cost before);
- ``trl``: TRL 1.16's ``SFTTrainer`` on the same file and tokenizer (``datasets.load_dataset`` of
  the JSONL, conversations as ``messages``, the trainer's own tokenizing ``map`` with
  ``dataset_num_proc`` = our worker count); the rerun reuses the ``datasets`` cache.

Each start is its own process, timed from launch to the first training step (a callback stamps the
time when the first batch starts) and to exit (one optimizer step, ``max_length=4096``, batch 8,
the tiny model); the peak RSS is the largest of the process and its children (encoder workers,
datasets' map workers), from ``wait4``. With ``--ddp`` a 2-rank DDP start on the built store also
reports the memory the store's maps take in each rank (every page touched: a whole epoch's reads)
and the two ranks' sum of its proportional share (PSS) against one rank's RSS.

    make bench-data                                     # 12k and 48k records, all contenders, + DDP
    .venv/bin/python benchmarks/data_scale.py --sizes 2000 --skip trl   # a quick look

``--in-memory`` times instead what every rank pays at every start for the rows the sft/pairs
store does not hold: GRPO's prompt rows (data kind ``prompts``: the same records as SFT
conversations cut before their last assistant turn, as ``data=rolemrc_rl`` reads the RoleMRC SFT
mix), encoded in memory (``data.cache=false``) and with their token ids from the prompt store
(first start: built; second: read back), and KTO's unpaired examples (``data.unpaired``: each
record's last exchange as ``{prompt, completion, label}``), encoded in memory and (stage
``unpaired-store``) from their own store (first start: built; second: read back): the datamodule's
``setup`` (read, render, tokenise) in this process, best of ``--repeats``:

    .venv/bin/python benchmarks/data_scale.py --in-memory --sizes 24000   # the RoleMRC mix's size

The machine is shared: the wall times move with the load (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "src" / "rolemrc" / "assets" / "sample" / "sft.jsonl"
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "68719476736", "MALLOC_TOP_PAD_": "1073741824"}
RECORD_BYTES = 5000


def make_records(n: int, path: Path, seed: int = 0) -> None:
    """``n`` RoleMRC-shaped SFT records of ~5 KB: the sample's conversations in turn, their system
    prompt lengthened with other sample profiles and passages (seeded)."""
    src = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    texts = [m["content"] for r in src for m in r["conversations"] if m["role"].lower() == "system"]
    rng = random.Random(seed)
    with path.open("w") as fh:
        for i in range(n):
            record = json.loads(json.dumps(src[i % len(src)]))
            conv = record["conversations"]
            extra: list[str] = []
            while len(json.dumps(record)) + sum(map(len, extra)) < RECORD_BYTES:
                extra.append(rng.choice(texts))
            if conv[0]["role"].lower() == "system":
                conv[0]["content"] += "\n\n" + "\n\n".join(extra)
            else:
                conv.insert(0, {"role": "System", "content": "\n\n".join(extra)})
            fh.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------- inside the train.py process

try:
    import lightning as L

    class Probe(L.Callback):
        """Stamps the first training batch's start; with ``touch``, reads every page of the data
        store first and records what its maps take (RSS, PSS from /proc/self/smaps)."""

        def __init__(self, path: str, touch: bool = False) -> None:
            self.path, self.touch, self.done = Path(path), touch, False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if self.done:
                return
            self.done = True
            record: dict[str, Any] = {"first_step": time.time(), "rank": trainer.global_rank,
                                      "cpu_s": _cpu_seconds()}
            dm = trainer.datamodule
            store = getattr(dm, "store", None)
            if self.touch and store is not None:
                for arr in store.arrays.values():
                    int(arr.sum()) if arr.size else 0  # every page read, as an epoch would
                trainer.strategy.barrier("probe")  # every rank has mapped and read it: PSS splits the pages
                record.update(store_memory(store.folder))
            record["vm_hwm_kib"] = _status_kib("VmHWM")
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
except ImportError:  # the TRL child and the driver do not need it
    pass


def _cpu_seconds() -> float:
    """CPU seconds so far of this process and its finished children (the store's encoder workers)."""
    import resource

    return round(sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                     for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)), 1)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def store_memory(folder: Path) -> dict[str, int]:
    """KiB of RSS and PSS of this process's mappings of files in ``folder``."""
    rss = pss = 0
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if re.match(r"[0-9a-f]+-[0-9a-f]+$", parts[0]):  # a mapping's header: range perms offset dev inode [path]
            current = parts[5] if len(parts) > 5 else None  # anonymous mappings have no path
        elif current and current.startswith(str(folder)):
            if parts[0] == "Rss:":
                rss += int(parts[1])
            elif parts[0] == "Pss:":
                pss += int(parts[1])
    return {"store_rss_kib": rss, "store_pss_kib": pss}


# ------------------------------------------------------------------------------------- the TRL child


def trl_child(data: Path, out: Path, num_proc: int) -> None:
    """TRL 1.16 SFTTrainer's dataset preparation on ``data`` and one step, timestamps to ``out``."""
    import torch
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "src" / "rolemrc" / "assets" / "tokenizers" / "tiny-llama3")
    # conf/model/tiny.yaml's model
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
                                  pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    ds = load_dataset("json", data_files=str(data), split="train")
    ds = ds.map(lambda r: {"messages": [{"role": m["role"].lower(), "content": m["content"]} for m in r["conversations"]]},
                remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None)
    stamps: dict[str, float] = {}

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
            stamps.setdefault("first_step", time.time())

    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(output_dir=tmp, max_length=4096, per_device_train_batch_size=8, max_steps=1, report_to="none",
                         save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False,
                         dataset_num_proc=num_proc if num_proc > 1 else None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer, callbacks=[Stamp()])
        stamps["prepared"] = time.time()
        trainer.train()
    out.write_text(json.dumps(stamps))


# ------------------------------------------------------------------------------------------ the driver


def _launch(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``cmd``; wall seconds, and the peak RSS (MiB) of it and its waited-for children."""
    load_before = load_average()
    start = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}); see {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-15:]))
    # CPU seconds of the process and its children (encoder workers): what the start costs whatever the load
    return {"start": start, "wall_s": round(time.time() - start, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "load_before": load_before, "load_after": load_average()}


def run_rolemrc(data: Path, work: Path, tag: str, cache: bool, cache_dir: Path, extra: list[str] = (),
                touch: bool = False) -> dict[str, Any]:
    probe = work / f"probe-{tag}"
    shutil.rmtree(probe, ignore_errors=True)
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT / "src"), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "train.py", f"data.sft=[{{path: {data}}}]", "data.max_length=4096", "trainer.max_steps=1",
           "export.enabled=false", "callbacks=none", "logger=none", "trainer.enable_progress_bar=false",
           "trainer.limit_val_batches=0",  # only the start is measured: no validation pass after the step
           f"data.cache={str(cache).lower()}", f"data.cache_dir={cache_dir}", f"hydra.run.dir={work / f'run-{tag}'}",
           "+callbacks.probe._target_=data_scale.Probe", f"+callbacks.probe.path={probe}",
           f"+callbacks.probe.touch={str(touch).lower()}", *extra]
    result = _launch(cmd, env, work / f"{tag}.log")
    ranks = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    result["first_step_s"] = round(ranks[0]["first_step"] - result["start"], 1)
    if "cpu_s" in ranks[0]:
        result["cpu_to_first_step_s"] = ranks[0]["cpu_s"]
    result["ranks"] = ranks
    return result


def run_trl(data: Path, work: Path, tag: str, hf_cache: Path, num_proc: int) -> dict[str, Any]:
    out = work / f"trl-{tag}.json"
    env = {**os.environ, **MALLOC_ENV, "HF_DATASETS_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    result = _launch([sys.executable, __file__, "--trl-child", str(data), str(out), str(num_proc)], env,
                     work / f"trl-{tag}.log")
    stamps = json.loads(out.read_text())
    result["first_step_s"] = round(stamps["first_step"] - result["start"], 1)
    return result


def make_unpaired(sft: Path, path: Path) -> None:
    """KTO's unpaired examples from SFT records: the conversation up to its last user turn as the
    prompt, the last assistant turn as the completion, desirable and undesirable in turn."""
    with sft.open() as src, path.open("w") as fh:
        for i, line in enumerate(src):
            conv = json.loads(line)["conversations"]
            last = max(k for k, m in enumerate(conv) if m["role"].lower() == "assistant")
            prompt = [{"role": m["role"].lower(), "content": m["content"]} for m in conv[:last]]
            fh.write(json.dumps({"prompt": prompt, "completion": conv[last]["content"], "label": i % 2 == 0}) + "\n")


def in_memory_setup(kind: str, data: Path, repeats: int, cache_dir: Path | None = None) -> dict[str, Any]:
    """Seconds of one rank's ``ChatDataModule.setup`` of ``kind`` rows (best of ``repeats``; the tiny
    model's tokenizer, ``data=rolemrc_rl``'s lengths), and the rows kept. ``cache_dir``: with the
    data store there (``data.cache=true``: prompt rows' token ids from the prompt store), else
    ``data.cache=false``."""
    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.memory import compose_train_config
    from rolemrc.parts import build_chat

    key = "prompts" if kind == "prompts" else "unpaired"
    objective = "grpo" if kind == "prompts" else "kto"
    cache = [f"data.cache_dir={cache_dir}"] if cache_dir is not None else ["data.cache=false"]
    cfg = compose_train_config([f"objective={objective}", f"data.{key}=[{{path: {data}}}]", "data.val_fraction=0",
                                "data.max_length=4200", "data.max_prompt_length=2250", "data.num_proc=1", *cache])
    chat = build_chat(cfg.model)
    times = []
    for _ in range(repeats):
        dm = ChatDataModule(cfg.data, kind, chat)
        start = time.perf_counter()
        dm.setup("fit")
        times.append(time.perf_counter() - start)
    return {"seconds": round(min(times), 2), "all_seconds": [round(t, 2) for t in times], "rows": len(dm.train_rows),
            "load_after": load_average()}


STAGES = ("prompts-memory", "prompts-store", "unpaired", "unpaired-store")


def run_in_memory(sizes: list[int], work: Path, repeats: int, out: Path, stages: list[str]) -> None:
    """``--in-memory``: :func:`in_memory_setup` at each size of prompt rows encoded in memory
    (``data.cache=false``), of prompt rows with the prompt store (its first start builds it: one
    setup; the second reads it back: best of ``repeats``), and of unpaired rows (in memory, and
    with their store as prompt rows')."""
    results: dict[str, Any] = {"what": "ChatDataModule.setup, one rank, seconds", "repeats": repeats, "sizes": {}}
    if out.exists():  # a run of some stages completes the rows of another
        results["sizes"] = json.loads(out.read_text()).get("sizes", {})
    for n in sizes:
        sft = work / f"sft-{n}.jsonl"
        make_records(n, sft)
        unpaired = work / f"unpaired-{n}.jsonl"
        make_unpaired(sft, unpaired)
        print(f"\n{n} records ({sft.stat().st_size / 1e6:.0f} MB), load average {load_average()}", flush=True)
        row = results["sizes"].setdefault(str(n), {})
        runs = []
        if "prompts-memory" in stages:
            runs.append(("prompts", "prompts", sft, repeats, None))
        if "prompts-store" in stages:
            store = work / f"store-{n}"
            shutil.rmtree(store, ignore_errors=True)
            runs += [("prompts_store_first", "prompts", sft, 1, store),
                     ("prompts_store_second", "prompts", sft, repeats, store)]
        if "unpaired" in stages:
            runs.append(("unpaired", "unpaired", unpaired, repeats, None))
        if "unpaired-store" in stages:
            store = work / f"unpaired-store-{n}"
            shutil.rmtree(store, ignore_errors=True)
            runs += [("unpaired_store_first", "unpaired", unpaired, 1, store),
                     ("unpaired_store_second", "unpaired", unpaired, repeats, store)]
        for name, kind, path, times, store in runs:
            row[name] = in_memory_setup(kind, path, times, store)
            print(f"  {name}: {row[name]['seconds']} s for {row[name]['rows']} rows ({row[name]['all_seconds']}; "
                  f"load average {row[name]['load_after']} after)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwritten to {out}")


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def report(label: str, result: dict[str, Any]) -> None:
    """One start's line: seconds to the first step and peak RSS."""
    cpu = f", {result['cpu_to_first_step_s']} CPU s to it" if "cpu_to_first_step_s" in result else ""
    print(f"  {label}: {result['first_step_s']} s to first step, {result['peak_rss_mib']} MiB peak{cpu} "
          f"(load average {result['load_before']} before, {result['load_after']} after)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[12000, 48000])
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--skip", nargs="*", default=[], choices=["store", "nocache", "trl", "ddp"])
    p.add_argument("--merge", action="store_true",
                   help="add this run's rows to those already in --out (a subset run completes a table)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_scale.json")
    p.add_argument("--in-memory", action="store_true",
                   help="time the in-memory setup of prompt (GRPO) and unpaired (KTO) rows instead")
    p.add_argument("--repeats", type=int, default=2, help="with --in-memory: setups per kind (the best is kept)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES,
                   help="with --in-memory: which setups to time (default: all)")
    p.add_argument("--trl-child", nargs=3, metavar=("DATA", "OUT", "NUM_PROC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        trl_child(Path(args.trl_child[0]), Path(args.trl_child[1]), int(args.trl_child[2]))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from rolemrc.data.store import default_num_proc

    num_proc = default_num_proc()
    work = args.work or Path(tempfile.mkdtemp(prefix="rolemrc-data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.in_memory:
        out = args.out if args.out != p.get_default("out") else ROOT / "benchmarks" / "results" / "in_memory_rows.json"
        try:
            run_in_memory(args.sizes, work, args.repeats, out, args.stages)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        return
    results: dict[str, Any] = {"num_proc": num_proc, "cpus": os.cpu_count(), "sizes": {}}
    try:
        for n in args.sizes:
            data = work / f"sft-{n}.jsonl"
            make_records(n, data)
            mb = data.stat().st_size / 1e6
            row: dict[str, Any] = {"mb": round(mb, 1)}
            print(f"\n{n} records ({mb:.0f} MB), load average {load_average()}", flush=True)
            cache_dir = work / f"store-{n}"
            shutil.rmtree(cache_dir, ignore_errors=True)
            for tag in ("first", "second") if "store" not in args.skip else ():
                row[f"rolemrc_{tag}"] = run_rolemrc(data, work, f"{n}-cache-{tag}", True, cache_dir)
                report(f"rolemrc (store) {tag}", row[f"rolemrc_{tag}"])
            if "nocache" not in args.skip:
                row["nocache_first"] = run_rolemrc(data, work, f"{n}-nocache", False, cache_dir)
                report("rolemrc data.cache=false", row["nocache_first"])
            if "trl" not in args.skip:
                hf_cache = work / f"hf-{n}"
                shutil.rmtree(hf_cache, ignore_errors=True)
                for tag in ("first", "second"):
                    row[f"trl_{tag}"] = run_trl(data, work, f"{n}-{tag}", hf_cache, num_proc)
                    report(f"trl {tag}", row[f"trl_{tag}"])
            if "ddp" not in args.skip and n == args.sizes[0]:
                one = run_rolemrc(data, work, f"{n}-one-touch", True, cache_dir, touch=True)
                two = run_rolemrc(data, work, f"{n}-ddp-touch", True, cache_dir, touch=True,
                                  extra=["trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp"])
                row["ddp"] = {"one_rank_store_rss_mib": round(one["ranks"][0]["store_rss_kib"] / 1024, 1),
                              "ranks_store_rss_mib": [round(r["store_rss_kib"] / 1024, 1) for r in two["ranks"]],
                              "ranks_store_pss_mib": [round(r["store_pss_kib"] / 1024, 1) for r in two["ranks"]],
                              "ranks_peak_rss_mib": [round(r["vm_hwm_kib"] / 1024) for r in two["ranks"]],
                              "one_rank_peak_rss_mib": round(one["ranks"][0]["vm_hwm_kib"] / 1024)}
                d = row["ddp"]
                d["together_over_one"] = round(sum(d["ranks_store_pss_mib"]) / max(d["one_rank_store_rss_mib"], 1e-9), 3)
                print(f"  ddp 2 ranks: store maps {d['ranks_store_rss_mib']} MiB RSS each, PSS sum "
                      f"{sum(d['ranks_store_pss_mib']):.1f} MiB vs one rank's {d['one_rank_store_rss_mib']} MiB "
                      f"({d['together_over_one']}x)", flush=True)
            row["load_average_after"] = load_average()
            results["sizes"][str(n)] = row
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.merge and args.out.exists():  # this run's rows win; the others are kept as they were
        old = json.loads(args.out.read_text())
        for size, old_row in old.get("sizes", {}).items():
            row = results["sizes"].setdefault(size, {})
            row.update({k: v for k, v in old_row.items() if k not in row})
        results["sizes"] = dict(sorted(results["sizes"].items(), key=lambda kv: int(kv[0])))
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwritten to {args.out}")


def print_table(results: dict[str, Any]) -> None:
    sizes = list(results["sizes"])
    print(f"\nstart to first step (s) / peak RSS (MiB); train.py, max_length 4096, tiny tokenizer, "
          f"{results['num_proc']} encoder process(es)")
    head = "| contender | " + " | ".join(f"{n} first | {n} second" for n in sizes) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(sizes)))
    for label, first, second in (("rolemrc (store)", "rolemrc_first", "rolemrc_second"),
                                 ("rolemrc data.cache=false", "nocache_first", None),
                                 ("TRL 1.16 SFTTrainer", "trl_first", "trl_second")):
        cells = []
        for n in sizes:
            row = results["sizes"][n]
            for key in (first, second):
                if key is None and first in row:
                    cells.append("same work as first")
                elif key in row:
                    load = f" (load {row[key]['load_before'].split()[0]})" if "load_before" in row[key] else ""
                    cells.append(f"{row[key]['first_step_s']} s / {row[key]['peak_rss_mib']} MiB{load}")
                else:
                    cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if len(sizes) >= 2:
        a, b = results["sizes"][sizes[0]], results["sizes"][sizes[-1]]
        for key in ("rolemrc_first", "rolemrc_second"):
            if key not in a or key not in b:
                continue
            growth = b[key]["peak_rss_mib"] / a[key]["peak_rss_mib"] - 1
            print(f"peak RSS growth {sizes[0]} -> {sizes[-1]} records, {key}: {growth:+.1%}")
    for n in sizes:
        if "ddp" in results["sizes"][n]:
            d = results["sizes"][n]["ddp"]
            print(f"2-rank DDP ({n}): store maps, both ranks' PSS together / one rank's RSS = {d['together_over_one']}x; "
                  f"peak RSS per rank {d['ranks_peak_rss_mib']} MiB (one rank alone {d['one_rank_peak_rss_mib']} MiB)")


if __name__ == "__main__":
    main()
