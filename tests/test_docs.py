"""The README and docs keep telling the truth about the repository: every command in a fenced block names flags
its script accepts (checked against the script's own `--help`), and every relative link and repository path they
name exists. A renamed flag, a moved module or a deleted doc then fails here instead of in a newcomer's shell."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import PROJECT_ROOT

DOCS = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
# paths the docs name in backticks: a top-level folder of the repository, then more of a path
TOP = sorted(p.name for p in PROJECT_ROOT.iterdir() if p.is_dir() and not p.name.startswith("."))
PATH = re.compile(r"`((?:" + "|".join(map(re.escape, TOP)) + r")/[\w./-]*[\w/])`")
GENERATED = ("artifacts/", "build/", "embedded/mol2-small/router/")  # made by the pipeline, not committed
PYTHON = re.compile(r"^(?:\.venv/bin/)?python3? (?:-m ([\w.]+)|(scripts/[\w/]+\.py))(.*)$")


def _commands(text: str) -> list[str]:
    """Shell commands of the fenced blocks (continuation lines joined, comments and prompts dropped)."""
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            line = re.split(r"\s+#", line)[0].strip()
            if line:
                out.append(line)
    return out


def _python_commands() -> list[tuple[str, str, str]]:
    """(doc, entry point, arguments) of every `python -m X` / `python scripts/x.py` command in a fenced block."""
    found = []
    for doc in DOCS:
        for command in _commands(doc.read_text()):
            for part in re.split(r"\s*(?:&&|;|\|)\s*", command):
                m = PYTHON.match(part)
                if m:
                    found.append((doc.name, m.group(1) or m.group(2), m.group(3)))
    return found


@functools.lru_cache(maxsize=None)
def _help(entry: str) -> str:
    """The entry point's `--help` (each of its subcommands' too, for `python -m build_engines <stage>` style CLIs)."""
    argv = [sys.executable, "-m", entry] if not entry.endswith(".py") else [sys.executable, entry]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([*argv, "--help"], cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"{entry} --help failed: {done.stderr[-800:]}"
    return done.stdout


@functools.lru_cache(maxsize=None)
def _subcommand_help(entry: str, sub: str) -> str:
    """A subcommand's `--help` ("" when `sub` is none), asked once per run: many documented commands share one."""
    argv = [sys.executable, "-m", entry] if not entry.endswith(".py") else [sys.executable, entry]
    done = subprocess.run([*argv, sub, "--help"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    return done.stdout if done.returncode == 0 else ""


def test_the_docs_name_python_commands() -> None:
    assert len(_python_commands()) >= 20, "the command scan found too few commands: the pattern is broken"


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted({e for _, e, _ in _python_commands()}))
def test_every_flag_of_a_documented_command_exists(entry: str) -> None:
    usage = _help(entry)
    wrong = []
    for doc, e, args in _python_commands():
        if e != entry:
            continue
        words = shlex.split(args.replace("[", " ").replace("]", " "))
        text = usage
        if words and not words[0].startswith("-") and re.search(rf"\b{re.escape(words[0])}\b", usage):
            text = _subcommand_help(entry, words[0]) or usage  # `build_engines build --model ...`: the stage's flags
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                wrong.append(f"{doc}: {entry} {args.strip()} -> {flag}")
    assert not wrong, "documented flags the command does not accept:\n" + "\n".join(wrong)


def test_relative_links_and_named_paths_exist() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            if not (doc.parent / target).resolve().exists():
                missing.append(f"{doc.relative_to(PROJECT_ROOT)}: link {target}")
        for path in PATH.findall(text):
            if path.startswith(GENERATED) or re.search(r"[A-Z]{3,}|<|\*|\{", path):
                continue  # generated, or a placeholder (DIR, <name>, globs)
            if not (PROJECT_ROOT / path).exists():
                missing.append(f"{doc.relative_to(PROJECT_ROOT)}: path {path}")
    assert not missing, "the docs name what the repository does not hold:\n" + "\n".join(missing)


def test_no_doc_sends_a_reader_outside_the_repository() -> None:
    """`../shared/...` (the developers' notes) and bare issue numbers mean nothing to a user of the repository."""
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if "../shared" in line or re.search(r"(?<![\w/])#\d{2,3}\b(?!\w)", line):
                bad.append(f"{doc.relative_to(PROJECT_ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


# `docs/load.md`, `benchmarks/soak.py` named in prose, with or without backticks or a link
# (not inside a longer path or URL)
PROSE_PATH = re.compile(r"(?<![\w/.-])((?:docs|scripts)/[\w/-]+\.(?:md|py|sh|png|json))\b")
FIGURE = re.compile(r"(?<![\w/.-])(figures/[\w-]+\.(?:png|json))\b")  # a page's own figures, relative to docs/


def test_docs_and_scripts_named_in_prose_exist() -> None:
    missing = []
    for doc in DOCS:
        for path in sorted(set(PROSE_PATH.findall(doc.read_text()))):
            if not (PROJECT_ROOT / path).exists():
                missing.append(f"{doc.relative_to(PROJECT_ROOT)}: {path}")
        for path in sorted(set(FIGURE.findall(doc.read_text()))):
            if not (PROJECT_ROOT / "docs" / path).exists():
                missing.append(f"{doc.relative_to(PROJECT_ROOT)}: {path}")
    assert not missing, "the docs name files the repository does not hold:\n" + "\n".join(missing)


def test_every_shell_script_of_a_fenced_command_exists() -> None:
    missing = []
    for doc in DOCS:
        for command in _commands(doc.read_text()):
            for script in re.findall(r"(?:^|\s)bash ([\w./-]+\.sh)\b", command):
                if not (PROJECT_ROOT / script).exists():
                    missing.append(f"{doc.relative_to(PROJECT_ROOT)}: {command}")
    assert not missing, "\n".join(missing)


def test_every_doc_is_reachable_from_the_readme() -> None:
    """A newcomer starts at README.md: every page of docs/ is linked from it or from a page it links to."""
    seen, todo = set(), [PROJECT_ROOT / "README.md"]
    while todo:
        doc = todo.pop()
        if doc in seen or not doc.exists():
            continue
        seen.add(doc)
        todo += [(doc.parent / t).resolve() for t in LINK.findall(doc.read_text())
                 if t.endswith(".md") and ":" not in t]
    unreached = sorted(d.name for d in DOCS if d.resolve() not in {s.resolve() for s in seen})
    assert not unreached, f"docs no link from README.md leads to: {unreached}"


def test_scripts_that_write_committed_docs_refuse_without_force() -> None:
    """A script or benchmark whose output defaults to docs/ (a committed file) takes --force and checks before it
    works."""
    lacking = []
    for script in sorted([*(PROJECT_ROOT / "scripts").glob("*.py"), *(PROJECT_ROOT / "benchmarks").glob("*.py")]):
        source = script.read_text()
        if re.search(r'default=(?:ROOT / "docs"|Path\("docs/)', source):
            if '"--force"' not in source or "refuse_to_overwrite(" not in source:
                lacking.append(script.name)
    assert not lacking, f"scripts writing committed docs without the --force guard: {lacking}"


def test_refuse_to_overwrite_stops_only_on_committed_files(tmp_path: Path) -> None:
    from build_engines.committed import committed, refuse_to_overwrite

    assert committed([PROJECT_ROOT / "README.md"]) == ["README.md"]
    assert "embedded/mol2-small/manifest.json" in committed([PROJECT_ROOT / "embedded" / "mol2-small"])
    assert committed([PROJECT_ROOT / "artifacts" / "anything.md", tmp_path / "x.md",
                      PROJECT_ROOT / "docs" / "no-such.md"]) == []
    with pytest.raises(SystemExit) as stopped:
        refuse_to_overwrite([tmp_path / "x.md", PROJECT_ROOT / "docs" / "load.md"], force=False)
    assert stopped.value.code == 2
    refuse_to_overwrite([PROJECT_ROOT / "docs" / "load.md"], force=True)  # --force: goes on
    refuse_to_overwrite([tmp_path / "x.md"], force=False)  # elsewhere: goes on
