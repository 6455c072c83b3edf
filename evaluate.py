"""Evaluate a model on RoleMRC: greedy generation, reference metrics, five-dimension LLM judge.

    python evaluate.py metrics.bertscore.model=minilm          # tiny random model, sample data, CPU, offline
    python evaluate.py model.path=outputs/train/<time>/export judge=hf limit=6 metrics.bertscore.model=minilm
    HF_HUB_OFFLINE=0 python evaluate.py model=llama model.path=<export> data=rolemrc_test generation.backend=vllm \\
        judge=openai judge.model=gpt-4-turbo metrics.bertscore.model=roberta-large   # paper setting
    python evaluate.py out_dir=outputs/evaluate/<time>         # resume an interrupted run
    (or rerun the same command: it continues the newest folder of the same config)
    python evaluate.py --cfg job                               # print the resolved config
    python evaluate.py model.path=<objective=reward export>    # a reward model: accuracy on held-out pairs
    python evaluate.py env=scripted data=sample_dialogues judge=hf   # dialogue mode: conversations, scores by turn

BERTScore's default is the paper's roberta-large, not shipped: HF_HUB_OFFLINE=0 downloads it once;
metrics.bertscore.model=minilm scores offline (not comparable with the paper's numbers).
Writes <out_dir>/{generations.jsonl, metrics.json, judge.jsonl, summary.md} and prints the
summary's path.
"""

import sys
from pathlib import Path

try:  # outside the project's environment: one line saying which, not a traceback
    import hydra
    from omegaconf import DictConfig

    from rolemrc.config import Replier, register
    from rolemrc.entry import entry_point
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rolemrc.eval.resume import no_empty_folder, resume_config
    from rolemrc.eval.run import run
    from rolemrc.rewards.evaluation import is_reward_model, run_reward_model

    # A run that fails before it has results leaves no folder behind (the error says what to fix).
    with no_empty_folder(Path(HydraConfig.get().runtime.output_dir), Path(str(cfg.get("out_dir")))):
        with entry_point(cfg):  # unknown keys, bad input: one "error: ..." line, exit 1; Lightning logs printed once
            cfg = resume_config(cfg)  # out_dir=<a run's folder>: its saved config; conflicting overrides refused
            if is_reward_model(cfg.model.path):  # objective=reward's export: its accuracy on held-out pairs
                run_reward_model(Replier.of(cfg), cfg.get("limit"))
            else:
                run(cfg)


if __name__ == "__main__":
    import sys

    from rolemrc.eval.resume import continue_eval_argv

    with entry_point():  # the same command again: continue its folder (README: Evaluation)
        sys.argv = continue_eval_argv(sys.argv, Path(__file__).parent / "conf", "evaluate")
    main()
