"""The benchmark must keep running; its numbers are read by people, not asserted."""

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from p2p.forkserver import Forks, script_argv
from tests.forks import BENCH, ENV as FORKS_ENV, python_argv
from tests.kit import requires_root_netns

ROOT = Path(__file__).resolve().parent.parent
#: What the module's fork server imports (tests/conftest.py ``forks``): torch, the four packages, the NAT agent.
FORKS_PRELOAD = BENCH


@pytest.fixture(autouse=True)
def forked_workers(forks: Forks) -> None:
    """Every bench here and the workers it starts are forked from the module's server ($DEDLOC_FORKS:
    bench/harness.py ``python_argv``), not fresh interpreters: ~0.2 s of CPU each, not 3-4 s. A smoke
    reads no figure a process's start would change; ``tests/bench_help.py`` (each script's own
    imports) and a process's memory run fresh."""


def bench(script: str, *args: str) -> list[str]:
    """``python bench/SCRIPT ARGS``, forked from the module's server."""
    return python_argv([sys.executable, str(ROOT / "bench" / script), *args])


def test_throughput_bench_prints_ratios():
    result = subprocess.run(
        bench("throughput.py", "--mib", "2", "--streams", "2", "--json"),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("tcp_1", "sealed_1", "node_1", "tcp_2", "node_2", "ratio_node_1", "ratio_sealed_2", "ratio_node_2", "relayed_1"):
        assert figures[key] > 0


def test_connect_latency_bench_prints_figures():
    result = subprocess.run(
        bench("connect_latency.py", "--rounds", "2", "--json"),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["dedloc_connect_ms"] > 0 and figures["libp2p_connect_ms"] > 0


def test_tensor_roundtrip_bench_prints_figures():
    result = subprocess.run(
        bench("tensor_roundtrip.py", "--mib", "1", "--rounds", "2", "--json"),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tcp_ms"] > 0 and figures["node_ms"] > 0


def test_quic_bench_reports_a_figure_or_a_failure():
    result = subprocess.run(
        bench("quic.py", "--mib", "1", "--streams", "2", "--json"),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tcp_1"] > 0



@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_every_bench_script_imports_the_project_packages():
    """A script's own folder is first on sys.path: a bench/averaging.py must not hide the averaging package.

    Each script puts the repository root ahead of it; ``--help`` runs every top-level import.
    All in one process (tests/bench_help.py), as ``python bench/<script>.py`` runs each: a process
    per script took 64 s of CI's two cores, mostly torch's import 43 times.
    """
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert any(p.stem in {"averaging", "dht"} for p in scripts)
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "bench_help.py")], capture_output=True,
                            text=True, timeout=110, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["scripts"] == len(scripts)
    assert report["failed"] == [], report["failed"]


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


@pytest.mark.slow
def test_gpu_training_bench_runs_on_a_cpu(tmp_path: Path) -> None:
    """bench/gpu_training.py's three setups with a tiny model on the CPU: the figures the issue reads exist."""
    out = tmp_path / "gpu.json"
    command = bench("gpu_training.py", "--device", "cpu", "--size", "tiny", "--micro", "8", "--seq", "16", "--target",
                    "32", "--steps", "2", "--dpu-steps", "3", "--json", str(out))
    # No second try: the failures once in a few runs are mended, not retried: a peer that caught up by
    # taking the swarm's state reached its last step with nothing measured (mended in the bench), and a
    # peer whose DHT reads came back with only its own report read a swarm of one and stepped alone,
    # so the synchronous setup measured no round (training/progress.py's merge_reports: 24 of 24 runs
    # measured their rounds, 3 in parallel, where 1 in 6 had not)
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    figures = json.loads(out.read_text())
    assert figures["allreduce_mb_per_s"] > 0
    assert 0 < figures["dpu"]["compute_fraction"] <= 1 and figures["dpu"]["ratio_to_alone"] > 0
    assert len(figures["dpu"]["losses"]) >= 2 and figures["sync"]["incomplete_rounds"] == 0
    # where a step's time outside compute went: the GPU's third run could not tell (docs/AVERAGING.md)
    for mode in ("alone", "sync", "dpu"):
        assert figures[mode]["global_step_s"] > 0 and figures[mode]["data_per_step_s"] >= 0, figures[mode]
    assert figures["dpu"]["step_calls_per_step_s"] > 0 and figures["dpu"]["step_call_median_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_moe_bench_writes_the_goals_figures(tmp_path: Path) -> None:
    """bench/moe.py, dedloc's side, small: the figures the issue reads exist, and no call ran past its timeout."""
    out = tmp_path / "moe.json"
    result = subprocess.run(
        bench("moe.py", "--systems", "dedloc", "--experts", "16,36", "--servers", "5", "--searches", "3", "--seconds",
              "1", "--repeats", "1", "--json", str(out)),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert not figures["failed_runs"], figures["failed_runs"]
    dedloc = figures["dedloc"]
    assert dedloc["search_p99_ms"] > 0 and dedloc["calls_per_s"] > 0 and dedloc["nop_calls_per_s"] > 0
    assert dedloc["calls_past_timeout"] == 0
    assert figures["cases"]["36_experts"]["dedloc"]["found_per_search"] == 64


@pytest.mark.slow
@pytest.mark.realtime  # its calls' timeouts and bans are wall-clock: alone, not beside a lab (tests/ci_rules.py)
@pytest.mark.timeout(320)  # the run's own limit, not pytest's 120 s hang guard
def test_moe_convergence_bench_writes_curves_and_a_gap(tmp_path: Path) -> None:
    """bench/moe_convergence.py on loopback, tiny: trainers through remote experts, a server killed at
    half, the dense baseline; the curves and the gap exist (the accuracies are read by people)."""
    figures = run_bench(tmp_path, "moe_convergence.py", "--trainers", "2", "--steps", "45", "--timeout", "240",
                        timeout=300)
    assert figures["dmoe"]["curve"] and figures["dense"]["curve"] and figures["dmoe"]["killed_at_samples"]
    assert isinstance(figures["gap"], float) and 0 < figures["dmoe"]["final"]["accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.timeout(420)  # the run's own limit, not pytest's 120 s hang guard
def test_moe_latency_bench_writes_the_ratio(tmp_path: Path) -> None:
    """bench/moe_latency.py, tiny, in the lab (root): one process, DMoE at 0 and 50 ms, the ratio."""
    from nat.lab import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    figures = run_bench(tmp_path, "moe_latency.py", "--delays", "0,50", "--seconds", "3", "--concurrency", "16",
                        timeout=400)
    assert figures["dmoe"]["0ms"]["samples_per_s"] > 0 and figures["dmoe"]["0ms"]["failed_batches"] == 0
    assert figures["latency"]["ratio_50ms_to_0ms"] > 0


@pytest.mark.slow
@pytest.mark.lab
@pytest.mark.timeout(420)  # the run's own limit, not pytest's 120 s hang guard
def test_datasets_bench_moves_a_dataset_and_survives_its_faults(tmp_path: Path) -> None:
    """bench/datasets.py, tiny, in the lab (root): dedloc (libtorrent's venv is the bench's own), one NATed peer
    of three, a lying seeder and a killed one; the keys the issue names."""
    import os

    from nat.lab import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None and os.environ.get("DEDLOC_NETLAB_REQUIRED", "") in ("", "0"):
        pytest.skip(reason)
    os.environ["DEDLOC_BENCH_DATA"] = str(tmp_path / "work")
    try:
        figures = run_bench(tmp_path, "datasets.py", "--peers", "3", "--nat-peers", "1", "--mbytes", "6",
                            "--shards", "3", "--piece-kib", "256", "--peer-up", "40", "--peer-down", "80",
                            "--seeder-up", "80", "--systems", "dedloc", "--timeout", "120", timeout=400)
    finally:
        del os.environ["DEDLOC_BENCH_DATA"]
    assert figures["dedloc.last_peer_s"] > 0 and figures["bound_s"] > 0 and figures["dedloc"]["completed"] == 3
    assert figures["corrupt.bad_bytes_delivered"] == 0 and figures["corrupt"]["completed"] == 3
    assert list(figures["corrupt"]["banned_by"].values()) == [3]  # every peer named the lying seeder
    assert figures["kill.completed"] == 3


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as a module, by its path (bench/averaging.py's name is the averaging package's),
    with the bench folder's modules (its harness) importable beside it, as when it runs as a script."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
        del sys.modules[spec.name]
    return module


def run_bench(tmp_path: Path, script: str, *args: str, timeout: float) -> dict:  # type: ignore[type-arg]
    """Run bench/<script> with ``args`` and ``--json``; what it wrote (its output in the failure)."""
    out = tmp_path / "figures.json"
    result = subprocess.run(bench(script, *args, "--json", str(out)),
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures: dict = json.loads(out.read_text())  # type: ignore[type-arg]
    return figures


def test_rejoin_bench_times_each_peer_back_after_a_restart(tmp_path: Path) -> None:
    """bench/rejoin.py with 4 peers, the bootstrap node down 1 s, once without jitter and once with."""
    figures = run_bench(tmp_path, "rejoin.py", "--peers", "4", "--down", "1", "--repeats", "1", "--jitters", "0,0.5",
                        timeout=120)
    assert set(figures["jitters"]) == {"0.0", "0.5"}
    for summary in figures["jitters"].values():
        assert summary["runs"][0]["back"] == 4, summary  # every peer came back by itself
        assert 1 <= summary["burst_per_100ms"]["min"] <= 4 and summary["all_back_s"]["min"] < 30, summary


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_departed_peer_bench_counts_the_relay_s_connects_both_ways() -> None:
    """bench/departed_peer.py at 8 s (17 s of wall time, under a second of CPU: it mostly waits)."""
    result = subprocess.run(bench("departed_peer.py", "--seconds", "8", "--every", "2", "--json"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for run in ("backoff", "no_backoff"):
        assert figures[run]["attempts"] >= 3 and figures[run]["connects_at_relay"] >= 1, figures
    assert "ratio_connects" in figures


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_relay_soak_bench_serves_its_visitors_and_reads_the_relay(tmp_path: Path) -> None:
    """bench/relay_soak.py with 12 visitors, ``--dht``: each served whole (identify, a reservation, a
    record stored through the relay and read back), the relay's memory and peer store read along the
    way, the relay alive at the end. One at a time: with visitors living a second each, a record
    stored only at visitors that left can be gone when it is read (9 of 10,000 at 6 at once), which
    is the churn, not the relay."""
    out = tmp_path / "soak.json"
    result = subprocess.run(bench("relay_soak.py", "--visitors", "12", "--every", "6", "--concurrency", "1", "--dht",
                                  "--json", str(out)), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["served"] == 12 and figures["relay_exit_code"] is None, figures
    assert len(figures["samples"]) == 4 and figures["peer_store_max"] >= 12 and figures["rss_mib"]["max"] > 0


@pytest.mark.slow
@requires_root_netns
def test_nat_verdict_bench_times_each_nat_kind(tmp_path: Path, forks: Forks) -> None:
    """bench/nat_verdict.py, one round; its agents and relays (tests/test_nat_matrix.py's) forked from
    the test's fork server ($DEDLOC_FORKS, which the bench's processes inherit)."""
    figures = run_bench(tmp_path, "nat_verdict.py", "--rounds", "1", timeout=240)
    assert set(figures) == {"SYMMETRIC", "EIM_CHANGING", "EIM_PRESERVING"}
    assert all(row["no_verdict"] == 0 and row["median_s"] is not None for row in figures.values()), figures


def test_moe_bench_ratios_are_n_a_where_a_figure_was_not_measured() -> None:
    """bench/moe.py with one grid size measures no ffn calls: its ratio is n/a, not a ZeroDivisionError
    after every figure was measured (``--experts 144 --servers 12`` died so)."""
    moe = load_bench("moe")
    assert moe.ratio(2.0, 4.0) == 0.5 and moe.ratio(None, 4.0) is None and moe.ratio(2.0, 0.0) is None
    assert moe.shown(None, 2) == "n/a" and moe.shown(0.8333, 2) == "0.83"


@pytest.mark.timeout(200)  # the run's own limit, not pytest's 120 s hang guard
@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_scale_bench_runs_a_few_hundred_peers_within_a_minute(tmp_path: Path) -> None:
    """bench/scale.py at CI's size (150 peers, 125 in Moshpit: 300 took 49 s of CPU, this 30): the DHT simulation with and without the reply timer and with the
    calibration's twin of go-libp2p-kad-dht's rules, Moshpit's cases, matchmaking over the
    simulated DHT, records kept through churn with and without replication, and the JSON keys the
    scale issue's goals are read from."""
    out = tmp_path / "scale.json"
    result = subprocess.run(
        bench("scale.py", "--peers", "150", "--stores", "30", "--gets", "60", "--settle", "60", "--rules",
              "dedloc,kad-dht-2022", "--moshpit-peers", "125", "--group-size", "5", "--moshpit-rounds", "10",
              "--survive", "300", "--json", str(out)),
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["dht.peers"] == 150 and 0 < figures["dht.lookup_p50_s"] <= figures["dht.lookup_p95_s"]
    assert figures["dht.store_replicas_median"] >= 15 and figures["dht.stalled_lookups"] >= 0
    assert figures["moshpit.rounds_to_1e-6"] is not None and figures["moshpit.peers"] == 125
    assert 0 <= figures["moshpit.without_group"] < 0.5
    assert [(r["rules"], r["reply_timer"]) for r in figures["dht"] + figures["before"]] == \
        [("dedloc", True), ("kad-dht-2022", True), ("dedloc", False)]
    assert "| 150 | dedloc | on |" in result.stdout and "| 150 peers, kad-dht-2022 |" in result.stdout
    assert "IPFS" in result.stdout and "random groups of m" in result.stdout
    kept = {r["replication"]: r for r in figures["survival"]}
    assert kept[True]["handed_over_per_record_hour"] > 0 == kept[False]["handed_over_per_record_hour"]
    assert [round(s["t_s"]) for s in kept[True]["snapshots"]] == [0, 300]
    assert "records kept through churn (150 peers" in result.stdout


@pytest.mark.slow  # ≥ 15 s in CI: handed out early (tests/ci_rules.py longest_first)
def test_prefix_freshness_bench_finds_the_path_copies_misses_and_none_now(tmp_path: Path) -> None:
    """bench/prefix_freshness.py at 150 peers (9 s): on the same simulated network, first-copy reads of
    an expert prefix miss servers when reads leave copies of dictionaries on their path (the DHT
    before), and none now."""
    figures = run_bench(tmp_path, "prefix_freshness.py", "--peers", "150", "--servers", "8", "--join-every", "5",
                        timeout=120)
    runs = {r["mode"]: r for r in figures["runs"]}
    assert list(runs) == ["first copy, the DHT now", "first copy, as before", "first copy, no path copies",
                          "merged (latest)"]
    assert all(r["reads"] > 300 for r in runs.values())
    assert runs["first copy, as before"]["reads_missing"] > 0
    assert runs["first copy, the DHT now"]["reads_missing"] == runs["merged (latest)"]["reads_missing"] == 0



@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_gpu_session_script_runs_its_steps_at_cpu_sizes(tmp_path: Path) -> None:
    """bench/gpu_session.sh, the one prepared run of a lent GPU machine, with this interpreter's packages
    and at CPU sizes: each step's command still takes the options the script gives it (a bench's renamed
    option fails here, not in the machine's 15 minutes), each writes what the GPU issue reads, and all of
    it comes back packed in one file (a device call returns at most 8). Not the tests steps: on a CPU
    they run selections of their own (the GPU's name CUDA tests), and the suite runs those tests anyway.
    Its benches and their workers are forked from the module's server (132 s in CI with fresh
    interpreters, ~60 of it importing torch in each)."""
    import os
    import tarfile

    out, work = tmp_path / "out", tmp_path / "work"
    steps = ("env", "allreduce", "allreduce-loop", "noise-threads", "moe", "moe-profile", "diagnose")
    # its "$PY": a bench script forked from the module's server (the fork client's command less the
    # script), anything else (-c) this interpreter
    python, client = tmp_path / "python", shlex.join(script_argv(os.environ[FORKS_ENV], "-")[:-1])
    python.write_text(f'#!/bin/sh\ncase "$1" in *.py) exec {client} "$@";; esac\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, OUT=str(out), GPU_SESSION_WORK=str(work), PYTHON=str(python), GPU_SESSION_DEVICE="cpu",
               GPU_SESSION_INSTALL="0", GPU_SESSION_MOE_SYSTEMS="dedloc")
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), *steps],
                            env=env, capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    ran = [*(s for s in steps if s != "diagnose"), "round-cpu-1"]  # diagnose: a step per config, one on a CPU
    assert all(f"{step} rc=0" in summary for step in ran), summary
    assert sorted(p.name for p in out.iterdir()) == ["session.tgz", "summary.txt"]
    with tarfile.open(out / "session.tgz") as packed:
        names = set(packed.getnames())
    assert {"./allreduce_speed.json", "./allreduce_loop.json", "./moe_gpu.json", "./moe-profile.txt"} <= names
    # allreduce_speed: dedloc's round beside the data plane and gloo at 2 peers (as on the GPU), the keys the issue reads
    speed = json.loads((work / "allreduce_speed.json").read_text())
    assert speed["two_peers"]["seconds"] > 0 and speed["two_peers"]["ratio_to_data_plane"] > 0
    assert speed["data_plane_mb_per_s"] > 0 and "four_peers_40mb" not in speed  # only from a 40 MB run
    assert [case["peers"] for case in speed["cases"]] == [2], speed["cases"]
    for case in speed["cases"]:
        assert case["dedloc"]["rounds"] == 1 and case["dedloc"]["max_error"] < 1e-4, case
        assert case["gloo"]["median_s"] > 0
    assert json.loads((work / "allreduce_loop.json").read_text())["crypto_threads"] == 0
    hops = json.loads((work / "noise_threads.json").read_text())["cases"]
    assert [(c["kib"], c["threads"]) for c in hops] == [(256, 0), (256, 1)] and all(c["latency_us"] > 0 for c in hops)
    # moe_gpu: a server process and two client processes started together, then the server as two
    # processes (--server-processes: each hosting half of the experts, the clients calling each at its own)
    moe = json.loads((work / "moe_gpu.json").read_text())
    run = moe["cases"]["16"]["dedloc"]["runs"][0]
    assert moe["dedloc"]["samples_per_s"] > 0 and run["failed"] == 0 and run["module"] != "Identity"
    split = moe["cases"]["16"]["dedloc x2"]["runs"][0]
    assert moe["dedloc x2"]["samples_per_s"] > 0 and split["failed"] == 0 and split["server_processes"] == 2
    nop = json.loads((work / "moe_profiled.json").read_text())["cases"]["16"]["dedloc"]["runs"][0]
    assert nop["failed"] == 0 and nop["module"] == "Identity"  # the profiled run: the nop experts
    assert "ncalls" in (work / "moe-profile.txt").read_text()  # the server's loop was profiled
    # diagnose: one host-tensor config on a CPU (the loop over configs runs; each is a round's run), checked
    case = json.loads((work / "round_cpu_1.json").read_text())["cases"][0]
    assert case["dedloc"]["rounds"] == 1 and case["dedloc"]["max_error"] < 1e-4 and case["mb_per_s"] > 0, case
    assert [p.name for p in work.glob("round_*.json")] == ["round_cpu_1.json"]


@pytest.mark.slow
def test_the_reliability_bench_kills_and_restarts_peers_and_counts_every_round(tmp_path: Path) -> None:
    """bench/averaging.py's reliability setup end to end, tiny (3 peers on loopback, 5 rounds, a kill
    whenever three are live): real processes SIGKILLed a moment into a round and started again a few
    rounds later, every round counted as complete, partial (reported) or failed, none silently wrong,
    and the spared peer's memory series read."""
    figures = run_bench(tmp_path, "averaging.py", "--systems", "dedloc", "--setups", "reliability",
                        "--reliability-peers", "3", "--reliability-rounds", "5", "--kill-rate", "1.0",
                        "--reliability-max-s", "240", "--log-dir", str(tmp_path / "logs"), timeout=300)
    counts = figures["reliability"]["dedloc"]
    assert counts["rounds"] == 5 and counts["kills"] >= 1, counts
    assert counts["silently_wrong"] == 0 and counts["complete"] >= 1, counts
    assert counts["complete"] + counts["partial_reported"] + counts["failed"] == 5, counts
    assert counts["memory"]["workers"] >= 1 and counts["memory"]["mib_at_end_max"] > 0, counts["memory"]


def test_the_reliability_soak_counts_child_processes_and_fits_the_growth_after_the_warm_up() -> None:
    """bench/averaging.py's memory figures (hivemind #654): a peer's private memory counts its child
    processes' (hivemind's Go daemon, its forked DHT and averager), and the growth is fitted over the
    rounds after the warm-up, of the workers that lived through the run only."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from averaging_data import tree_uss_mib; import subprocess; "
            "before = tree_uss_mib(); "
            "child = subprocess.Popen([sys.executable, '-c', 'import sys, time; b = bytearray(64 << 20); "
            "sys.stdout.write(chr(10)); sys.stdout.flush(); time.sleep(30)'], stdout=subprocess.PIPE); "
            "child.stdout.readline(); print(tree_uss_mib() - before, tree_uss_mib(child.pid)); child.kill()")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    added, child = map(float, result.stdout.split())
    assert added >= 60 and child >= 60, result.stdout  # the child's 64 MiB are in the parent's tree, and its own
    memory_growth = load_bench("averaging").memory_growth
    series = {0: [(r, 100.0 + (50.0 if r < 10 else 0.02 * r)) for r in range(100)],  # a warm-up jump, then 2/100
              1: [(r, 500.0 + 10 * r) for r in range(40)]}  # killed at round 40: not counted
    grown = memory_growth(series, 100)
    assert grown["workers"] == 1 and grown["warm_round"] == 10
    assert grown["mib_per_100_rounds_median"] == pytest.approx(2.0) and grown["mib_at_end_max"] == pytest.approx(102.0)


def test_moe_gpu_bench_reports_a_side_that_fails_and_keeps_the_other_s_figures(tmp_path: Path) -> None:
    """bench/moe_gpu.py when one side's workers die (on the H200, hivemind's client at 1024 rows, 2026-12-04):
    each case is tried --attempts times, the failures are in the figures, the other side's still stand, a
    side that failed every attempt at a size is not tried again at that size (on the H200's third run a
    hang of hivemind's side at 1024 rows took the step's whole limit), and the run exits non-zero only
    after writing them."""
    out = tmp_path / "figures.json"
    result = subprocess.run(bench("moe_gpu.py", "--device", "cpu", "--hidden", "64", "--experts", "2", "--batches", "16",
                                  "--clients", "1", "--callers", "1", "--seconds", "1", "--repeats", "2", "--timeout",
                                  "60", "--python-hivemind", "/bin/false", "--json", str(out)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "every attempt failed" in result.stderr, result.stdout[-2000:] + result.stderr
    figures = json.loads(out.read_text())
    case = figures["cases"]["16"]
    assert figures["dedloc"]["samples_per_s"] > 0 and [r["failed"] for r in case["dedloc"]["runs"]] == [0, 0]
    assert len(case["hivemind"]["failures"]) == 2 and "samples_per_s" not in case["hivemind"], case["hivemind"]
    assert "ratio" not in case and figures["failed_attempts"] == {"hivemind at 16 rows": 2}
    assert "FAILED 2 times" in result.stdout and "hivemind  #2: not tried" in result.stdout, result.stdout
