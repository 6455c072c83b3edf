"""Export any checkpoint of a run (single file or sharded FSDP folder) to HF format.

    python export.py outputs/train/<run>/checkpoints/last.ckpt            # -> <run>/export
    python export.py outputs/train/<run>                                  # the same: the run's newest checkpoint
    python export.py outputs/train/<run>/hpc_ckpt_1.ckpt                  # SLURM preemption checkpoint
    python export.py <checkpoint> --out <dir> --adapter                    # LoRA: the adapter alone
    python export.py <checkpoint> --out <dir> --merge                      # LoRA: merged, whatever the run said

Reads the run's resolved config (``<run>/.hydra/config.yaml``) to rebuild the model; writes
into ``<out>.partial`` and renames at the end, so an interrupted export can simply be rerun.
A LoRA run exports as its ``model.peft.merge_on_export`` says unless ``--merge`` or
``--adapter`` is given; an adapter's ``adapter_config.json`` names its base model, so
``peft.AutoPeftModelForCausalLM.from_pretrained(<out>)`` loads it.
"""

import argparse
import sys
from pathlib import Path

try:  # outside the project's environment: one line saying which, not a traceback
    from omegaconf import OmegaConf

    from rolemrc.config import register
    from rolemrc.entry import entry_point
    from rolemrc.errors import InputNotFound
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint (.ckpt or DCP folder), or a run folder: its newest")
    parser.add_argument("--out", type=Path, default=None, help="default: <run>/export")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: the checkpoint's run folder")
    lora = parser.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true", help="LoRA: save the adapter alone (PEFT format)")
    lora.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base weights, even "
                                                          "if the run said model.peft.merge_on_export=false")
    args = parser.parse_args()

    register()
    from rolemrc.checkpointing import checkpoint_run_dir, find_checkpoint
    from rolemrc.models.export import export_checkpoint
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
    cfg, _ = resolve_model_sources(OmegaConf.load(config))  # the base the run started from, loadable

    merge = True if args.merge else False if args.adapter else None
    out = export_checkpoint(cfg, args.checkpoint, args.out or run_dir / "export", merge_lora=merge)
    print(f"exported model: {out}")


if __name__ == "__main__":
    with entry_point():  # bad input: one "error: ..." line, exit 1; known library noise filtered
        main()
