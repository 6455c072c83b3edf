"""Train with SFT or DPO.

    python train.py                                   # tiny model, sample data, CPU
    python train.py model=qwen objective=dpo model.path=<SFT export>
    python train.py experiment=rolemrc_llama_sft
    python train.py -m objective=dpo objective.beta=0.05,0.1,0.2 model.path=<SFT export>   # sweep
    python train.py --cfg job                         # print the resolved config
"""

import sys
from pathlib import Path

try:  # outside the project's environment: one line saying which, not a traceback
    import hydra
    from omegaconf import DictConfig

    from rolemrc.config import register
    from rolemrc.entry import entry_point, one_copy_of_lightning_logs
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict | None:
    from rolemrc.config import check_train_config
    from rolemrc.models.paths import check_model_paths

    # bad input: one "error: ..." line, exit 1 (one job of a sweep: recorded, the sweep goes on)
    with entry_point():
        check_train_config(cfg)  # before the slow imports: a key no run can satisfy is refused at once
        check_model_paths(cfg.model)  # and a model.path that names no model
        from rolemrc.run.train import run

        one_copy_of_lightning_logs()  # Lightning's log lines printed once (now that it is imported)
        return run(cfg)


if __name__ == "__main__":
    import sys

    from rolemrc.run.resume import continue_run_argv

    with entry_point():  # ckpt_path=last: continue the matching run in its folder (README: Training)
        sys.argv = continue_run_argv(sys.argv, Path(__file__).parent / "conf", "train")
    main()
