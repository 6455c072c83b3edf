"""The memory estimate knows the target models and warns when a run cannot fit."""

import logging

from rolemrc.memory import KNOWN, Arch, arch_of, check
from tests.conftest import compose_train


def test_parameter_counts_match_the_published_sizes() -> None:
    llama = arch_of(compose_train(["model=llama"]).model)
    qwen = arch_of(compose_train(["model=qwen"]).model)
    assert isinstance(llama, Arch) and abs(llama.params / 1e9 - 8.03) < 0.01  # Llama-3.1-8B: 8.03B
    assert isinstance(qwen, Arch) and abs(qwen.params / 1e9 - 7.62) < 0.01  # Qwen2.5-7B: 7.62B
    assert set(KNOWN) == {"meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"}


def test_paper_recipe_fits_and_no_checkpointing_warns(caplog) -> None:
    ok = check(compose_train(["experiment=rolemrc_llama_sft"]))
    assert not ok.startswith("WARNING") and "4 device(s)" in ok
    with caplog.at_level(logging.WARNING, logger="rolemrc.memory"):
        bad = check(compose_train(["experiment=rolemrc_llama_sft", "model.gradient_checkpointing=false",
                                   "strategy.activation_checkpointing=false"]))
    assert bad.startswith("WARNING") and "exceeds 80 GB" in caplog.text
    more_gpus = check(compose_train(["experiment=rolemrc_llama_sft", "trainer.devices=8"]))
    assert float(more_gpus.split("~")[1].split()[0]) < float(ok.split("~")[1].split()[0])
