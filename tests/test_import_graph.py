"""The layering of issue 14 ("The shape to reach"), read from the source with ``ast``: every
``import`` under src/rolemrc, at module level or inside a function, is an arrow; arrows that
climb back are listed as ``a.b -> c.d (file:line)``. No import cycle among project modules,
counting what runs at import time (module level, class bodies; not function bodies, not
``if TYPE_CHECKING:``), including the package ``__init__`` that importing a submodule runs."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PROJECT = "rolemrc"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # the most specific module the statement names (project) or the top-level name
    file: str  # relative to the repository root
    line: int
    when: str  # "module": runs on import (module level, class body); "function": when called; "typing"
    implicit: bool = False  # the package __init__ that importing target's submodule runs first

    @property
    def runtime(self) -> bool:
        return self.when == "module"

    def __str__(self) -> str:
        how = ", package import" if self.implicit else ""
        return f"{self.source} -> {self.target} ({self.file}:{self.line}{how})"


def module_names(src: Path, project: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``project`` under ``src``."""
    out = {}
    for path in sorted((src / project).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> Iterable[tuple[ast.stmt, str]]:
    """Every import statement with when it runs: "module" at import time (module level or a
    class body), "function" when its function is called, "typing" never (``if TYPE_CHECKING:``)."""

    def walk(nodes: list[ast.stmt], when: str) -> Iterable[tuple[ast.stmt, str]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, when
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, "typing" if when == "typing" else "function")
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "typing")
                yield from walk(node.orelse, when)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    children = getattr(node, field, None) or []
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    for c in children:  # except handlers and match cases hold statements
                        if isinstance(c, (ast.ExceptHandler, ast.match_case)):
                            stmts.extend(c.body)
                    yield from walk(stmts, when)

    yield from walk(tree.body, "module")


def collect_edges(src: Path = SRC, project: str = PROJECT, root: Path = ROOT) -> list[Edge]:
    modules = module_names(src, project)
    edges: list[Edge] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        rel = str(path.relative_to(root))
        for node, when in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import sub`` names the submodule when there is one
                named = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in dict.fromkeys(named):
                if target == project or target.startswith(project + "."):
                    while target not in modules and "." in target:  # ``import a.b.attr``-style
                        target = target.rpartition(".")[0]
                else:
                    target = target.split(".")[0]
                edges.append(Edge(name, target, rel, node.lineno, when))
                if target.startswith(project + "."):
                    # importing a.b.c runs a/__init__ and a/b/__init__ first (already running
                    # when they are the importer's own packages)
                    parts = target.split(".")
                    for i in range(2, len(parts)):
                        parent = ".".join(parts[:i])
                        if parent in modules and not (name == parent or name.startswith(parent + ".")):
                            edges.append(Edge(name, parent, rel, node.lineno, when, implicit=True))
    return edges


EDGES = collect_edges()


def inside(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offending(sources: Iterable[str], forbidden: Iterable[str], allowed: Iterable[str] = (),
              edges: list[Edge] | None = None) -> list[Edge]:
    sources, forbidden, allowed = list(sources), list(forbidden), list(allowed)
    return sorted({e for e in (EDGES if edges is None else edges)
                   if not e.implicit and inside(e.source, sources) and inside(e.target, forbidden)
                   and not inside(e.target, allowed)},
                  key=lambda e: (e.source, e.target, e.line))


def find_cycles(edges: list[Edge], project: str = PROJECT, when: tuple[str, ...] = ("module",)) -> list[list[Edge]]:
    """One concrete cycle per strongly connected component of the project graph made of the
    imports that run ``when`` (by default: on import)."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.when in when and inside(e.target, [project]) and e.target != e.source:
            graph.setdefault(e.source, {}).setdefault(e.target, e)
            graph.setdefault(e.target, {})
    # Tarjan's strongly connected components (iterative)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    cycles = []
    for comp in components:  # shortest way from the component's first module back to itself
        members, first = set(comp), comp[0]
        previous: dict[str, Edge] = {}
        frontier, found = [first], None
        while frontier and found is None:
            nxt = []
            for node in frontier:
                for child, edge in sorted(graph[node].items()):
                    if child not in members:
                        continue
                    if child == first:
                        found = edge
                        break
                    if child not in previous:
                        previous[child] = edge
                        nxt.append(child)
                if found:
                    break
            frontier = nxt
        path = [found]
        while path[-1].source != first:
            path.append(previous[path[-1].source])
        cycles.append(path[::-1])
    return cycles


def describe(edges: list[Edge]) -> str:
    return "\n  ".join(str(e) for e in edges)


# ---- the rules -----------------------------------------------------------------------------
DATA_MODELS_FORBIDDEN = ["rolemrc.modules", "rolemrc.run", "rolemrc.eval", "rolemrc.probing",
                         "rolemrc.callbacks", "rolemrc.synth"]
RULES = {
    "objectives_are_pure": (["rolemrc.objectives"], ["rolemrc", "lightning", "pytorch_lightning", "lightning_fabric"],
                            ["rolemrc.objectives"]),
    "data_and_models_stay_below": (["rolemrc.data", "rolemrc.models"], DATA_MODELS_FORBIDDEN, []),
    "lightning_modules_do_not_reach_up": (["rolemrc.modules"], ["rolemrc.run", "rolemrc.checkpointing"], []),
    "consumers_do_not_import_training": (["rolemrc.eval", "rolemrc.probing", "rolemrc.synth", "rolemrc.callbacks"],
                                         ["rolemrc.run", "rolemrc.modules"], []),
}
# Rules the tree does not satisfy yet (none today; a new rule may start here): strict, so the
# test fails once the last edge is gone and the entry must be deleted.
NOT_YET: dict[str, str] = {
}


def rule_param(name: str):
    marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[name])] if name in NOT_YET else []
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("rule", [rule_param(n) for n in RULES])
def test_layering(rule: str) -> None:
    sources, forbidden, allowed = RULES[rule]
    bad = offending(sources, forbidden, allowed)
    assert not bad, f"{rule}: {len(bad)} import(s) climb back:\n  {describe(bad)}"


def show_cycles(cycles: list[list[Edge]]) -> str:
    return "\n".join(" -> ".join([c[0].source, *(e.target for e in c)]) + "\n  " + describe(c) for c in cycles)


def test_no_import_cycle() -> None:
    cycles = find_cycles(EDGES)
    assert not cycles, f"{len(cycles)} import cycle(s) among project modules:\n{show_cycles(cycles)}"


def test_no_import_cycle_through_function_level_imports() -> None:
    """A cycle closed by an import inside a function still ties two modules together (the
    synth assets <-> rules cycle of issue 14 was one); ``if TYPE_CHECKING:`` imports do not count."""
    cycles = find_cycles(EDGES, when=("module", "function"))
    assert not cycles, f"{len(cycles)} import cycle(s), counting function-level imports:\n{show_cycles(cycles)}"


def test_the_graph_sees_the_whole_package() -> None:
    """Guards the checker itself: it reads every module, function-level imports included."""
    sources = {e.source for e in EDGES}
    assert {"rolemrc.objectives.logprobs", "rolemrc.data.sampler", "rolemrc.run.strategies"} <= sources
    lazy = [e for e in EDGES if e.source == "rolemrc.memory" and e.target == "rolemrc.run.build"]
    assert lazy and not lazy[0].runtime  # the command line imports the training code inside a function


def test_checker_finds_lazy_relative_and_cyclic_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "demo"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from demo.low.a import thing\n")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\nimport lightning\n"
                                      "if TYPE_CHECKING:\n    from demo.high import Thing\n"
                                      "def f():\n    from ..high import g\n    return g\nthing = 1\n")
    (pkg / "high.py").write_text("from demo.low import a\ntry:\n    import demo.cyc\nexcept ImportError:\n    pass\n")
    (pkg / "cyc.py").write_text("from . import high\n")
    edges = collect_edges(tmp_path / "src", "demo", tmp_path)
    got = {(e.source, e.target, e.line, e.when, e.implicit) for e in edges}
    assert ("demo.low.a", "lightning", 2, "module", False) in got
    assert ("demo.low.a", "demo.high", 4, "typing", False) in got  # an arrow, but never run
    assert ("demo.low.a", "demo.high", 6, "function", False) in got  # relative, inside a function
    assert ("demo.high", "demo.low.a", 1, "module", False) in got
    assert ("demo.high", "demo.low", 1, "module", True) in got  # the package __init__ runs first
    assert ("demo.cyc", "demo.high", 1, "module", False) in got  # ``from . import high`` names the module
    bad = offending(["demo.low"], ["demo.high", "lightning"], edges=edges)
    assert [str(e) for e in bad] == [f"demo.low.a -> demo.high ({Path('src/demo/low/a.py')}:4)",
                                     f"demo.low.a -> demo.high ({Path('src/demo/low/a.py')}:6)",
                                     f"demo.low.a -> lightning ({Path('src/demo/low/a.py')}:2)"]
    cycles = find_cycles(edges, "demo")
    assert [[str(e) for e in c] for c in cycles] == [[f"demo.cyc -> demo.high ({Path('src/demo/cyc.py')}:1)",
                                                      f"demo.high -> demo.cyc ({Path('src/demo/high.py')}:3)"]]
    # Without demo.cyc: demo.low.a -> demo.high (inside f) closes a cycle only when function bodies count.
    acyclic = [e for e in edges if "demo.cyc" not in (e.source, e.target)]
    assert find_cycles(acyclic, "demo") == []
    lazy = find_cycles(acyclic, "demo", when=("module", "function"))
    assert [[str(e) for e in c] for c in lazy] == [[f"demo.high -> demo.low.a ({Path('src/demo/high.py')}:1)",
                                                    f"demo.low.a -> demo.high ({Path('src/demo/low/a.py')}:6)"]]


# ---- package-level layering (imports inside functions counted) -------------------------------
# The units docs/architecture.md draws: each package (or top-level module) of rolemrc, except the
# recipe modules, which sit above the parts they build with although they live in a package of
# building blocks. Top to bottom; a unit imports units of its own layer or below, never above,
# and the units form no cycle.
RECIPE_MODULES = ["rolemrc.run.train", "rolemrc.eval.run", "rolemrc.eval.suites", "rolemrc.eval.dialogue",
                  "rolemrc.eval.general", "rolemrc.probing.run", "rolemrc.synth.pipeline", "rolemrc.memory"]
LAYERS: list[tuple[str, list[str]]] = [
    ("recipes", RECIPE_MODULES),
    # rolemrc.run less its recipe module (train); rolemrc.sizing, which the run hands its module
    # builder and world size (it imports nothing of rolemrc.run)
    ("parts", ["rolemrc.run", "rolemrc.parts", "rolemrc.sizing"]),
    ("training loop", ["rolemrc.modules", "rolemrc.callbacks"]),
    ("building blocks", ["rolemrc.models", "rolemrc.data", "rolemrc.eval", "rolemrc.probing", "rolemrc.api",
                         "rolemrc.synth", "rolemrc.rewards", "rolemrc.rollout", "rolemrc.env"]),
    ("pure functions, storage, misc", ["rolemrc.objectives", "rolemrc.checkpointing", "rolemrc.fileio",
                                       "rolemrc.config", "rolemrc.config_objectives", "rolemrc.config_suites",
                                       "rolemrc.tasks", "rolemrc.rng",
                                       "rolemrc.errors", "rolemrc.loggers", "rolemrc.entry", "rolemrc.sweep",
                                       "rolemrc.warnings", "rolemrc.hydra_errors", "rolemrc.registry"]),
]


def unit_of(module: str) -> str:
    """The layering unit of a project module: its recipe module, else its top-level package or module."""
    for recipe in RECIPE_MODULES:
        if inside(module, [recipe]):
            return recipe
    return ".".join(module.split(".")[:2])


def unit_edges(edges: list[Edge] = EDGES) -> list[Edge]:
    """Imports between different units (module level and inside functions; not TYPE_CHECKING)."""
    return [Edge(unit_of(e.source), unit_of(e.target), e.file, e.line, e.when, e.implicit) for e in edges
            if e.when != "typing" and inside(e.target, [PROJECT]) and e.target != PROJECT
            and unit_of(e.source) != unit_of(e.target)]


def layer_of(unit: str) -> int | None:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    return None


def test_every_unit_has_a_layer_and_a_line_in_the_architecture_doc() -> None:
    units = {unit_of(m) for m in module_names(SRC, PROJECT) if m != PROJECT}
    assert not [u for u in sorted(units) if layer_of(u) is None], "add the new module to LAYERS (and the doc)"
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert not [u for u in sorted(units) if u not in doc], "docs/architecture.md must name every top-level module"


def test_units_import_only_their_layer_or_below() -> None:
    up = sorted({e for e in unit_edges() if layer_of(e.target) < layer_of(e.source)}, key=lambda e: (e.file, e.line))
    assert not up, "imports that climb a layer:\n  " + "\n  ".join(
        f"{e} [{LAYERS[layer_of(e.source)][0]} -> {LAYERS[layer_of(e.target)][0]}]" for e in up)


def test_no_cycle_between_units() -> None:
    cycles = find_cycles(unit_edges(), when=("module", "function"))
    assert not cycles, f"{len(cycles)} cycle(s) between packages:\n{show_cycles(cycles)}"


def package_of(module: str) -> str:
    """The top-level package (or module) of a project module: ``rolemrc.run.train`` -> ``rolemrc.run``."""
    return ".".join(module.split(".")[:2])


def package_edges(edges: list[Edge] = EDGES) -> list[Edge]:
    """Imports between different top-level packages, recipe modules counted with their package
    (module level and inside functions; not TYPE_CHECKING)."""
    return [Edge(package_of(e.source), package_of(e.target), e.file, e.line, e.when, e.implicit) for e in edges
            if e.when != "typing" and inside(e.target, [PROJECT]) and e.target != PROJECT
            and package_of(e.source) != package_of(e.target)]


def test_no_cycle_between_top_level_packages() -> None:
    """Coarser than the units: a recipe module counts as its package's, so ``rolemrc.run.train ->
    rolemrc.sizing -> rolemrc.run.build`` would be the cycle ``run <-> sizing``. The sizing package
    is handed the run's module builder and world size; it never imports the run."""
    cycles = find_cycles(package_edges(), when=("module", "function"))
    assert not cycles, f"{len(cycles)} cycle(s) between top-level packages:\n{show_cycles(cycles)}"


def test_sizing_is_one_package_below_the_run() -> None:
    """Sizing (the formula, the simulator, the run's decision and its cache) is ``rolemrc.sizing``:
    it imports nothing of ``rolemrc.run`` nor of the command line (``rolemrc.memory``), the run and
    the command line hand it what it needs; and no rolemrc module is imported inside a function
    there (the simulator is imported where a simulation runs: the command line's ``--simulate``
    and the child process a run simulates in). The old modules are gone."""
    up = offending(["rolemrc.sizing"], ["rolemrc.run", "rolemrc.memory"])
    assert not up, f"{len(up)} import(s) of the run from rolemrc.sizing:\n  {describe(up)}"
    lazy = function_level_project_imports(["rolemrc.sizing"])
    assert not lazy, f"{len(lazy)} function-level import(s) of rolemrc modules in rolemrc.sizing:\n  {describe(lazy)}"
    modules = module_names(SRC, PROJECT)
    assert "rolemrc.memory_sim" not in modules and "rolemrc.run.sizing" not in modules
    assert {"rolemrc.sizing.formula", "rolemrc.sizing.simulate", "rolemrc.sizing.decide"} <= set(modules)


def function_level_project_imports(sources: Iterable[str] = (PROJECT,), edges: list[Edge] = EDGES) -> list[Edge]:
    """Imports of rolemrc modules inside a function body (not ``if TYPE_CHECKING:``) under ``sources``."""
    return sorted((e for e in edges if e.when == "function" and not e.implicit and inside(e.source, list(sources))
                   and inside(e.target, [PROJECT])), key=lambda e: (e.file, e.line))


# Function-level imports of rolemrc modules in all of src/: a ceiling that only goes down (the
# sizing package holds none; the command line, rolemrc.memory, imports the training code only for
# --simulate). Lower it when an import moves to module level.
MAX_FUNCTION_LEVEL_PROJECT_IMPORTS = 10


def test_function_level_imports_of_project_modules_do_not_grow() -> None:
    lazy = function_level_project_imports()
    assert len(lazy) <= MAX_FUNCTION_LEVEL_PROJECT_IMPORTS, (
        f"{len(lazy)} function-level import(s) of rolemrc modules (at most {MAX_FUNCTION_LEVEL_PROJECT_IMPORTS}):"
        f"\n  {describe(lazy)}")


def test_layers_and_packages_hold_on_a_fake_tree() -> None:
    """Guards the two checks above: an upward import and a package cycle are found."""
    fake = [Edge("rolemrc.run.train", "rolemrc.sizing.decide", "a.py", 1, "module"),
            Edge("rolemrc.sizing.simulate", "rolemrc.run.build", "b.py", 2, "function")]
    assert find_cycles(package_edges(fake), when=("module", "function"))
    assert [str(e) for e in offending(["rolemrc.sizing"], ["rolemrc.run"], edges=fake)] == [
        "rolemrc.sizing.simulate -> rolemrc.run.build (b.py:2)"]
    assert [str(e) for e in function_level_project_imports(["rolemrc.sizing"], fake)] == [
        "rolemrc.sizing.simulate -> rolemrc.run.build (b.py:2)"]


def test_the_package_check_sees_a_function_level_cycle() -> None:
    """Guards the checker: a package cycle closed only by an import inside a function is found."""
    fake = [Edge("rolemrc.data.a", "rolemrc.config", "x.py", 1, "module"),
            Edge("rolemrc.config", "rolemrc.data.templates", "y.py", 2, "function")]
    assert find_cycles(unit_edges(fake), when=("module", "function"))
    assert not find_cycles(unit_edges(fake), when=("module",))


@pytest.mark.parametrize("start", ["rolemrc.synth.pipeline", "rolemrc.config", "rolemrc.data.readers"])
def test_synthesis_and_configs_start_without_torch(start: str) -> None:
    """synthesize.py (API requests and JSON) and what reads configs and data files do not import
    torch at start (~2 s of CPU here, at every synthesize.py start)."""
    chains = imported_at_start(start)
    assert "torch" not in chains, f"{start} imports torch through:\n  {describe(chains['torch'])}"


def imported_at_start(start: str, edges: list[Edge] = EDGES) -> dict[str, list[Edge]]:
    """Every module (project modules, and the top-level names of others) importing ``start`` runs,
    with the chain of module-level imports that reaches it."""
    chains: dict[str, list[Edge]] = {start: []}
    todo = [start]
    while todo:
        source = todo.pop()
        for e in edges:
            if e.source == source and e.runtime and e.target not in chains:
                chains[e.target] = [*chains[source], e]
                if e.target.startswith(PROJECT + "."):
                    todo.append(e.target)
    return chains


@pytest.mark.parametrize("start", ["rolemrc.eval.run", "rolemrc.eval.suites", "rolemrc.eval.general", "rolemrc.eval.dialogue",
                                   "rolemrc.probing.run", "rolemrc.checkpointing", "rolemrc.memory",
                                   "rolemrc.run.resume", "rolemrc.sizing.formula", "rolemrc.sizing.decide"])
def test_evaluation_probing_and_checkpoint_reading_start_without_lightning(start: str) -> None:
    """Lightning (and the torchmetrics/scipy/matplotlib/dynamo imports it brings, seconds of CPU
    at every start here) is training's: evaluate.py, probe.py, what reads a checkpoint and the memory estimate
    (python -m rolemrc.memory, whose simulation imports the training code when it runs) do not import it,
    nor does train.py's choice of the folder to continue (rolemrc.run.resume, before Hydra starts).
    The parts they build are rolemrc.parts'."""
    chains = imported_at_start(start)
    for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
        assert name not in chains, f"{start} imports {name} through:\n  {describe(chains[name])}"


def generation_sites(src: Path = SRC, project: str = PROJECT) -> dict[str, set[str]]:
    """Modules that call an HF model's ``generate`` (``x.generate(...)`` with keyword arguments only:
    transformers' signature; vLLM's, an engine's and a context's take prompts by position), that build
    ``vllm.LLM(...)``, and that define ``require_vllm``."""
    out: dict[str, set[str]] = {"hf generate": set(), "vllm LLM": set(), "require_vllm": set()}
    for name, path in module_names(src, project).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "generate" and not node.args and node.keywords:
                    out["hf generate"].add(name)
                if node.func.attr == "LLM":
                    out["vllm LLM"].add(name)
            if isinstance(node, ast.FunctionDef) and node.name == "require_vllm":
                out["require_vllm"].add(name)
    return out


def test_one_generation_layer() -> None:
    """GRPO's rollouts and validation, evaluation, the local judge, the judge-scores callback and the
    memory simulation all generate through ``rolemrc.rollout``: transformers ``generate`` is called in
    ``rollout/hf.py`` only, ``vllm.LLM`` built (and vLLM imported) in ``rollout/vllm.py`` only."""
    sites = generation_sites()
    assert sites == {"hf generate": {"rolemrc.rollout.hf"}, "vllm LLM": {"rolemrc.rollout.vllm"},
                     "require_vllm": {"rolemrc.rollout.vllm"}}, sites
    vllm = sorted(str(e) for e in EDGES if e.target == "vllm")
    assert all("rolemrc.rollout.vllm ->" in e for e in vllm), vllm


# ---------------------------------------------------------------- the objective contract
# Every hook the run, resume, the reference and sizing call on an objective's module or settings is
# declared with its default on rolemrc.modules.base.PolicyModule (and PairModule) or
# rolemrc.config_objectives.ObjectiveConfig: callers call it, they never ask whether it is there.
# A probe is ``hasattr(x, ...)`` or ``getattr(x, name, default)`` (a default: "if it has one"),
# where ``x`` is a module or an objective: a name in PROBED_NAMES, an attribute in PROBED_ATTRIBUTES
# (``self.reference``, ``cfg.objective``), a call turning a node into settings (``typed(...)``,
# ``objective_settings(...)``), or ``self`` in the files that define modules and objectives.
# The environments' contract is held the same way: an episode's hooks (``together``) are declared
# with their defaults on rolemrc.env.base.Episode; env/ never asks an episode or environment for one.
# ``getattr(module, name)`` without a default reads a declared hook by name (the simulation's
# ``no_grad_passes``): not a probe. Files outside CONTRACT_FILES hold other kinds of "module"
# (attention layers, Python modules) and are not looked at.
PROBED_NAMES = {"module", "pl_module", "objective", "reference", "entry", "episode", "env"}
PROBED_ATTRIBUTES = {"objective", "reference", "module"}
SETTINGS_CALLS = {"typed", "objective_settings", "as_schema"}
CONTRACT_FILES = ("run/", "sizing/", "modules/", "objectives/", "checkpointing/", "callbacks/", "env/", "config.py",
                  "config_objectives.py")
SELF_IS_CONTRACT = ("modules/", "objectives/", "config_objectives.py")


def contract_probes(src: Path = SRC / PROJECT) -> list[str]:
    """``file:line: call`` of every probe of a module or objective under ``src`` (see above)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if not rel.startswith(CONTRACT_FILES):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            if not (node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)):
                continue
            x = node.args[0]
            if ((isinstance(x, ast.Name) and (x.id in PROBED_NAMES or (x.id == "self" and rel.startswith(SELF_IS_CONTRACT))))
                    or (isinstance(x, ast.Attribute) and x.attr in PROBED_ATTRIBUTES)
                    or (isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id in SETTINGS_CALLS)):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_probe_of_a_module_or_objective_outside_the_contract() -> None:
    probes = contract_probes()
    assert not probes, ("hooks asked for instead of declared (declare them with a default on PolicyModule, "
                        "ObjectiveConfig or rolemrc.env.base.Episode and call them):\n  " + "\n  ".join(probes))


def test_the_probe_check_finds_probes(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "a.py").write_text(
        "def f(module, cfg):\n    a = getattr(module, 'memory_note', '')\n    b = hasattr(cfg.objective, 'x')\n"
        "    c = getattr(typed(cfg.objective), 'check_run', None)\n    d = getattr(module, 'memory_note')\n"
        "    e = getattr(cfg, 'x', None)\n", encoding="utf-8")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "b.py").write_text("def g(module):\n    return hasattr(module, 'sinks')\n", encoding="utf-8")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "c.py").write_text("def h(episode):\n    return getattr(episode, 'together', None)\n",
                                           encoding="utf-8")
    assert [":".join(p.split(":")[:2]) for p in contract_probes(tmp_path)] == ["env/c.py:2", "run/a.py:2", "run/a.py:3",
                                                                               "run/a.py:4"]


# ---------------------------------------------------------------- the config typed once
# train.py's config is resolved once, at the run's door (rolemrc.run.train.setup), into
# rolemrc.config.TrainParts; below the door every function is handed the parts it reads (a group
# node, a value, or rolemrc.config.TrainStep: the groups one optimizer step is made of, for the
# module builder, sizing and an objective's memory hooks), never the composed config. Statically:
# a *config parameter* (named cfg, run_cfg, config or conf, or annotated DictConfig/TrainConfig, and
# not annotated with a part type) *takes the whole config* when the function reads two or more
# top-level keys of TrainConfig from it (``p.model``, ``p["data"]``, ``p.get("seed")``,
# ``OmegaConf.select(p, "trainer...")``), or hands it on as it is to a parameter that takes it (any
# function of src/ of that name). Only the door and the entries may.
CONFIG_PARAMETER_NAMES = {"cfg", "run_cfg", "config", "conf"}
WHOLE_CONFIG_TYPES = {"DictConfig", "TrainConfig"}
PART_TYPES = {"TrainStep", "Replier", "Judging", "Capture"}
# module:qualified name (fnmatch patterns) of the functions that may take the whole config
CONFIG_DOOR = [
    "rolemrc.run.train:setup", "rolemrc.run.train:run",  # the training recipe's entry and door
    "rolemrc.config:*",  # the checks run at the door (check_train_config, ...) and the typing (TrainParts.of)
    "rolemrc.config_objectives:*.check_run",  # an objective's rules across groups, from check_train_config
    "rolemrc.models.source:resolve_model_sources",  # rewrites model.path (and compare.path) at every entry's door
    "rolemrc.run.resume:*",  # before Hydra starts, and the record of what a continuation changed
    "rolemrc.memory:*",  # python -m rolemrc.memory: its own entry
    "rolemrc.eval.run:run", "rolemrc.eval.suites:run_suites", "rolemrc.eval.dialogue:run_dialogues",
    "rolemrc.probing.run:run",  # the other recipes' entries
    "rolemrc.synth.pipeline:run", "rolemrc.synth.config:validate",
]
# The other recipes are typed at their doors the same way (evaluate.py: rolemrc.config.Replier and
# Judging; probe.py: its groups and rolemrc.probing.run.Capture; synthesize.py: each stage its groups
# beside the shared rolemrc.synth.pipeline.Context): each recipe's config class names the root keys
# of the whole config in the modules that recipe runs.
RECIPES = {  # config class (file) -> the modules whose functions it is handed to
    "TrainConfig": ("config.py", ["rolemrc.*"]),
    "EvaluateConfig": ("config.py", ["rolemrc.eval.*", "rolemrc.rewards.evaluation", "rolemrc.env.*"]),
    "ProbeConfig": ("config.py", ["rolemrc.probing.*"]),
    "SynthConfig": ("synth/config.py", ["rolemrc.synth.*"]),
}


def _root_keys(src: Path = SRC / PROJECT, cls_name: str = "TrainConfig", file: str = "config.py") -> set[str]:
    tree = ast.parse((src / file).read_text(encoding="utf-8"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _annotation(arg: ast.arg) -> str:
    return "" if arg.annotation is None else ast.unparse(arg.annotation).strip("'\"").rpartition(".")[2]


def whole_config_parameters(src: Path = SRC / PROJECT, project: str = PROJECT,
                            roots: set[str] | None = None, scope: tuple[str, ...] = ("*",)) -> set[str]:
    """``module:function(parameter)`` of every config parameter that takes the whole config (above),
    ``roots`` being the root keys of the recipe's config (TrainConfig's by default), among the
    functions of the modules matching ``scope``."""
    from fnmatch import fnmatch

    roots = _root_keys(src) if roots is None else roots
    functions: list[tuple[str, ast.FunctionDef, list[ast.arg]]] = []  # (module:qualname, node, parameters)
    for path in sorted(src.rglob("*.py")):
        parts = [project, *path.relative_to(src).with_suffix("").parts]
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not any(fnmatch(module, pattern) for pattern in scope):
            continue

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    params = [p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg not in ("self", "cls")]
                    functions.append((f"{module}:{prefix}{child.name}", child, params))
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
        visit(ast.parse(path.read_text(encoding="utf-8")), "")

    def is_config(p: ast.arg) -> bool:
        kind = _annotation(p)
        return kind not in PART_TYPES and (p.arg in CONFIG_PARAMETER_NAMES or kind in WHOLE_CONFIG_TYPES)

    def reads(fn: ast.AST, name: str) -> set[str]:
        keys = set()
        for n in ast.walk(fn):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name:
                keys.add(n.attr)
            elif (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == name
                  and isinstance(n.slice, ast.Constant)):
                keys.add(n.slice.value)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
                first = n.args[0]
                if (n.func.attr == "get" and isinstance(n.func.value, ast.Name) and n.func.value.id == name
                        and isinstance(first, ast.Constant)):
                    keys.add(first.value)
                elif (n.func.attr == "select" and isinstance(first, ast.Name) and first.id == name
                      and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)):
                    keys.add(str(n.args[1].value).split(".")[0])
        return keys & roots

    taking = {(q, p.arg) for q, fn, params in functions for p in params if is_config(p) and len(reads(fn, p.arg)) >= 2}
    by_name: dict[str, list[tuple[str, list[ast.arg]]]] = {}
    for q, _, params in functions:
        by_name.setdefault(q.rpartition(".")[2].rpartition(":")[2], []).append((q, params))
    changed = True
    while changed:  # hands it on as it is to a parameter that takes it
        changed = False
        for q, fn, params in functions:
            for p in params:
                if (q, p.arg) in taking or not is_config(p):
                    continue
                for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
                    for callee, cparams in by_name.get(name, []):
                        positional = [c.arg for c in cparams]
                        handed = [positional[i] for i, a in enumerate(call.args)
                                  if isinstance(a, ast.Name) and a.id == p.arg and i < len(positional)]
                        handed += [k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == p.arg]
                        if any((callee, h) in taking for h in handed):
                            taking.add((q, p.arg))
                            changed = True
    return {f"{q}({p})" for q, p in taking}


def test_no_function_below_the_entries_takes_the_whole_config() -> None:
    from fnmatch import fnmatch

    taking = set()
    for cls_name, (file, scope) in RECIPES.items():
        taking |= whole_config_parameters(roots=_root_keys(SRC / PROJECT, cls_name, file), scope=tuple(scope))
    unexpected = sorted(t for t in taking if not any(fnmatch(t.partition("(")[0], d) for d in CONFIG_DOOR))
    assert not unexpected, ("functions below the entries that take the whole config (hand them the parts they "
                            "read: rolemrc.config.TrainParts / TrainStep, Replier / Judging, a group, a value):\n  " + "\n  ".join(unexpected))


def test_the_whole_config_check_finds_the_old_builders(tmp_path: Path) -> None:
    """Guards the check: a builder reading two groups of the config, one handing the config on to it,
    and one handed a TrainStep or a group."""
    (tmp_path / "run").mkdir()
    (tmp_path / "config.py").write_text("class TrainConfig:\n    model: int = 0\n    data: int = 0\n    seed: int = 0\n")
    (tmp_path / "run" / "build.py").write_text(
        "def build_module(cfg, model):\n    return cfg.model.dtype, cfg.get('data')\n"
        "def setup_like(cfg: 'DictConfig'):\n    return build_module(cfg, None)\n"
        "def ok(step: TrainStep, data):\n    return step.model, step.data, data.seed\n"
        "def one(cfg):\n    return cfg.model\n", encoding="utf-8")
    assert whole_config_parameters(tmp_path) == {"rolemrc.run.build:build_module(cfg)",
                                                  "rolemrc.run.build:setup_like(cfg)"}
