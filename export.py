"""Export any checkpoint of a run (single file or sharded FSDP folder) to HF format.

    python export.py outputs/train/<run>/checkpoints/last.ckpt            # -> <run>/export
    python export.py outputs/train/<run>/hpc_ckpt_1.ckpt                  # SLURM preemption checkpoint
    python export.py <checkpoint> --out <dir> [--adapter]                  # LoRA: adapter only

Reads the run's resolved config (``<run>/.hydra/config.yaml``) to rebuild the model; writes
into ``<out>.partial`` and renames at the end, so an interrupted export can simply be rerun.
"""

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from rolemrc.config import register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: <run>/export")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: the checkpoint's run folder")
    parser.add_argument("--adapter", action="store_true", help="save a LoRA adapter instead of merging it")
    args = parser.parse_args()

    register()
    from rolemrc.checkpointing import checkpoint_run_dir
    from rolemrc.models.export import export_checkpoint

    try:
        run_dir = args.run_dir or checkpoint_run_dir(args.checkpoint)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        raise SystemExit(f"{config} not found: pass --run-dir <the run folder holding .hydra/config.yaml>")
    cfg = OmegaConf.load(config)

    out = export_checkpoint(cfg, args.checkpoint, args.out or run_dir / "export", merge_lora=False if args.adapter else None)
    print(f"exported model: {out}")


if __name__ == "__main__":
    main()
