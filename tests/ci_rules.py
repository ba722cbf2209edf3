"""The suite's own rules, loaded as a pytest plugin (pyproject's ``addopts = -p tests.ci_rules``).

* **A skip in CI is a failure** unless CI was told to expect it. ``.ci/run`` sets
  ``DEDLOC_NO_SKIPS=1``: there, a test that skips (the namespace lab unusable, miniupnpd
  missing, node 22 absent, no chromium) fails with its skip reason, so a broken probe can no
  longer turn a group of tests into quiet skips. :data:`EXPECTED_SKIPS` lists the reasons CI
  expects, each with why.
* **An xfail names the exception it expects** (``raises=``). pytest-trio hands a test's
  failure over inside an ``ExceptionGroup``; a group holding exactly one exception is unwrapped
  here for tests marked ``xfail(raises=...)``, so that ``raises=`` is checked against the
  failure itself and any other failure (a timeout, a dead peer) fails the test.
* **The labs one at a time.** ``make test`` runs the suite on pytest-xdist workers (two, one
  per core of CI's machine) with ``--dist loadgroup``: every test that builds namespace labs,
  talks to js-libp2p, or bounds real elapsed time (markers ``lab``, ``interop``, ``realtime``,
  or a lab's skip condition: the namespace lab's, miniupnpd's) goes in one group
  (:data:`SERIAL_GROUP`), which one worker runs in order, while the workers share the rest: two
  labs never share the machine, and the other tests run beside them. ``slow`` alone (long, on
  loopback) is not a reason to wait in that line: with every slow test in it, the group was the
  whole run's wall time (1,275 of 1,309 s) while the other worker idled. The group is written into
  each test's id by xdist; a pytest where that fails (9.2 with xdist 3.8) would spread the group
  silently, so a serial test whose id lacks it fails at setup instead (:class:`_GroupCheck`).
* **Two workers.** Three on the two cores, the shared tests at nice 10 so the serial line kept its
  core, ran in 15-16 minutes but starved shared tests that race real time (5 failed over two fresh
  clones): docs/TESTING.md has the runs.
* **Longest first.** xdist hands the biggest scope (the serial group) out first, then the single
  tests in collection order; the shared ``slow`` tests are moved to the front of that order, so the
  run does not end on one worker still in a minute-long test while the other has nothing left
  (the wheel's test, last in collection order, ended every run alone).
* **Where the time went.** The suite must stay under 20 minutes on CI's two cores; the end of a
  run says how many seconds the serial line and the shared tests took (setup, call and teardown),
  how much CPU they spent (the worker's and its reaped children's: a test whose seconds are mostly
  waiting shows here), and the files that cost the most (:func:`time_summary`), so a run over the
  budget names where. Each test's CPU also goes into the junit XML as its ``cpu`` property.
"""

from __future__ import annotations

import os
import resource
from collections import defaultdict
from collections.abc import Generator, Iterable

import pytest

#: set to 1 (.ci/run does) to fail every skip whose reason is not in EXPECTED_SKIPS
NO_SKIPS_ENV = "DEDLOC_NO_SKIPS"

#: skip reasons (substrings) that CI expects, and why
EXPECTED_SKIPS: dict[str, str] = {
    "needs a CUDA device": "CI's machine has no GPU; the GPU checks run on a lent GPU machine (the GPU issue)",
}


def _single_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    leaves = list(_leaves(group))
    return leaves[0] if len(leaves) == 1 else None


def _leaves(error: BaseException) -> Generator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


#: the xdist group of the tests that run one after another (see the module docstring)
SERIAL_GROUP = "serial"
SERIAL_MARKERS = ("lab", "interop", "realtime")
#: the skip reasons of the labs' conditions (tests/kit.py's requires_root_netns, test_port_mapping's needs_lab)
LAB_REASONS = ("netlab:", "miniupnpd lab:")


def serial(item: pytest.Item) -> bool:
    """Whether ``item`` runs in :data:`SERIAL_GROUP`: one of SERIAL_MARKERS, or a lab's skip condition."""
    if any(item.get_closest_marker(name) is not None for name in SERIAL_MARKERS):
        return True
    return any(str(mark.kwargs.get("reason", "")).startswith(LAB_REASONS) for mark in item.iter_markers("skipif"))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group into each test's id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if serial(item):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
    # xdist's workers collect with ``dist`` set to "no" and ``loadgroup`` set instead (xdist/remote.py)
    if getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup":
        items[:] = longest_first(items)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The serial group, then the shared ``slow`` tests, then the rest, each in collection order
    (a stable sort: every worker collects the same order, which xdist requires)."""
    def rank(item: pytest.Item) -> int:
        if serial(item):
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2
    return sorted(items, key=rank)


def ungrouped(items: Iterable[pytest.Item]) -> list[str]:
    """The serial tests whose id lacks ``@serial``: pytest-xdist's loadgroup reads a test's group from
    its id, which its worker rewrites during collection; a pytest whose ids it cannot rewrite (9.2,
    pytest-dev/pytest-xdist#1386) leaves every group spread over the workers, and says nothing."""
    return [item.nodeid for item in items if serial(item) and not item.nodeid.endswith("@" + SERIAL_GROUP)]


class _GroupCheck:
    """On a loadgroup worker: a serial test whose id lacks its group fails (see :func:`ungrouped`)
    instead of running beside whatever the other worker runs. (Refused at collection, a worker
    crashes, and xdist reports the crash without the reason.)"""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if ungrouped([item]):
            pytest.fail(f"--dist loadgroup is not grouping: {item.nodeid} lacks '@{SERIAL_GROUP}' in its id, so it "
                        f"would share the machine with another lab (pytest {pytest.__version__}; "
                        "pytest-dev/pytest-xdist#1386: pyproject.toml keeps pytest < 9.2)", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        config.pluginmanager.register(_GroupCheck(), "dedloc-group-check")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    try:
        return (yield)
    except BaseExceptionGroup as group:
        mark = item.get_closest_marker("xfail")
        leaf = _single_leaf(group)
        if mark is None or mark.kwargs.get("raises") is None or leaf is None:
            raise
        raise leaf from None


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def cpu_seconds() -> float:
    """This process's CPU time and its reaped children's (a test's subprocesses are reaped by its end)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_CPU_AT_START = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    item.stash[_CPU_AT_START] = cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                              pytest.TestReport]:
    report = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        report.user_properties.append(("cpu", round(cpu_seconds() - item.stash[_CPU_AT_START], 2)))
    if os.environ.get(NO_SKIPS_ENV, "") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return report
    reason = skip_reason(report)
    if any(expected in reason for expected in EXPECTED_SKIPS):
        return report
    report.outcome = "failed"
    report.longrepr = (f"skipped in a run that requires every test ({NO_SKIPS_ENV}=1): {reason}\n"
                       f"(a skip CI expects goes in tests/ci_rules.py EXPECTED_SKIPS, with why)")
    return report


def time_summary(reports: Iterable[pytest.TestReport], top: int = 8) -> list[str]:
    """Lines on where a run's time went: the serial line's seconds and the shared tests', each with
    its count and CPU, then the ``top`` costliest files (every phase of every test counted)."""
    lines: defaultdict[str, float] = defaultdict(float)
    cpu: defaultdict[str, float] = defaultdict(float)
    counts: dict[str, set[str]] = {"serial": set(), "shared": set()}
    files: defaultdict[str, float] = defaultdict(float)
    for report in reports:
        nodeid = report.nodeid
        line = "serial" if nodeid.endswith("@" + SERIAL_GROUP) else "shared"
        lines[line] += report.duration
        cpu[line] += sum(float(str(value)) for name, value in report.user_properties if name == "cpu")
        counts[line].add(nodeid)
        files[nodeid.split("::")[0]] += report.duration
    out = [f"serial line {lines['serial']:.0f} s ({len(counts['serial'])} tests, {cpu['serial']:.0f} s of CPU), shared "
           f"{lines['shared']:.0f} s ({len(counts['shared'])} tests, {cpu['shared']:.0f} s of CPU): "
           f"{sum(lines.values()):.0f} s in all"]
    costliest = sorted(files.items(), key=lambda item: -item[1])[:top]
    out += [f"{seconds:7.0f} s  {name}" for name, seconds in costliest]
    return out


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = [r for key in ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "")
               for r in terminalreporter.stats.get(key, []) if isinstance(r, pytest.TestReport)]
    if reports:
        terminalreporter.write_sep("=", "where the time went (tests/ci_rules.py)")
        for line in time_summary(reports):
            terminalreporter.write_line(line)
