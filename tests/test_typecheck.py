"""The four packages pass ``mypy --strict`` (configured in pyproject.toml).

The published API is typed (``py.typed``); a test keeps it so, since CI runs
the test suite and nothing else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)  # a cold cache: about 65 s on CI's 2 cores (torch's types; transformers is not followed)
@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_packages_pass_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
         "p2p", "nat", "averaging", "training"],
        cwd=ROOT, capture_output=True, text=True, timeout=380,
    )
    assert result.returncode == 0, result.stdout + result.stderr
