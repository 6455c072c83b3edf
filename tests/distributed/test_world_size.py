"""``world_size(cfg.trainer)``: how many processes share the data (FSDP2's data-parallel size),
from ``trainer.devices`` (an int, a list of device ids, "auto", -1 / "-1", a digit string) times
``trainer.num_nodes``; strings that are not a count are refused, naming the key."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from rolemrc.run.strategies import world_size


def trainer(devices, num_nodes: int = 1) -> SimpleNamespace:
    return SimpleNamespace(devices=devices, num_nodes=num_nodes)


@pytest.mark.parametrize("devices,num_nodes,expected", [
    (1, 1, 1), (2, 1, 2), (4, 3, 12), ("2", 1, 2), ("8", 2, 16), ([0], 1, 1), ([0, 2], 1, 2), ([1, 2, 3], 2, 6),
])
def test_counts_devices_times_nodes(devices, num_nodes: int, expected: int) -> None:
    assert world_size(trainer(devices, num_nodes)) == expected


def test_config_nodes_as_hydra_gives_them() -> None:
    """The typed config hands over OmegaConf containers: a ListConfig of ids counts its ids."""
    t = OmegaConf.create({"devices": [0, 1, 3], "num_nodes": 2})
    assert world_size(t) == 6
    assert world_size(OmegaConf.create({"devices": "auto", "num_nodes": 1})) >= 1


@pytest.mark.parametrize("gpus,expected", [(0, 1), (1, 1), (4, 4)])
@pytest.mark.parametrize("devices", ["auto", "-1", -1])
def test_auto_and_minus_one_take_every_visible_gpu_or_one(monkeypatch, devices, gpus: int, expected: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert world_size(trainer(devices)) == expected
    assert world_size(trainer(devices, num_nodes=2)) == 2 * expected


@pytest.mark.parametrize("bad", ["two", "", "1.5", "gpu", "all"])
def test_bad_strings_are_refused_naming_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match=r"trainer\.devices=.*give a number of devices"):
        world_size(trainer(bad))


@pytest.mark.parametrize("devices,num_nodes", [(1, 1), (2, 1), ("2", 1), (3, 2)])
def test_agrees_with_lightnings_own_count_on_cpu(devices, num_nodes: int) -> None:
    """Lightning's Trainer, built (not run) with the same devices and nodes, counts the same world."""
    t = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert world_size(trainer(devices, num_nodes)) == t.world_size
