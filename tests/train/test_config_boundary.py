"""Config values cross into library calls as plain containers: a model skeleton rebuilt from a
saved HF config (nested ``rope_parameters``) loads, and export.py works on such a run."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from rolemrc.models.export import skeleton_config
from rolemrc.models.loading import load_model, load_tokenizer, plain
from rolemrc.run.train import run


def test_skeleton_from_a_saved_config_loads(train_cfg, tmp_path: Path) -> None:
    export = Path(run(train_cfg("trainer.max_steps=0", "data.val_fraction=0"))["export"])
    cfg = train_cfg(f"model.path={export}")
    skeleton = skeleton_config(cfg.model)
    assert OmegaConf.is_config(skeleton.init.rope_parameters)  # what used to reach AutoConfig.for_model
    model = load_model(skeleton, load_tokenizer(cfg.model))
    assert model.config.rope_parameters["rope_theta"] == 10000.0


def test_plain_turns_nodes_into_containers() -> None:
    node = OmegaConf.create({"a": {"b": [1, 2]}, "c": "${a.b}"})
    assert plain(node) == {"a": {"b": [1, 2]}, "c": [1, 2]} and type(plain(node)["a"]) is dict
    assert plain([1]) == [1] and plain(None) is None
