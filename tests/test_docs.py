"""The documentation holds together: the README stays short and every link in it (and in
CONTRIBUTING.md) reaches a file and a heading that exist; the docs site builds strictly and a
broken link or anchor fails the build (``make docs-check``, which ``make test`` runs); and every
command the README and the docs show names a command, option, make target or benchmark flag
that exists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

README = REPO / "README.md"
CONTRIBUTING = REPO / "CONTRIBUTING.md"
DOCS = REPO / "docs"
GITHUB_PAGES = (README, CONTRIBUTING)  # read on GitHub, beside the code they link to
COMMAND_TEXTS = (README, CONTRIBUTING, *sorted(DOCS.glob("*.md")))
MAX_README_LINES = 300

LINK = re.compile(r"(?<!!)\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`]+)`")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)


def without_code(text: str) -> str:
    """Markdown with its fenced blocks and code spans blanked (a link shown as code is no link)."""
    return CODE_SPAN.sub("``", FENCE.sub("", text))


def github_anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered (as mkdocs.yml's slugify gives the site's)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown.read_text()), re.MULTILINE):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked):
            broken.append(f"{target}: no heading #{anchor}")
    return broken


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


@pytest.mark.parametrize("page", GITHUB_PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_a_file_and_heading(page):
    assert LINK.findall(without_code(page.read_text())), "the page links to the docs"
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "target.md").write_text("# Target\n\n## What foldsweep trains: the contract with `model.fit`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](target.md#what-foldsweep-trains-the-contract-with-modelfit) [b](missing.md) "
        "[c](target.md#no-such-heading) `[d](missing-too.md)`\n"
    )
    assert broken_links(page) == [
        "missing.md: no file missing.md",
        "target.md#no-such-heading: no heading #no-such-heading",
    ]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config``, from its directory (where its snippets are looked
    for), as `make docs-check` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """mkdocs.yml, docs/ and the files its pages include, copied: a scratch site to break."""
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    shutil.copytree(DOCS, tmp_path / "docs")
    for page in DOCS.glob("*.md"):
        for included in SNIPPET.findall(page.read_text()):
            (tmp_path / included).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / included, tmp_path / included)
    return tmp_path


@pytest.mark.e2e  # a process of its own: MkDocs with the Material theme
def test_the_docs_site_builds_strictly(tmp_path):
    built = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "spec" / "index.html").is_file()
    # the pages kept outside docs/ are on the site too
    assert "Your own arrays" in (tmp_path / "site" / "data" / "index.html").read_text()
    assert "Benchmark results" in (tmp_path / "site" / "results" / "index.html").read_text()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "link, named",
    [
        ("[x](no-such-page.md)", "no-such-page.md"),
        ("[x](index.md#no-such-heading)", "#no-such-heading"),
    ],
    ids=["missing page", "missing anchor"],
)
def test_a_broken_link_or_anchor_fails_the_docs_build(docs_copy, link, named):
    with (docs_copy / "docs" / "nan.md").open("a") as page:
        page.write(f"\n{link}\n")
    built = mkdocs_build(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert built.returncode != 0
    assert named in built.stderr and "nan.md" in built.stderr, built.stderr


# The commands the pages show, in their code (spans and fenced blocks).
# A command starts its line or code span (`.venv/bin/foldsweep` too); "foldsweep trains" in a message is no command.
FOLDSWEEP_COMMAND = re.compile(r"^[ \t]*(?:\S*/)?foldsweep (\w[\w-]*)([^\n`#]*)", re.MULTILINE)
MAKE_COMMAND = re.compile(r"(?:^|\s)make ([a-z][\w-]*)([^\n`#]*)", re.MULTILINE)
BENCHMARK_COMMAND = re.compile(r"(?:python -m|-p) benchmarks\.(\w+)([^\n`#]*)")


def code_of(page: Path) -> list[str]:
    text = page.read_text()
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    spans = [" ".join(span.split()) for span in CODE_SPAN.findall(FENCE.sub("", text))]
    return fenced + spans


def options(words: str) -> set[str]:
    return {option.split("=")[0] for option in re.findall(r"(?<![\w-])--[a-z][\w-]*(?:=\S*)?", words)}


def shown(pattern: re.Pattern[str]) -> list[tuple[str, str, str]]:
    """(page, name, the rest of its line) for each command the pages show."""
    return [(page.name, *match) for page in COMMAND_TEXTS for code in code_of(page) for match in pattern.findall(code)]


def test_every_foldsweep_command_shown_exists_with_its_options():
    import typer.main

    from pipeline.cli import app

    cli = typer.main.get_command(app)
    commands = shown(FOLDSWEEP_COMMAND)
    assert {name for _, name, _ in commands} >= {"run", "validate", "trial", "rerun", "report", "ui", "datasets"}
    wrong = []
    for page, name, rest in commands:
        command = cli.commands.get(name)
        if command is None:
            wrong.append(f"{page}: foldsweep {name}")
            continue
        known = {opt for param in command.params for opt in param.opts}
        wrong += [f"{page}: foldsweep {name} {option}" for option in sorted(options(rest) - known)]
    assert wrong == []


def test_every_make_target_shown_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    shown_targets = {name for _, name, _ in shown(MAKE_COMMAND)}
    assert {"sweep", "test", "test-fast", "docs", "docs-check"} <= shown_targets
    assert shown_targets - targets == set()


def test_every_benchmark_shown_exists_with_its_options():
    wrong = []
    for page, module, rest in shown(BENCHMARK_COMMAND):
        source = REPO / "benchmarks" / f"{module}.py"
        if not source.is_file():
            wrong.append(f"{page}: benchmarks.{module}")
            continue
        text = source.read_text()
        wrong += [
            f"{page}: benchmarks.{module} {option}" for option in sorted(options(rest)) if f'"{option}"' not in text
        ]
    assert wrong == []
