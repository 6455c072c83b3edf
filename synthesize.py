"""Build RoleMRC-style role-playing data with any OpenAI-compatible generator.

    python synthesize.py dry_run=true                       # count requests and tokens, send nothing
    OPENAI_API_KEY=... python synthesize.py out_dir=outputs/synth
    python synthesize.py synth/generator=vllm generator.model=<served name> synth/embedder=sfr_mistral
    python synthesize.py personas.source=file personas.path=my_personas.txt personas.n=200 \\
        dialogues.quotas.free_chat=100 synth/mix=rolemrc_mix

Stages (personas, profiles, match, dialogues, assemble) resume after a crash; every request is
cached on disk, so a rerun costs nothing. Output: <out_dir>/assemble/{sft,pairs,test}.jsonl.
"""

import sys

try:  # outside the project's environment: one line saying which, not a traceback
    import hydra
    from omegaconf import DictConfig

    from rolemrc.entry import entry_point
    from rolemrc.synth.config import (
        load_config,  # also registers the config schema with Hydra
    )
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None


@hydra.main(version_base="1.3", config_path="conf", config_name="synthesize")
def main(cfg: DictConfig) -> None:
    from rolemrc.synth.pipeline import run

    with entry_point(cfg):  # unknown keys, bad input: one "error: ..." line, exit 1; Lightning logs printed once
        run(load_config(cfg), command=sys.argv)  # argv: the commands it prints repeat what was typed


if __name__ == "__main__":
    main()
