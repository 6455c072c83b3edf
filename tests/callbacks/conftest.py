"""Fixtures of the callback tests: the fake OpenAI-compatible judge server of the eval tests, and one
torch thread (the tiny model's generation and probe forwards are fastest so on a shared CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.eval.conftest import judge_key_env, judge_server, openai_server  # noqa: F401  (pytest fixtures)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
