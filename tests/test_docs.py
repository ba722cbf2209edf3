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
