"""Export any checkpoint of a run (single file or sharded FSDP folder) to HF format.

    python export.py outputs/train/<run>/checkpoints/last.ckpt            # -> <run>/export
    python export.py outputs/train/<run>                                  # the same: the run's newest checkpoint
    python export.py outputs/train/<run>/hpc_ckpt_1.ckpt                  # SLURM preemption checkpoint
    python export.py <checkpoint> --adapter                               # LoRA: the adapter alone, <run>/export-adapter
    python export.py <checkpoint> --merge                                 # LoRA: merged, whatever the run said, <run>/export-merged
    python export.py <checkpoint> --out <dir> --overwrite                 # replace a previous export in <dir>

Reads the run's resolved config (``<run>/.hydra/config.yaml``) to rebuild the model; writes
into ``<out>.partial`` and renames at the end, so an interrupted export can simply be rerun.
``<out>`` must be new or empty, or hold a previous export and ``--overwrite`` be given; a folder
of other files, a run folder or a checkpoint is never replaced. A LoRA run exports as its
``model.peft.merge_on_export`` says unless ``--merge`` or ``--adapter`` is given; an adapter's
``adapter_config.json`` names its base model, so ``peft.AutoPeftModelForCausalLM.from_pretrained(<out>)``
loads it.
"""

import argparse
import sys
from pathlib import Path

try:  # outside the project's environment: one line saying which, not a traceback
    from omegaconf import OmegaConf

    from rolemrc.config import model_head, register
    from rolemrc.entry import entry_point
    from rolemrc.errors import ConfigError, InputNotFound
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint (.ckpt or DCP folder), or a run folder: its newest")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new or empty folder (default: <run>/export; with --adapter <run>/export-adapter, "
                             "with --merge <run>/export-merged)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a previous export at --out (never a folder of other files or a run)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: the checkpoint's run folder")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true", help="LoRA: save the adapter alone (PEFT format)")
    lora.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base weights, even "
                                                          "if the run said model.peft.merge_on_export=false")
    args = parser.parse_args()

    register()
    from rolemrc.checkpointing import checkpoint_run_dir, find_checkpoint
    from rolemrc.models.export import check_export_destination, export_checkpoint
    from rolemrc.models.source import resolve_model_sources

    if not args.checkpoint.exists():
        raise InputNotFound(f"checkpoint not found: {args.checkpoint}")
    if (args.checkpoint / ".hydra" / "config.yaml").is_file():  # a run folder: its newest checkpoint
        run_folder = args.checkpoint
        args.checkpoint = find_checkpoint(run_folder)
        if args.checkpoint is None:
            raise InputNotFound(f"{run_folder}: a run folder without a checkpoint (checkpoints/last.ckpt or hpc_ckpt_*)")
        args.run_dir = args.run_dir or run_folder
    run_dir = args.run_dir or checkpoint_run_dir(args.checkpoint)
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        raise InputNotFound(f"{config} not found: pass --run-dir <the run folder holding .hydra/config.yaml>")
    saved = OmegaConf.load(config)
    if args.adapter and not OmegaConf.select(saved, "model.peft.enabled", default=False):
        raise ConfigError(f"--adapter: {run_dir} is a full fine-tune (model.peft.enabled=false in its "
                          ".hydra/config.yaml): it has no LoRA adapter to save alone; export it without --adapter")
    default = "export-adapter" if args.adapter else "export-merged" if args.merge else \
        OmegaConf.select(saved, "export.dir", default="export")
    out = check_export_destination(args.out or run_dir / default, args.overwrite, keep=(args.checkpoint, run_dir))
    cfg, _ = resolve_model_sources(saved)  # the base the run started from, loadable
    merge = True if args.merge else False if args.adapter else None
    out = export_checkpoint(cfg.model, args.checkpoint, out, merge_lora=merge, head=model_head(cfg))
    print(f"exported model: {out}")


if __name__ == "__main__":
    with entry_point():  # bad input: one "error: ..." line, exit 1; known library noise filtered
        main()
