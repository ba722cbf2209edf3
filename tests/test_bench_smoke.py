"""The benchmark must keep running; its numbers are read by people, not asserted."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_throughput_bench_prints_ratios():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "throughput.py"), "--mib", "2", "--streams", "2", "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("tcp_1", "sealed_1", "node_1", "tcp_2", "node_2", "ratio_node_1", "ratio_sealed_2", "ratio_node_2", "relayed_1"):
        assert figures[key] > 0


def test_connect_latency_bench_prints_figures():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "connect_latency.py"), "--rounds", "2", "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["dedloc_connect_ms"] > 0 and figures["libp2p_connect_ms"] > 0


def test_tensor_roundtrip_bench_prints_figures():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tensor_roundtrip.py"), "--mib", "1", "--rounds", "2", "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tcp_ms"] > 0 and figures["node_ms"] > 0


def test_quic_bench_reports_a_figure_or_a_failure():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quic.py"), "--mib", "1", "--streams", "2", "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tcp_1"] > 0



def test_every_bench_script_imports_the_project_packages():
    """A script's own folder is first on sys.path: a bench/averaging.py must not hide the averaging package.

    Each script puts the repository root ahead of it; ``--help`` runs every top-level import.
    """
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert any(p.stem in {"averaging", "dht"} for p in scripts)
    for script in scripts:
        result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{script.name}: {result.stderr[-2000:]}"


def test_link_trace_reads_rates_per_host(tmp_path: Path) -> None:
    """bench/link_trace.py turns the core's byte counters into each host's up/down Mbit/s."""
    trace = tmp_path / "links.txt"
    lines = ["H p0=198.18.2.2 p1=198.18.3.2",
             "A 5: l1    inet 198.18.2.1/24 scope global l1",
             "A 6: l2    inet 198.18.3.1/24 scope global l2"]
    for i, (t, rx1, tx1, rx2, tx2) in enumerate([(0.0, 0, 0, 0, 0), (0.1, 1_250_000, 625_000, 0, 1_250_000),
                                                 (0.2, 1_250_000, 625_000, 0, 1_250_000)]):
        lines += [f"T {100 + t}", f"S l1 {rx1 * i} {tx1 * i}", f"S l2 {rx2 * i} {tx2 * i}"]
    trace.write_text("\n".join(lines) + "\n")
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "link_trace.py"), str(trace)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.strip().splitlines()
    assert header.split()[2:4] == ["p0", "p1"]
    assert len(rows) == 2
    assert rows[0].split()[1:] == ["100/50", "0/100"]  # p0: 100 Mbit up, 50 down; p1: 100 down
