"""``probe.py`` end to end: two exported models -> maps, figures, summary, restraint.json that
load_restraint applies; and the config composes with every model and data group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from rolemrc.config_suites import SUITE_SCHEMAS
from rolemrc.models.export import export_pretrained
from rolemrc.probing.capture import decoder_layers
from rolemrc.probing.maps import load_maps
from rolemrc.probing.restraint import load_restraint
from rolemrc.probing.run import run
from tests.conftest import CONF, ROOT
from tests.probing.helpers import SMALL, tiny

LAYERS = 3


def compose_probe(overrides: list[str], out_dir: Path | None = None) -> DictConfig:
    """``conf/probe.yaml`` composed as ``python probe.py`` would (out_dir given: no Hydra run dir)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("probe", overrides=overrides)
    with open_dict(cfg):
        cfg.out_dir = str(out_dir or "/tmp/rolemrc-compose-only")
    return cfg


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> tuple[Path, Path]:
    """Model A and model B = A with the last layer's MLP changed (layers before it identical)."""
    root = tmp_path_factory.mktemp("exports")
    model, chat = tiny("llama", layers=LAYERS)
    a = export_pretrained(model, chat.tokenizer, root / "A")
    with torch.no_grad():
        down = decoder_layers(model)[LAYERS - 1].mlp.down_proj.weight
        down.add_(torch.randn_like(down) * down.std() * 3)
    b = export_pretrained(model, chat.tokenizer, root / "B")
    return a, b


def test_probe_writes_maps_figures_summary_and_a_restraint_that_loads(exports, tmp_path) -> None:
    a, b = exports
    out = tmp_path / "probe"
    cfg = compose_probe(["model=tiny", *SMALL, f"model.init.num_hidden_layers={LAYERS}", f"model.path={a}",
                         f"compare.path={b}", "limit=20", "batch_size=8", "names.a=SFT", "names.b=DPO",
                         "restraint.k=7"], out)
    written = run(cfg)
    for name in ("maps.npz", "freq_a.png", "freq_b.png", "discrepancy.png", "layer_change.png",
                 "probe_summary.md", "restraint.json"):
        assert (out / name).stat().st_size > 0, name
    assert written["restraint"] == str(out / "restraint.json")

    maps = load_maps(out / "maps.npz")
    assert maps["names"] == ["SFT", "DPO"] and maps["site"] == "mlp_out"
    assert sum(maps["n_cases"][g] for g in ("KB", "RS", "MT", "NI", "PI")) >= 20 == maps["n_cases"]["ALL"]
    assert maps["diff"]["ALL"].shape == (LAYERS, 32)
    assert not maps["diff"]["ALL"][: LAYERS - 1].any(), "only the changed layer differs"
    assert maps["layer_change"]["ALL"][LAYERS - 1] > 0

    summary = (out / "probe_summary.md").read_text()
    assert "## Layers that changed most" in summary and "DPO vs SFT" in summary
    assert f"| ALL | 20 | {LAYERS - 1} (" in summary  # the changed layer is listed first

    restraint = json.loads((out / "restraint.json").read_text())
    assert restraint["site"] == "mlp_out" and restraint["factor"] == pytest.approx(1 - 1e-6)
    assert len(restraint["neurons"]) == 7 and {layer for layer, _ in restraint["neurons"]} == {LAYERS - 1}
    assert restraint["selection"]["k"] == 7 and len(restraint["selection"]["changes"]) == 7

    model, _ = tiny("llama", layers=LAYERS)
    with load_restraint(out, model) as hooks:
        assert len(hooks._handles) == 1


def test_single_model_maps_only(tmp_path) -> None:
    cfg = compose_probe(["model=tiny_qwen", *SMALL, "model.init.num_hidden_layers=2", "limit=6",
                         "site=attn_out"], tmp_path)
    written = run(cfg)
    assert "restraint" not in written and not (tmp_path / "restraint.json").exists()
    maps = load_maps(tmp_path / "maps.npz")
    assert maps["site"] == "attn_out" and "diff" not in maps
    assert np.allclose(maps["freq_a"]["ALL"].sum(axis=1), round(0.2 * 32))  # k active neurons per case


MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_probe_config_composes(model: str, data: str) -> None:
    extra = ["data.dir=/x"] if data == "local" else []
    cfg = compose_probe([f"model={model}", f"data={data}", "compare.path=/b", *extra])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # evaluate.py's own suites (data.rolebench, data.characterllm, ...) have no test items
    suite = any(resolved["data"].get(k.split(".", 1)[1]) for k in SUITE_SCHEMAS if k.startswith("data."))
    assert resolved["model"]["name"] == model and (bool(resolved["data"]["test"]) or suite)
    assert resolved["restraint"]["factor"] == pytest.approx(1 - 1e-6) and resolved["top_fraction"] == 0.2


def test_typos_fail_at_compose_time() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_probe(["restraint.kk=3"])
    with pytest.raises(ConfigCompositionException):
        compose_probe(["top_fraction=lots"])


@pytest.mark.slow
def test_probe_py_runs(tmp_path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "probe.py", *SMALL, "limit=4", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "maps.npz").exists() and (tmp_path / "probe_summary.md").exists()


@pytest.mark.parametrize("override,message", [
    ("site=mlp", "site must be one of"),
    ("restraint.dimension=XX", "restraint.dimension must be one of"),
    ("restraint.select=all", "restraint.select must be one of"),
    ("top_fraction=1.5", "top_fraction must be in"),
    ("restraint.layers=[5,2]", r"restraint.layers must be \[first, last\]"),
])
def test_bad_settings_fail_before_loading_a_model(tmp_path, override: str, message: str) -> None:
    cfg = compose_probe(["model.path=/nonexistent/model", override], tmp_path)
    with pytest.raises(ValueError, match=message):
        run(cfg)
