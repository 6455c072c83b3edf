"""Neuron probing: activation-frequency maps of two models on the test prompts, their discrepancy,
and the most-changed neurons as a restraint file for evaluate.py.

    python probe.py                                                  # tiny random model, sample data, CPU
    python probe.py model=llama model.path=<SFT export> compare.path=<DPO export> data=rolemrc_test \\
        names.a=SFT names.b=DPO site=mlp_out                         # paper §7 (Qwen: site=attn_out)
    python probe.py ... restraint.k=200 restraint.scope=per_layer 'restraint.layers=[12,31]'
    python evaluate.py model=llama model.path=<DPO export> data=rolemrc_test restraint=outputs/probe/<time>

Writes <out_dir>/{maps.npz, freq_a.png, freq_b.png, discrepancy.png, layer_change.png,
probe_summary.md, restraint.json}.
"""

import sys

try:  # outside the project's environment: one line saying which, not a traceback
    import hydra
    from omegaconf import DictConfig

    from rolemrc.config import register
    from rolemrc.entry import entry_point
except ModuleNotFoundError as err:
    if (err.name or "").startswith("rolemrc."):
        raise
    raise SystemExit(f"error: {err}: {sys.executable} is not the project's environment; run "
                     "`source .venv/bin/activate` first (`make setup` creates .venv)") from None

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="probe")
def main(cfg: DictConfig) -> None:
    from rolemrc.probing.run import run

    with entry_point(cfg):  # unknown keys, bad input: one "error: ..." line, exit 1; Lightning logs printed once
        run(cfg)


if __name__ == "__main__":
    main()
