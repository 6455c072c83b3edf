"""Fixtures for the synthesis tests.

``assembled_dir`` (session scope) is the assembled output (sft.jsonl, pairs.jsonl, test.jsonl) of
one small end-to-end run against the loopback server in ``helpers.py``; other tests (e.g.
"train.py reads it") can take it as a fixture from here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.synth.helpers import (
    API_KEY,
    API_KEY_ENV,
    SynthServer,
    run_pipeline,
    small_overrides,
    write_inputs,
)


@pytest.fixture(scope="session", autouse=True)
def _api_key_env() -> Iterator[None]:
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = API_KEY
    yield
    if old is None:
        os.environ.pop(API_KEY_ENV, None)
    else:
        os.environ[API_KEY_ENV] = old


@pytest.fixture(scope="session")
def synth_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_inputs(tmp_path_factory.mktemp("synth_inputs"))


@dataclass
class SynthRun:
    out_dir: Path
    stats: dict[str, Any]
    server: SynthServer
    overrides: list[str]


@pytest.fixture(scope="session")
def synth_run(tmp_path_factory: pytest.TempPathFactory, synth_inputs: dict[str, Path], _api_key_env: None) -> Iterator[SynthRun]:
    """One small end-to-end run against the loopback server (server kept up for reruns)."""
    out = tmp_path_factory.mktemp("synth_run") / "out"
    with SynthServer() as server:
        ov = small_overrides(server.base_url, out, synth_inputs)
        stats = run_pipeline(ov)
        yield SynthRun(out, stats, server, ov)


@pytest.fixture(scope="session")
def assembled_dir(synth_run: SynthRun) -> Path:
    """Folder with sft.jsonl, pairs.jsonl, test.jsonl from a small synthesis run."""
    return synth_run.out_dir / "assemble"


@pytest.fixture()
def fake_server() -> Iterator[SynthServer]:
    with SynthServer() as server:
        yield server
