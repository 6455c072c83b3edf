"""The README and the documentation site: the README's links lead somewhere and it keeps the
commands CI and newcomers rely on; `make docs` (its recipe, run as make runs it) fails on a
broken anchor."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_readme_keeps_the_two_commands_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 10
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).is_file()]
    assert not missing, f"README links to missing files: {missing}"
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == [], "every docs/ page is in mkdocs.yml's nav"


def _mkdocs_recipe() -> list[str]:
    """The `make docs` line that builds the site, as argv (``$(PY)`` is this interpreter)."""
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert recipe, "Makefile has a docs target"
    [line] = [ln.strip() for ln in recipe.group(1).splitlines() if "mkdocs build" in ln]
    argv = [a for a in shlex.split(line.replace("$(PY)", sys.executable)) if "=" not in a or a.startswith("-")]
    assert "--strict" in argv
    return argv


def _build(argv: list[str], tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_make_docs_fails_on_a_broken_anchor(tmp_path: Path) -> None:
    """One build, of the committed docs plus one bad link: it must fail, naming the link (the
    committed docs alone are built by `make docs` itself, before the tests)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    argv = _mkdocs_recipe()
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", tree / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tree / "mkdocs.yml")
    (tree / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", tree / "scripts" / "mkdocs_hooks.py")
    page = tree / "docs" / "preference.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [nowhere](configuration.md#no-such-key).\n",
                    encoding="utf-8")
    broken = _build(argv, tree)
    assert broken.returncode != 0
    assert "#no-such-key" in broken.stderr
    [warning] = [ln for ln in broken.stderr.splitlines() if ln.startswith("WARNING")]  # nothing else is wrong
    assert "preference.md" in warning
    # The pages are written all the same: they load nothing from other hosts (no web fonts, no
    # scripts: offline readers, privacy) and carry the theme CSS that keeps identifiers whole.
    site = tree / "site"
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    fetched = re.compile(r"<(?:link|script|img)\b[^>]*\b(?:href|src)=\"(?:https?:)?//[^\"]*\"|url\((?:['\"]?)(?:https?:)?//|@import")
    external = [f"{p.relative_to(site)}: {m.group(0)}" for p in pages + sorted(site.rglob("*.css"))
                for m in fetched.finditer(p.read_text(encoding="utf-8", errors="replace"))]
    assert not external, "the built site fetches from other hosts:\n" + "\n".join(external[:10])
    assert "stylesheets/extra.css" in (site / "index.html").read_text(encoding="utf-8")
    # scripts/mkdocs_hooks.py: each word of inline code is kept on one line
    assert '<code><span class="nowrap">objective.reference</span></code>' in (site / "preference" / "index.html").read_text(encoding="utf-8")


# Tracker and history words: issue numbers ("Issue 33", "issue #12", "#33"), work sessions and rounds
# ("in an earlier session", "this round"), "before/after the fix". Domain words stay legal (a
# CharacterLLM "session" of questions, an HTML entity such as "&#124;", a URL's "#1" fragment).
_TRACKER = re.compile(
    r"\b[Ii]ssues? ?#?\d+\b"
    r"|(?<![&\w/#])#\d+\b"
    r"|\b(?:this|that|last|next|previous|earlier|later|same|another) (?:session|round)s?\b"
    r"|\b(?:before|after) (?:the|this) (?:fix|change)\b"
    r"|\bfiled by\b")


def test_docs_carry_no_tracker_or_history_words() -> None:
    pages = [ROOT / "README.md", ROOT / "mkdocs.yml", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}" for page in pages
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             for m in _TRACKER.finditer(line)]
    assert not found, "docs are written for users, not for the tracker:\n" + "\n".join(found)
    assert _TRACKER.search("Issue 33 brings GRPO") and _TRACKER.search("in an earlier session")
    assert not _TRACKER.search("Turns sessions of one topic; `&#124;` in a table; page.html#2")


def _fenced_block(page: Path, heading: str) -> list[str]:
    """The command lines of the first ```bash block under ``heading`` (continuations joined,
    comments dropped)."""
    text = page.read_text(encoding="utf-8")
    assert heading in text, f"{page.name} has no {heading!r} section (its bash block is what this test runs)"
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = []
    for raw in block.replace("\\\n", " ").splitlines():
        line = raw.split("  #")[0].split(" # ")[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _fresh_shell_env() -> dict[str, str]:
    """What a new terminal has: no virtual environment active, none of its bin folders on PATH
    (PYTHONPATH is kept: a developer's own setting, as in a worktree that shares a venv)."""
    venvs = {Path(sys.prefix).resolve(), (ROOT / ".venv").resolve()}
    path = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep)
            if p and not any(Path(p).resolve().is_relative_to(v) for v in venvs)]
    env = {k: os.environ[k] for k in ("HOME", "LANG", "TMPDIR", "PYTHONPATH", "TERM") if k in os.environ}
    return {**env, "PATH": os.pathsep.join(path)}


@pytest.mark.slow
def test_readme_and_quickstart_commands_run_in_a_fresh_shell() -> None:
    """The README's and the quickstart's own-run commands, typed into a new shell after `make
    demo`, as written: each setup line (activating .venv) runs as is, each command is run to the
    point where its configuration is composed (Hydra's `--cfg job`; export.py `--help`), so a
    `python` without the project's packages, a renamed script or a stale key fails here."""
    if not (ROOT / ".venv" / "bin" / "activate").is_file() and sys.prefix == sys.base_prefix:
        pytest.skip("no .venv here and not run from a virtual environment")
    commands: list[str] = []
    for page, heading in ((ROOT / "README.md", "## Your own runs"), (ROOT / "docs" / "quickstart.md", "## A first run")):
        commands += [c for c in _fenced_block(page, heading) if c not in commands]
    assert any(c.startswith("python train.py") for c in commands)
    script = ["set -euo pipefail"]
    for command in commands:
        command = re.sub(r"<same overrides>\s*", "", command)
        command = re.sub(r"<[^>]+>", "x", command)  # <SFT export>, <time>, <run>: any name composes
        if not command.startswith("python "):  # a setup line, e.g. activating the environment
            if not (ROOT / ".venv").exists():  # a worktree sharing another checkout's venv: that one
                command = command.replace(".venv/bin/activate", str(Path(sys.prefix) / "bin" / "activate"))
            script.append(command)
            continue
        argv = shlex.split(command)
        assert (ROOT / argv[1]).is_file(), f"{command}: no such script"
        tail = "--help" if argv[1] == "export.py" else "" if "--cfg" in argv else "--cfg job"
        script.append(f"echo '$ {command}' >&2; {command} {tail} >/dev/null")
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, env=_fresh_shell_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("$ python") == sum(c.startswith("python ") for c in commands)


def test_no_identifier_renders_as_emphasis() -> None:
    """`_target_` outside a code span renders as an italic "target": identifiers go in backticks."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        prose = re.sub(r"(`+).+?\1", "", text, flags=re.S)
        found += [f"{page.relative_to(ROOT)}: {m}" for m in re.findall(r"(?<![\w\\*])_[A-Za-z][\w.]*_(?!\w)", prose)]
    assert not found, "put identifiers in backticks:\n" + "\n".join(found)


def test_documented_evaluate_commands_say_how_bertscore_loads() -> None:
    """BERTScore defaults to the paper's roberta-large, which is not shipped and rolemrc keeps the
    hub offline: each documented evaluate.py command that scores BERTScore either uses the shipped
    MiniLM (`metrics.bertscore.model=`) or goes online (`HF_HUB_OFFLINE=0`), so it runs as written,
    or its block says which flag it needs offline (a comment line naming the key).
    Exempt: RoleBench, CharacterLLM, CharacterEval, CharacterBench, CoSER, PersonaGym and lm-eval runs, reward
    models and the dialogue mode (no BERTScore) and resuming a folder."""
    exempt = re.compile(r"data=(?:rolebench|characterllm|charactereval|characterbench|coser|personagym)|benchmarks="
                        r"|env=(?!none)"
                        r"|out_dir=|--cfg|metrics\.(?:names|rouge_only)"
                        r"|# a reward model")
    found, bad = 0, []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            said = any(ln.lstrip().startswith("#") and "metrics.bertscore.model=" in ln for ln in block.splitlines())
            for line in block.replace("\\\n", " ").splitlines():
                if "python evaluate.py" not in line or exempt.search(line) or said:
                    continue
                found += 1
                if "metrics.bertscore.model=" not in line and "HF_HUB_OFFLINE=0" not in line:
                    bad.append(f"{page.relative_to(ROOT)}: {line.strip()}")
    assert found >= 8 and not bad, "\n".join(bad)
