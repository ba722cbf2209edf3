"""The layers keep their word: p2p < nat < averaging < training, with no exception.

Every module of every layer is parsed (``ast``, so imports inside functions
count too) and each import of one of the four packages must name this layer or
one below it. The ``dedloc`` entry point must sit in the highest layer that has
commands, and the repository's top-level folders are the design card's.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"p2p": 0, "nat": 1, "averaging": 2, "training": 3}
TOP_LEVEL = {"p2p", "nat", "averaging", "training", "tests", "interop", "bench", "docs"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in a file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_imports() -> list[str]:
    bad = []
    for layer, rank in RANK.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, module in imports_of(path):
                target = RANK.get(module.split(".")[0])
                if target is not None and target > rank:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_no_layer_imports_one_above_it() -> None:
    assert upward_imports() == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The rule itself works: a p2p module that imports nat is reported (also inside a function)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from nat.traversal import NatService\n    import training.x\n")
    assert [m for _, m in imports_of(module)] == ["nat.traversal", "training.x"]


def test_entry_point_sits_in_the_highest_layer_with_commands() -> None:
    """The entry point is the top layer's parser module (commands.py: parsers only, each command's code in
    its layer's cli.py, imported when it runs), and every layer with commands has both."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module = scripts["dedloc"].split(":")[0]
    with_commands = [layer for layer in RANK if (ROOT / layer / "commands.py").exists()]
    assert module.split(".")[0] == max(with_commands, key=RANK.__getitem__)
    assert module == f"{module.split('.')[0]}.commands"
    assert all((ROOT / layer / "cli.py").exists() for layer in with_commands)


def test_top_level_folders_are_the_design_cards() -> None:
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    # build outputs, and mutmut's working copy (make mutate; gitignored)
    ignored = {"__pycache__", "build", "dist", "mutants"} | {p.name for p in ROOT.glob("*.egg-info")}
    assert folders - ignored - {"shared"} == TOP_LEVEL
