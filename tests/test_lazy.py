"""p2p/lazy.py: a package whose ``__init__`` names its exports imports each defining module on first
use only, once; a submodule is reached as an eager package would have it; a name it lacks is a plain
AttributeError, and a submodule's own missing import is not hidden behind one (the real packages'
start-up imports: tests/test_startup.py)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``lazypkg``: exports ``Thing`` from ``.things``, and has the submodules ``extra`` and ``broken``."""
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "__init__.py").write_text(
        "from p2p.lazy import exports\n"
        "EAGER = 1\n"
        "__getattr__, __dir__ = exports(__name__, {'Thing': '.things', 'Other': '.things'})\n")
    (root / "things.py").write_text("LOADS = []\nLOADS.append(1)\nclass Thing: pass\nclass Other: pass\n")
    (root / "extra.py").write_text("VALUE = 42\n")
    (root / "broken.py").write_text("import lazypkg_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "lazypkg"
    for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
        del sys.modules[name]


def test_an_export_is_imported_on_first_use_once_and_then_is_a_plain_attribute(package: str) -> None:
    pkg = importlib.import_module(package)
    assert f"{package}.things" not in sys.modules  # importing the package imported nothing more
    thing = pkg.Thing
    things = sys.modules[f"{package}.things"]
    assert thing is things.Thing and "Thing" in vars(pkg)
    assert pkg.Thing is thing and pkg.Other is things.Other and things.LOADS == [1]
    assert "Other" in vars(pkg)


def test_a_submodule_not_exported_is_imported_as_an_eager_package_would_have(package: str) -> None:
    pkg = importlib.import_module(package)
    assert pkg.extra.VALUE == 42 and pkg.extra is sys.modules[f"{package}.extra"]


def test_a_name_the_package_lacks_is_an_attribute_error_that_says_which(package: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError) as missing:
        pkg.nothing_here  # noqa: B018
    assert str(missing.value) == "module 'lazypkg' has no attribute 'nothing_here'"
    assert missing.value.__suppress_context__
    assert getattr(pkg, "nothing_here", "default") == "default"  # so getattr and hasattr work


def test_a_submodule_whose_own_import_fails_says_so_and_is_not_taken_for_a_missing_name(package: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.raises(ModuleNotFoundError) as failed:
        pkg.broken  # noqa: B018
    assert failed.value.name == "lazypkg_missing_dependency"


def test_dir_lists_what_is_loaded_and_what_is_exported_sorted(package: str) -> None:
    pkg = importlib.import_module(package)
    listed = dir(pkg)
    assert listed == sorted(listed) and {"EAGER", "Thing", "Other"} <= set(listed)
    assert f"{package}.things" not in sys.modules  # listing loads nothing
