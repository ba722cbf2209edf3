"""The suite's own rules (tests/ci_rules.py): the labs' group holds under ``make test``'s workers, at their priority."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_rules import SERIAL_GROUP, longest_first, time_summary, ungrouped

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[1]

LABS_AND_OTHERS = '''
import os
import time
import pytest

def report():
    print("priority", os.getpriority(os.PRIO_PROCESS, 0), "started", time.time())

@pytest.mark.lab
@pytest.mark.parametrize("i", range(4))
def test_lab(i):
    report()
    time.sleep(0.2)

@pytest.mark.parametrize("i", range(4))
def test_quick(i):
    report()
    time.sleep(0.5)

@pytest.mark.slow
@pytest.mark.parametrize("i", range(1))
def test_long(i):
    report()
    time.sleep(0.2)
'''


def test_the_labs_run_on_one_worker_under_make_test(tmp_path: Path) -> None:
    """The run ``make test`` makes (its workers, --dist loadgroup): every lab test on one worker, the id
    carrying the group (pytest 9.2 with xdist 3.8 spread them over both, silently: xdist#1386), at the
    normal priority, and every other test at the shared tests' lower one."""
    (tmp_path / "test_inner.py").write_text(LABS_AND_OTHERS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    make_test = re.search(r"^test:.*\n\t\$\(PY\) (-m pytest .*)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_test is not None
    workers = re.search(r"-n (\d+) --dist loadgroup", make_test.group(1))
    assert workers is not None, make_test.group(1)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_rules", "-p", "no:cacheprovider", "-v",
                             "-rA", "-n", workers.group(1), "--dist", "loadgroup",
                             "-W", "ignore::pytest.PytestUnknownMarkWarning"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    ran = re.findall(r"\[(gw\d)\] .*PASSED test_inner.py::test_lab\[\d\](@\w+)?", result.stdout)
    assert len(ran) == 4, result.stdout
    assert len({w for w, _ in ran}) == 1 and {g for _, g in ran} == {"@" + SERIAL_GROUP}
    assert "where the time went" in result.stdout and "serial line" in result.stdout
    seen = re.findall(r"_ (test_\w+)\[\d\]\S* _+\n(?:\[gw\d\] .*\n)?-+ Captured stdout call -+\n"
                      r"priority (\d+) started ([\d.]+)", result.stdout)
    assert len(seen) == 9, result.stdout
    # the slow test, collected last, went out first of the shared ones: it started before any quick one ended
    (long_start,) = [float(t) for name, _, t in seen if name == "test_long"]
    assert long_start < min(float(t) for name, _, t in seen if name == "test_quick") + 0.5, seen


def test_a_serial_test_without_its_group_in_its_id_is_named(pytester: pytest.Pytester) -> None:
    """What the workers check before they run anything: outside xdist no id carries a group, so every
    lab test is named, and no other."""
    pytester.makeini("[pytest]\nmarkers =\n  lab: a lab test\n  slow: a long test")
    items = pytester.getitems(LABS_AND_OTHERS)
    assert ungrouped(items) == [f"test_a_serial_test_without_its_group_in_its_id_is_named.py::test_lab[{i}]"
                                for i in range(4)]


def test_the_time_summary_splits_the_serial_line_from_the_shared_tests() -> None:
    def report(nodeid: str, duration: float, cpu: float | None = None) -> pytest.TestReport:
        return pytest.TestReport(nodeid, ("f.py", 0, "t"), {}, "passed", None, "call", duration=duration,
                                 user_properties=[] if cpu is None else [("cpu", cpu)])

    lines = time_summary([report("a.py::lab@serial", 30.0), report("a.py::lab@serial", 2.0, cpu=12.0),
                          report("b.py::quick", 5.0, cpu=4.0), report("c.py::lab2@serial", 10.0, cpu=3.0)])
    assert lines[0] == "serial line 42 s (2 tests, 15 s of CPU), shared 5 s (1 tests, 4 s of CPU): 47 s in all"
    assert lines[1].split() == ["32", "s", "a.py"] and lines[2].split() == ["10", "s", "c.py"]


def test_the_slow_shared_tests_go_out_first_after_the_serial_group(pytester: pytest.Pytester) -> None:
    """xdist hands single tests out in collection order: a minute-long test collected last ended
    every run on one worker while the other had nothing left."""
    pytester.makeini("[pytest]\nmarkers =\n  lab: a lab test\n  slow: a long test")
    items = pytester.getitems("""
import pytest
def test_quick(): pass
@pytest.mark.slow
def test_long(): pass
@pytest.mark.lab
def test_lab(): pass
def test_quick2(): pass
@pytest.mark.slow
def test_long2(): pass
""")
    assert [item.name for item in longest_first(items)] == ["test_lab", "test_long", "test_long2", "test_quick",
                                                            "test_quick2"]


def test_a_test_s_cpu_is_reported_with_its_seconds(pytester: pytest.Pytester) -> None:
    """A test that spins for 0.3 s reports ~0.3 s of CPU; one that sleeps as long, almost none."""
    pytester.makepyfile("""
import time
def test_spin():
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
def test_sleep():
    time.sleep(0.3)
""")
    result = pytester.runpytest("-p", "tests.ci_rules", "-p", "no:cacheprovider", "--junitxml=out.xml")
    result.assert_outcomes(passed=2)
    xml = (pytester.path / "out.xml").read_text()
    cpu = {name: float(value) for name, value in re.findall(r' name="test_(\w+)".*?<property name="cpu" value="([\d.]+)"',
                                                               xml, re.S)}
    assert cpu["spin"] >= 0.25 and cpu["sleep"] < 0.1, xml
