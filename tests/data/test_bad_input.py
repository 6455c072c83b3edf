"""Bad data ends in one ``error: ...`` line naming the file (exit 1), or, with
``data.on_error=skip``, is dropped and counted; nothing crashes half-way through encoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.schemas import DataError
from rolemrc.data.templates import ChatFormat
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

# A template that, like several official ones, refuses a conversation opened by the assistant.
STRICT = (
    "{%- if messages[0]['role'] == 'assistant' -%}"
    "{{- raise_exception('Conversation must start with the user or the system') -}}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
GOOD = {"conversations": [{"role": "User", "content": "Who are you?"},
                          {"role": "Assistant", "content": "A lighthouse keeper, lad."}]}
OPENS = {"conversations": [{"role": "Assistant", "content": "Ahoy! Mind the fog."},
                           {"role": "User", "content": "Is it thick?"},
                           {"role": "Assistant", "content": "Thick as chowder."}]}


def train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def data_cfg(path: Path, on_error: str):
    return OmegaConf.create({"sft": [{"path": str(path)}], "sft_val": [], "val_fraction": 0.0, "on_error": on_error,
                             "max_length": 256, "max_prompt_length": 128, "packing": False, "batch_size": 2,
                             "num_workers": 0, "shuffle": False})


@pytest.fixture
def mixed_file(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, OPENS, GOOD)) + "\n")
    return path


def strict_chat(tmp_path: Path) -> ChatFormat:
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    return ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")), template=str(template))


def test_a_record_the_template_refuses_is_skipped_and_counted(tmp_path: Path, mixed_file: Path) -> None:
    dm = ChatDataModule(data_cfg(mixed_file, "skip"), "sft", strict_chat(tmp_path), report_dir=str(tmp_path / "run"))
    dm.setup()
    assert len(dm.train_rows) == 2
    report = json.loads((tmp_path / "run" / "data_report_sft.json").read_text())
    assert report["train"]["dropped_template_error"] == 1
    (problem,) = report["train"]["template_errors"]
    assert problem.startswith(f"{mixed_file}:2: ") and "Conversation must start with the user" in problem


def test_a_record_the_template_refuses_is_named_without_skip(tmp_path: Path, mixed_file: Path) -> None:
    dm = ChatDataModule(data_cfg(mixed_file, "raise"), "sft", strict_chat(tmp_path))
    with pytest.raises(DataError, match=rf"{mixed_file}:2: .*Conversation must start with the user"):
        dm.setup()


def test_the_shipped_templates_train_an_opening_assistant_turn(tmp_path: Path, mixed_file: Path) -> None:
    chat = ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-chatml")))
    dm = ChatDataModule(data_cfg(mixed_file, "raise"), "sft", chat, report_dir=str(tmp_path / "run"))
    dm.setup()
    assert len(dm.train_rows) == 3 and dm.report["train"]["dropped_template_error"] == 0


def test_train_py_names_an_empty_data_file(tmp_path: Path) -> None:
    empty = tmp_path / "sft.jsonl"
    empty.write_text("\n")
    done = train(f"data.sft=[{{path:{empty}}}]", "data.on_error=skip", f"hydra.run.dir={tmp_path / 'run'}",
                 "trainer.max_steps=1", "export.enabled=false", "logger=none", "callbacks=none")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"error: {empty}: empty data file (no records)"
    assert "Traceback" not in done.stderr


def test_train_py_names_records_the_template_refuses(tmp_path: Path, mixed_file: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    done = train(f"data.sft=[{{path:{mixed_file}}}]", f"model.chat_template={template}", "data.val_fraction=0",
                 f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=1", "export.enabled=false", "logger=none",
                 "callbacks=none")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "error: 1 sft record(s) the chat template cannot encode (set data.on_error=skip" in done.stderr
    assert f"{mixed_file}:2: " in done.stderr
