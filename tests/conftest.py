"""Shared fixtures: compose the real Hydra configs (shrunk for CPU) and run them in-process."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from rolemrc.config import register

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (make test: one worker per core) each worker, and every process its tests
# start, gets its share of the cores. Torch's default, one thread per core in every worker,
# oversubscribes them: tests/train/test_dpo.py took 155 s on 2 workers here instead of 43 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Data stores (rolemrc.data.store) built by tests, and by the train.py processes they start, go to a
# folder of this session, never the user's cache.
os.environ["ROLEMRC_CACHE_DIR"] = tempfile.mkdtemp(prefix="rolemrc-test-cache-")
atexit.register(shutil.rmtree, os.environ["ROLEMRC_CACHE_DIR"], True)
register()


@pytest.fixture(autouse=True)
def _children_start_their_own_wandb_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes a test starts (train.py, evaluate.py) get their own W&B service, as from a shell.

    A test that used W&B in this process leaves ``WANDB_SERVICE`` in ``os.environ``; children
    inheriting it attach to this process's service, and one that is SIGKILLed there leaves its
    run id registered, so its resume fails with "run ID ... is in use" (seen when
    test_characterllm ran before test_resume_folder)."""
    monkeypatch.delenv("WANDB_SERVICE", raising=False)


@pytest.fixture(autouse=True)
def _torch_determinism_as_it_was() -> Iterator[None]:
    """A run made in this process with ``trainer.deterministic=true`` leaves Lightning's global
    settings (torch's deterministic algorithms, CUBLAS_WORKSPACE_CONFIG) set: restored after
    each test, so no later test runs under them unasked."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


def compose_train(overrides: list[str] | None = None, run_dir: Path | None = None) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py`` would."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides or []), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} interpolations
    # Compose mode has no hydra.runtime.output_dir: give every test config its own folder.
    with open_dict(cfg):
        cfg.run_dir = str(run_dir) if run_dir is not None else "/tmp/rolemrc-compose-only"
    return cfg


# Fast CPU settings for in-process training runs.
FAST = ["trainer.enable_progress_bar=false", "callbacks=none", "logger=csv"]


@pytest.fixture
def train_cfg(tmp_path: Path):
    def make(*overrides: str) -> DictConfig:
        return compose_train([*FAST, *overrides], run_dir=tmp_path / "run")

    return make


# ---------------------------------------------------------------- the fake OpenAI-compatible server

TEST_API_KEY_ENV = "ROLEMRC_TEST_API_KEY"
TEST_API_KEY = "sk-test-secret-do-not-log-1234"


@pytest.fixture
def api_key_env(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(environment variable name, secret) of the API key the fake server expects."""
    monkeypatch.setenv(TEST_API_KEY_ENV, TEST_API_KEY)
    return TEST_API_KEY_ENV, TEST_API_KEY


@pytest.fixture
def fake_openai(api_key_env: tuple[str, str]):
    """A started :class:`tests.fake_openai.FakeOpenAI` on 127.0.0.1 checking the test key; good
    answers are ``"ok"`` unless a test sets ``_answer`` / scripts faults."""
    from tests.fake_openai import FakeOpenAI

    with FakeOpenAI(api_key=api_key_env[1]) as server:
        yield server


# ---------------------------------------------------------------- parallel runs (pytest-xdist)

# `make test` runs the suite on several workers (`-n`, `--dist loadgroup`). Tests that share
# something outside their tmp_path run on one worker, one after another: the SLURM cluster.
SHARED_OUTSIDE_TMP = {"slurm": ("tests/slurm/",)}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for group, prefixes in SHARED_OUTSIDE_TMP.items():
            if item.nodeid.startswith(prefixes):
                item.add_marker(pytest.mark.xdist_group(group))
