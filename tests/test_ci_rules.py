"""The suite's own rules (tests/ci_rules.py): the labs' group holds under ``make test``'s two workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_rules import SERIAL_GROUP, time_summary, ungrouped

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[1]

LABS_AND_OTHERS = '''
import time
import pytest

@pytest.mark.lab
@pytest.mark.parametrize("i", range(4))
def test_lab(i):
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(4))
def test_quick(i):
    time.sleep(0.2)
'''


def test_the_labs_run_on_one_worker_under_make_tests_two(tmp_path: Path) -> None:
    """The run ``make test`` makes (two workers, --dist loadgroup): every lab test on one worker, the id
    carrying the group (pytest 9.2 with xdist 3.8 spread them over both, silently: xdist#1386)."""
    (tmp_path / "test_inner.py").write_text(LABS_AND_OTHERS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_rules", "-p", "no:cacheprovider", "-v",
                             "-n", "2", "--dist", "loadgroup", "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    workers = re.findall(r"\[(gw\d)\] .*PASSED test_inner.py::test_lab\[\d\](@\w+)?", result.stdout)
    assert len(workers) == 4, result.stdout
    assert {w for w, _ in workers} in ({"gw0"}, {"gw1"}) and {g for _, g in workers} == {"@" + SERIAL_GROUP}
    assert "where the time went" in result.stdout and "serial line" in result.stdout


def test_a_serial_test_without_its_group_in_its_id_is_named(pytester: pytest.Pytester) -> None:
    """What the workers check before they run anything: outside xdist no id carries a group, so every
    lab test is named, and no other."""
    pytester.makeini("[pytest]\nmarkers = lab: a lab test")
    items = pytester.getitems(LABS_AND_OTHERS)
    assert ungrouped(items) == [f"test_a_serial_test_without_its_group_in_its_id_is_named.py::test_lab[{i}]"
                                for i in range(4)]


def test_the_time_summary_splits_the_serial_line_from_the_shared_tests() -> None:
    def report(nodeid: str, duration: float) -> pytest.TestReport:
        return pytest.TestReport(nodeid, ("f.py", 0, "t"), {}, "passed", None, "call", duration=duration)

    lines = time_summary([report("a.py::lab@serial", 30.0), report("a.py::lab@serial", 2.0),
                          report("b.py::quick", 5.0), report("c.py::lab2@serial", 10.0)])
    assert lines[0] == "serial line 42 s (2 tests), shared 5 s (1 tests): 47 s in all"
    assert lines[1].split() == ["32", "s", "a.py"] and lines[2].split() == ["10", "s", "c.py"]
