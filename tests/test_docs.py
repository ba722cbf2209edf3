"""Docs that stay true: docs/ARCHITECTURE.md names every module, docs/CLI.md every command and its options."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2p", "nat", "averaging", "training")


def modules() -> list[Path]:
    return sorted(p.relative_to(ROOT) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if not p.name.endswith("_pb2.py") and p.name not in ("__init__.py", "__main__.py"))


def named(path: Path, text: str, unique: set[str]) -> bool:
    """``p2p/dht/records.py`` counts as named by that path, by ``dht/records.py`` or, where no other module
    has its file name, by ``records.py``."""
    inner = Path(*path.parts[1:]) if len(path.parts) > 1 else path
    return str(path) in text or (len(path.parts) > 2 and str(inner) in text) or (path.name in unique and path.name in text)


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    counts = Counter(p.name for p in modules())
    unique = {name for name, n in counts.items() if n == 1}
    missing = [str(p) for p in modules() if not named(p, text, unique)]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_architecture_names_no_module_that_is_gone() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    gone = sorted({m for m in re.findall(r"`((?:p2p|nat|averaging|training)/[\w/]+\.py)`", text) if not (ROOT / m).exists()})
    assert not gone, f"docs/ARCHITECTURE.md names modules that do not exist: {gone}"


def test_cli_doc_has_every_command_and_option() -> None:
    """docs/CLI.md's reference section is the parser's own (`make docs` writes it): a command or an option
    added, renamed or re-explained without it fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / ".ci" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    text = (ROOT / "docs" / "CLI.md").read_text()
    assert reference.BEGIN in text, "docs/CLI.md has no reference section: run `make docs`"
    assert reference.updated(text) == text, "docs/CLI.md's reference is stale: run `make docs` and commit it"
    from training.commands import build_parser

    _, sub = build_parser()
    for name in sub.choices:
        assert f"### `dedloc {name}`" in text


#: names the docs quote from other projects (go-libp2p's resource manager), not from this code
FOREIGN_NAMES = {"libp2p.rcmgr", "libp2p.network.connection_pruner"}


def _code_text() -> str:
    files = [p for d in (*PACKAGES, "bench", "tests", "interop", ".ci") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".proto", ".mjs", ".sh") and "node_modules" not in p.parts]
    return "\n".join(p.read_text(errors="replace") for p in files) + (ROOT / "Makefile").read_text()


def test_every_name_the_docs_quote_is_still_in_the_code() -> None:
    """A class, function, setting or event the docs quote in backticks (`Averager.step`, `max_join_bytes`,
    `training_status`) that no file of the code names any more is a statement that stopped being true:
    renamed or gone. (Only names of four characters or more with an underscore, a dot or a capital:
    plain words in backticks are commands and values.)"""
    # the code's words, once: a name is there when it is one of them (as a \b-bounded search finds it;
    # a search of the whole text per name took 22 s of CI's cores)
    words = set(re.findall(r"\w+", _code_text()))
    stale: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?:\(\))?`", doc.read_text()):
            name = match.group(1)
            last = name.rsplit(".", 1)[-1]
            if len(last) < 4 or name in FOREIGN_NAMES or not re.search(r"[_.A-Z]", name):
                continue
            if last not in words:
                stale.setdefault(doc.name, set()).add(name)
    assert not stale, f"the docs quote names the code no longer has: {stale}"


def test_every_path_the_docs_quote_exists() -> None:
    """`p2p/dht/routing.py`, `bench/harness.py`: a quoted path (with a folder) that is gone is stale."""
    missing: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in re.finditer(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|md|proto|mjs|sh|toml|lock))`",
                                 doc.read_text()):
            path = match.group(1)
            if not (ROOT / path).exists() and not any((ROOT / d / path).exists() for d in (*PACKAGES, "docs")):
                missing.setdefault(doc.name, set()).add(path)
    assert not missing, f"the docs quote paths that are gone: {missing}"


#: options the docs quote of other tools (pip, pytest)
FOREIGN_OPTIONS = {"--no-cache-dir", "--no-deps", "--require-hashes", "--dist", "--durations", "--durations-min"}


def test_every_option_the_docs_quote_is_a_commands_or_a_benchs() -> None:
    """An option in the README or docs/ (`--report-every`, a bench's `--delays`) that neither a
    command (docs/CLI.md, generated from the parsers) nor a bench, CI or interop script takes any more."""
    known = set(re.findall(r"(--[a-z][a-z0-9-]*)", (ROOT / "docs" / "CLI.md").read_text()))
    scripts = [*(ROOT / "bench").glob("*.py"), *(p for p in (ROOT / ".ci").iterdir() if p.is_file()),
               *(ROOT / "interop" / "js").glob("*.mjs")]
    for script in scripts:
        known |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", script.read_text()))
    unknown: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        quoted = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", doc.read_text()))
        if quoted - known - FOREIGN_OPTIONS:
            unknown[doc.name] = quoted - known - FOREIGN_OPTIONS
    assert not unknown, f"the docs quote options nothing takes: {unknown}"
