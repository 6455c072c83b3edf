"""Write docs/configuration.md, the configuration reference, from the config schemas.

Every key, its type and its description come from the dataclasses of ``rolemrc.config``
(+ ``rolemrc.config_suites``, ``rolemrc.config_objectives``) and ``rolemrc.synth.config``: the types and the comments are read
from their source (a key whose field has no comment takes the one beside it in
``conf/<script>.yaml``). Its default is what the entry script composes with no overrides (Hydra's
compose on ``conf/``), followed by the schema's own where that differs. So the page cannot drift
from the code: ``make docs`` (``--check``) and ``tests/test_config_reference.py`` fail when the
committed page differs from what this script writes.

    python scripts/gen_config_reference.py            # write docs/configuration.md
    python scripts/gen_config_reference.py --check    # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's schemas, whatever is installed

from rolemrc import config as train_config  # noqa: E402
from rolemrc.registry import all_registries  # noqa: E402
from rolemrc.synth import config as synth_config  # noqa: E402

OUT = REPO / "docs" / "configuration.md"


@dataclass(frozen=True)
class Script:
    """One entry script and the schema its composed config is checked against."""

    name: str  # the entry script
    anchor: str  # prefix of the page's anchors
    schema: type
    conf: str  # its primary config file, conf/<conf>.yaml
    # Fields typed ``Any`` whose value is one of several schemas: key -> {option: schema}; the
    # option is a config group's (``objective=dpo``).
    choices: dict[str, dict[str, type]] = field(default_factory=dict)


SCRIPTS = (
    Script("train.py", "train", train_config.TrainConfig, "train",
           {"objective": dict(train_config.OBJECTIVE_SCHEMAS)}),
    Script("evaluate.py", "evaluate", train_config.EvaluateConfig, "evaluate"),
    Script("probe.py", "probe", train_config.ProbeConfig, "probe"),
    Script("synthesize.py", "synthesize", synth_config.SynthConfig, "synthesize"),
)
# Keys whose value names an entry of a registry (rolemrc.registry): the names listed beside them,
# and every registry in the page's last section.
NAMED_BY = {"objective.rewards": ("objective.rewards.<name>.type", "a reward's `type`"),
            "generation.backend": ("generation.backend", "registered"),
            "judge.backend": ("judge.backend", "registered")}


LONG = 60  # a composed value longer than this is not written out: `--cfg job` prints it


# ------------------------------------------------------------------ what a plain command composes

_UNSET = object()


@cache
def composed(conf: str, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """``conf/<conf>.yaml`` composed as its script composes it (no overrides but ``overrides``),
    unresolved: the values ``python <script>`` runs with."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    train_config.register()
    synth_config.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(conf, overrides=list(overrides))
    GlobalHydra.instance().clear()
    return OmegaConf.to_container(cfg, resolve=False)


def lookup(tree: Any, key: str) -> Any:
    """The value at a dotted key; ``_UNSET`` inside lists (``data.sft[].path``) or where absent."""
    if "[]" in key:
        return _UNSET
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _UNSET
        tree = tree[part]
    return tree


@cache
def yaml_comments(path: str, prefix: str = "") -> dict[str, str]:
    """Dotted key (under ``prefix``) -> the comment beside it (or in the comment lines just above
    it) in ``conf/<path>.yaml``: the descriptions of keys whose schema field has none."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = [(-1, prefix)] if prefix else []  # (indent, key) of the enclosing mappings
    above: list[str] = []
    for line in (REPO / "conf" / f"{path}.yaml").read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^( *)([A-Za-z_]\w*):(.*)$", line)
        if not m:
            above = []
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([k for _, k in stack] + [key])
        after = rest.split(" #", 1)[1].strip() if " #" in rest else ""
        # a longer block above a key is a section's header (examples, layout), not the key's description
        text = after or (" ".join(above) if len(above) <= 3 else "")
        if text:
            comments[dotted] = text
        above = []
        if not rest.split(" #", 1)[0].strip():  # a mapping opens here
            stack.append((indent, key))
    return comments


# ------------------------------------------------------------------ reading the source


@dataclass(frozen=True)
class FieldDoc:
    annotation: str  # as written in the source
    comment: str  # the comment lines just above the field, then the comment ending its line


@cache
def _module_docs(path: str) -> dict[str, dict[str, FieldDoc]]:
    """class name -> field name -> its annotation and comments, for every class in ``path``."""
    source = Path(path).read_text(encoding="utf-8")
    lines = source.splitlines()
    trailing: dict[int, str] = {}  # line -> the comment ending it, where code precedes it
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][: tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, dict[str, FieldDoc]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, FieldDoc] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            i = stmt.lineno - 2  # the line above, 0-based
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            after = [trailing[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in trailing]
            text = " ".join(part for part in (" ".join(above), " ".join(after)) if part)
            docs[stmt.target.id] = FieldDoc(ast.get_source_segment(source, stmt.annotation) or "", text)
        out[node.name] = docs
    return out


def field_docs(cls: type) -> dict[str, FieldDoc]:
    """The annotations and comments of ``cls``'s fields, its base classes' included."""
    docs: dict[str, FieldDoc] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_module_docs(inspect.getsourcefile(klass))[klass.__name__])
    return docs


def class_doc(cls: type) -> str:
    """The first paragraph of a schema's own docstring ("" when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses writes when there is none
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


# ------------------------------------------------------------------ walking the schemas


def nested_schema(tp: Any) -> tuple[type | None, bool]:
    """The dataclass a field holds (directly, in an Optional, or as list items) and whether it is
    a list of them."""
    if dataclasses.is_dataclass(tp):
        return tp, False
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    if origin is typing.Union:
        for arg in args:
            if arg is not type(None):
                return nested_schema(arg)
    return None, False


@dataclass
class Section:
    """One table: the keys of one schema under one dotted prefix."""

    key: str  # "" for the script's top level, "data.sft[]" for the items of a list
    schema: type
    title: str
    anchor: str
    also: list[str] = field(default_factory=list)  # other keys holding the same schema
    option: str | None = None  # the config group option a choice's table is for (objective=dpo)


def sections(script: Script, earlier: frozenset[type] = frozenset()) -> list[Section]:
    """Depth-first, in field order: the top level, then each nested schema once (a schema that
    several keys hold, as the data source lists do, gets one table naming them all). Schemas in
    ``earlier`` (tabled for an earlier script) are not tabled again, nor what they hold."""
    out: list[Section] = []
    seen: dict[type, Section] = {}

    def visit(key: str, schema: type, title: str, option: str | None = None) -> None:
        if schema in seen and key:
            seen[schema].also.append(key)
            return
        if schema in earlier:
            return
        anchor = (f"{script.anchor}-{key}".replace(".", "-").replace("[]", "").replace("_", "-")
                  if key else f"{script.anchor}-top")
        section = Section(key, schema, title, anchor, option=option)
        seen.setdefault(schema, section)
        out.append(section)
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            sub = f"{key}.{f.name}" if key else f.name
            if sub in script.choices:
                for name, choice in script.choices[sub].items():
                    visit(sub, choice, f"`{sub}` ({sub}={name})", f"{sub}={name}")
                continue
            nested, is_list = nested_schema(hints[f.name])
            if nested is not None:
                visit(sub + ("[]" if is_list else ""), nested, sub + ("[]" if is_list else ""), option)

    visit("", script.schema, "top-level keys")
    for s in out:  # a choice's sections share a key: tell their anchors apart by the option
        if s.key in script.choices:
            s.anchor += "-" + s.option.rsplit("=", 1)[1].replace("_", "-")
    return out


def schema_keys(script: Script) -> Iterator[str]:
    """Every dotted key of the script's schemas (list items as ``key[].field``), whether or not
    another script's table holds it: what the page must cover."""
    for s in sections(script):
        for key in [s.key, *s.also]:
            for f in dataclasses.fields(s.schema):
                yield f"{key}.{f.name}" if key else f.name


# ------------------------------------------------------------------ writing the page


def render_value(value: Any) -> str:
    """A default as it would be written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def schema_default(f: dataclasses.Field) -> Any:
    """The field's default in its dataclass; ``_UNSET`` when it has none (required)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return _UNSET
    return _UNSET if value == "???" else value  # omegaconf.MISSING: a group or the command line sets it


def default_of(f: dataclasses.Field, value: Any, command: str, nested: bool) -> str:
    """The default column: the value a plain command composes (``value``), and the schema's
    where it differs. A key holding a schema of its own points at its table."""
    schema = schema_default(f)
    if nested and (schema is _UNSET or dataclasses.is_dataclass(schema)):
        return "(table below)"

    def show(v: Any) -> str:
        if v is _UNSET or v == "???":
            return "required"
        text = render_value(v)
        return f"`{text}`" if len(text) <= LONG else f"(`python {command} --cfg job` prints it)"

    if value is _UNSET or schema is _UNSET and value == "???":
        return show(schema)
    if schema is _UNSET or value == schema or show(value) == show(schema):
        return show(value)
    return f"{show(value)}; schema: {show(schema)}"


# An identifier in prose (a comment): one holding ``_`` (``_target_``, ``simpo_gamma``,
# ``rolemrc.rewards.build_rewards``) or starred (``**kwargs``). Markdown would read its underscores
# or stars as emphasis (``_target_`` renders as an italic "target"), so it is set as code, with the
# path or setting it is part of (``<run_dir>/ref_cache``, ``$ROLEMRC_CACHE_DIR/data``).
IDENTIFIER = re.compile(r"\$\{[^}\s]*_[^}\s]*\}[\w./]*"
                        r"|(?<![\w`.*/<>$~=-])(?:\*{1,2}[A-Za-z_]\w*|[\w.$~<>/=-]*_[\w.$~<>/=-]*)(?<![./=-])")


def cell(text: str) -> str:
    """Table-cell text: identifiers outside code spans set as code, ``<`` ``>`` outside code spans
    escaped (``<name>`` is no HTML tag), pipes escaped."""
    text = "".join(p if p.startswith("`") else IDENTIFIER.sub(lambda m: f"`{m.group(0)}`", p)
                   for p in re.split(r"(`+[^`]*`+)", text.replace("\n", " ")))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;")
                   for p in re.split(r"(`+[^`]*`+)", text)).replace("|", "\\|")


def render_section(script: Script, s: Section, by_schema: dict[type, tuple[str, str]]) -> list[str]:
    tree = composed(script.conf, (s.option,) if s.option else ())
    heading = s.title if s.title.startswith("`") or not s.key else f"`{s.title}`"
    if s.also:
        heading += " and " + ", ".join(f"`{k}`" for k in s.also)
    lines = [f"### {heading} {{#{s.anchor}}}", ""]
    doc = class_doc(s.schema)
    lines += [f"Schema `{s.schema.__module__}.{s.schema.__qualname__}`." + (f" {doc}" if doc else ""), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    docs = field_docs(s.schema)
    hints = typing.get_type_hints(s.schema)
    for f in dataclasses.fields(s.schema):
        key = f"{s.key}.{f.name}" if s.key else f.name
        d = docs.get(f.name, FieldDoc("", ""))
        text = d.comment or yaml_comments(script.conf).get(key, "")
        if not text and s.option:  # objective=dpo: conf/objective/dpo.yaml
            group, option = s.option.split("=")
            text = yaml_comments(f"{group}/{option}", group).get(key, "")
        if text and not text.endswith(".") and (key in script.choices or nested_schema(hints[f.name])[0]):
            text += "."
        if key in script.choices:
            text = (text + " " if text else "") + "Options: " + ", ".join(
                f"[`{o}`](#{by_schema[c][0]})" for o, c in script.choices[key].items())
        else:
            nested, _ = nested_schema(hints[f.name])
            if nested is not None and nested in by_schema:
                target, where = by_schema[nested]
                link = "below" if where == script.name else f"as for {where}"
                text = (text + " " if text else "") + f"Keys: [{link}](#{target})."
        if key in NAMED_BY:
            reg_key, what = NAMED_BY[key]
            text = (text.rstrip(".") + ". " if text else "") + f"{what[0].upper()}{what[1:]}: " + ", ".join(
                f"`{n}`" for n in all_registries()[reg_key]) + " ([extension points](#extension-points))."
        default = ("(tables below)" if key in script.choices else
                   default_of(f, lookup(tree, key), script.name, nested_schema(hints[f.name])[0] is not None))
        lines.append(f"| `{key}` | `{cell(d.annotation)}` | {cell(default)} | {cell(text)} |")
    return lines + [""]


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_reference.py from the config schemas: do not edit by hand. -->",
        "",
        "Every key each entry script accepts, generated from the schema dataclasses in",
        "`src/rolemrc/config.py`, `config_suites.py`, `config_objectives.py` and `src/rolemrc/synth/` (`make docs`",
        "regenerates this page; a test fails when it is out of date). A key not listed here is refused when",
        "the config is composed, before anything loads. Set any key on the command line",
        "(`python train.py optim.lr=2e-5`) or in a config file; list-valued keys take Hydra's list syntax",
        "(`'data.sft=[{path: a.jsonl}]'`).",
        "",
        "A default is the value the script runs with when given no overrides: its `conf/<script>.yaml` with",
        "its default groups (`model=tiny`, `objective=sft`, `data=sample`, ...; `objective=dpo` for the DPO",
        "table); where the schema's own default differs, it follows (\"schema: ...\"). Other groups",
        "(`model=llama`) and the experiments (`experiment=rolemrc_llama_sft`) set their own values, and",
        "*required* keys are set by a group or on the command line: `python train.py --cfg job` (any entry",
        "script) prints the config a command runs with. Descriptions are the schema fields' comments, else",
        "the comment beside the key in `conf/<script>.yaml`.",
        "",
    ]
    by_schema: dict[type, tuple[str, str]] = {}  # schema -> (anchor of its table, script)
    for script in SCRIPTS:
        secs = sections(script, frozenset(by_schema))
        for s in secs:
            by_schema.setdefault(s.schema, (s.anchor, script.name))
        out += [f"## {script.name} {{#{script.anchor}}}", "",
                f"Composed from `conf/{script.conf}.yaml`; checked against `{script.schema.__module__}."
                f"{script.schema.__qualname__}`. Defaults: what `python {script.name}` runs with.", ""]
        for s in secs:
            out += render_section(script, s, by_schema)
    out += ["## Extension points {#extension-points}", "",
            "Each is a `rolemrc.registry.Registry`: one `register(name, factory, doc=...)` call adds an entry",
            "(docs/architecture.md, \"Adding things\"); a name no entry has is refused with the known names.", ""]
    for key, reg in sorted(all_registries().items()):
        out += [f"### `{key}`", "", reg.doc[:1].upper() + reg.doc[1:] + ":", "",
                *(f"- `{n}`: {reg.describe(n).rstrip('.')}" for n in reg), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.is_file() else ""
        if current != text:
            print(f"error: {_shown(OUT)} is out of date: run python scripts/gen_config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {_shown(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
