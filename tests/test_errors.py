"""One hierarchy of errors: every public exception of the four packages is a :class:`DedlocError`, and
bad settings raise :class:`ConfigError` in every layer (an app catches both at its edge)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from p2p.errors import ConfigError, DedlocError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2p", "nat", "averaging", "training")


def _modules() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name == "__main__.py":
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def test_every_public_exception_is_a_dedloc_error() -> None:
    outside = []
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name
                    and not attr.startswith("_") and not issubclass(value, DedlocError)):
                outside.append(f"{name}.{attr}")
    assert not outside, f"public exceptions outside DedlocError: {outside}"


def _bare_value_errors_in_settings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("validate", "__post_init__"):
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) and isinstance(sub.exc.func, ast.Name)
                        and sub.exc.func.id in ("ValueError", "TypeError", "Exception", "RuntimeError")):
                    found.append(f"{path.relative_to(ROOT)}:{sub.lineno} {sub.exc.func.id}")
    return found


def test_settings_are_refused_with_config_error_in_every_layer() -> None:
    """A config's ``validate``/``__post_init__`` raises :class:`ConfigError` (a ValueError too), never a bare one."""
    found = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for hit in _bare_value_errors_in_settings(path)]
    assert not found, f"bare errors for bad settings: {found}"


def test_bad_settings_of_each_layer_are_config_errors(tmp_path: Path) -> None:
    from averaging.robust import CenteredClipConfig
    from training.data import ShardSource  # noqa: F401  (the layer's reader; DataError is its refusal)
    from training.data import DataError
    from training.moe.grid import expand_pattern

    with pytest.raises(ConfigError, match="tau must be positive"):
        CenteredClipConfig(tau=-1.0).validate()
    with pytest.raises(ConfigError, match="expert pattern"):
        expand_pattern("bad[")
    assert issubclass(DataError, ConfigError)
