"""docs/configuration.md, the configuration reference, cannot drift from the schemas nor from the
defaults conf/ composes: it is what scripts/gen_config_reference.py writes now, and it tables every
field of every schema dataclass the config modules define (found here by scanning the modules, not
by the script's own walk)."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import rolemrc.config
import rolemrc.config_suites
import rolemrc.synth.config
import rolemrc.synth.roleplay_config

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
SCRIPT = ROOT / "scripts" / "gen_config_reference.py"
SCHEMA_MODULES = (rolemrc.config, rolemrc.config_suites, rolemrc.synth.config, rolemrc.synth.roleplay_config)
# Dataclasses of those modules that are no config node: the objective registry's entry, and the
# base whose keys each objective's own table lists.
NOT_NODES = {rolemrc.config.Objective, rolemrc.config.ObjectiveConfig,
             rolemrc.config.TrainStep, rolemrc.config.TrainParts,
             rolemrc.config.Replier, rolemrc.config.Judging}  # the typed parts of a composed config, not nodes


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _tables(page: str) -> dict[str, list[str]]:
    """Schema (module.Class) -> the keys of its table, in order."""
    tables: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in page.splitlines():
        m = re.match(r"Schema `([\w.]+)`", line)
        if m:
            current = tables.setdefault(m.group(1), [])
            continue
        m = re.match(r"\| `([^`]+)` \|", line)
        if m and current is not None:
            current.append(m.group(1))
    return tables


def test_configuration_page_is_up_to_date() -> None:
    assert PAGE.read_text(encoding="utf-8") == _generator().render(), (
        "docs/configuration.md is out of date: run python scripts/gen_config_reference.py")


def test_every_field_of_every_schema_is_tabled_with_its_default() -> None:
    tables = _tables(PAGE.read_text(encoding="utf-8"))
    schemas = [cls for module in SCHEMA_MODULES for _, cls in inspect.getmembers(module, inspect.isclass)
               if dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__ and cls not in NOT_NODES]
    assert len(schemas) > 30
    for cls in schemas:
        name = f"{cls.__module__}.{cls.__qualname__}"
        assert name in tables, f"{name} has no table in docs/configuration.md"
        assert [k.rsplit(".", 1)[-1] for k in tables[name]] == [f.name for f in dataclasses.fields(cls)], name
    page = PAGE.read_text(encoding="utf-8")
    # spot checks of the values written beside the keys
    assert "| `objective.beta` | `float` | `0.1` |" in page
    assert "| `data.sft[].weight` | `float` | `1.0` |" in page
    assert re.search(r"\| `model\.peft\.target_modules` \| `list\[str\]` \| `\[q_proj, v_proj\]` \|", page)
    assert "| `data.name` | `str` | `sample` |" in page  # required by the schema, set by data=sample
    assert "| `optim.lr` | `float` | `0.002`; schema: `0.001` |" in page  # conf/train.yaml's value first


def test_check_flag_fails_on_a_stale_page(tmp_path: Path, monkeypatch) -> None:
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(PAGE.read_text(encoding="utf-8").replace("objective.beta", "objective.betta"), encoding="utf-8")
    monkeypatch.setattr(gen, "OUT", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and stale.read_text(encoding="utf-8") == gen.render()
    assert gen.main(["--check"]) == 0



def test_identifiers_in_descriptions_are_code_not_emphasis() -> None:
    """A description's `_target_` or `**kwargs` outside a code span renders as emphasis (an italic
    "target"): the generator sets identifiers as code, with the path they are part of."""
    cell = _generator().cell
    assert cell("{_target_: dotted.path, **kwargs}") == "{`_target_`: dotted.path, `**kwargs`}"
    assert cell("None: <out_dir>/judge_cache; TRL's simpo_gamma") == "None: `<out_dir>/judge_cache`; TRL's `simpo_gamma`"
    assert cell("name -> {x} | y, `a_b` as is") == "name -&gt; {x} \\| y, `a_b` as is"
    prose = re.sub(r"(`+)[^`]*?\1", "", PAGE.read_text(encoding="utf-8"))
    assert not re.findall(r"(?<![\w*])(?:_\w+_|\*\*?\w)", prose.replace("*required*", ""))
