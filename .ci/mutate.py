"""`make mutate`: mutation testing of the pure decision modules with mutmut, scored per module.

mutmut (the maintained tool: mutants as trampolines, each mutant run only against the tests
that reach the function it changed) reads what to mutate from pyproject.toml's [tool.mutmut];
this script runs it, counts each module's mutants by outcome and prints the table that
docs/TESTING.md keeps. A mutant is *killed* when a test fails on it or it runs past mutmut's
timeout (an infinite loop caught); *survived* and *no tests* both count against the module.

    .venv/bin/python .ci/mutate.py [--goal 0.9] [--json OUT] [--survivors]

Exit status 1 when a module scores under the goal (the issue's 90%), 2 when pyproject.toml's
list and MODULES disagree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTMUT = ROOT / ".venv" / "bin" / "mutmut"

#: module -> the fast tests that guard it (the union is pyproject's pytest_add_cli_args_test_selection)
MODULES: dict[str, tuple[str, ...]] = {
    "averaging/formation.py": ("tests/test_formation.py", "tests/test_averaging_core.py"),
    "averaging/partition.py": ("tests/test_averaging_core.py", "tests/test_partition.py"),
    "averaging/reduction.py": ("tests/test_averaging_core.py", "tests/test_reduction.py", "tests/test_robust.py"),
    "averaging/robust.py": ("tests/test_robust.py",),
    "training/policy.py": ("tests/test_training_policy.py",),
    "training/accumulator.py": ("tests/test_accumulator.py",),
    "training/datasets/manifest.py": ("tests/test_datasets.py",),
    "nat/reachability.py": ("tests/test_nat_decisions.py",),
    "p2p/admission.py": ("tests/test_admission_decisions.py",),
    "p2p/resources.py": ("tests/test_resources_decisions.py",),
    "p2p/dht/records.py": ("tests/test_dht_records.py",),
    "p2p/dht/routing.py": ("tests/test_dht_routing.py",),
    "p2p/dht/traversal.py": ("tests/test_dht_traversal.py",),
    "p2p/dht/serving.py": ("tests/test_dht_serving.py",),
    "p2p/dht/replication.py": ("tests/test_dht_replication.py", "tests/test_dht_maintenance.py"),
    "p2p/dht/maintenance.py": ("tests/test_dht_maintenance.py",),
    "training/moe/calls.py": ("tests/test_moe_calls.py",),
    "training/moe/protocol.py": ("tests/test_moe_calls.py",),
    "training/moe/shards.py": ("tests/test_moe_shards.py",),
    "p2p/dial_backoff.py": ("tests/test_dial_backoff.py",),
    "p2p/conn_manager.py": ("tests/test_conn_manager.py",),
    "p2p/peer_store.py": ("tests/test_peer_store.py",),
    "training/datasets/picker.py": ("tests/test_picker.py",),
    "training/contributions.py": ("tests/test_contributions.py",),
    "averaging/load_balancing.py": ("tests/test_load_balancing.py",),
    "averaging/bandwidth.py": ("tests/test_bandwidth.py",),
    "p2p/addresses.py": ("tests/test_addresses.py",),
    "averaging/serial.py": ("tests/test_serial.py",),
    "averaging/compression.py": ("tests/test_averaging_core.py", "tests/test_serial.py"),
    "averaging/moshpit.py": ("tests/test_moshpit.py",),
    "training/progress.py": ("tests/test_training_progress.py",),
    "training/datasets/pieces.py": ("tests/test_pieces.py",),
    "p2p/rpc/framing.py": ("tests/test_rpc_framing.py",),
    "p2p/observed.py": ("tests/test_observed.py",),
    "training/moe/grid.py": ("tests/test_moe_grid.py",),
    "averaging/finite.py": ("tests/test_averaging_core.py", "tests/test_serial.py"),
    "averaging/group.py": ("tests/test_group.py",),
    "p2p/multistream.py": ("tests/test_multistream.py",),
    "nat/port_mapping/natpmp.py": ("tests/test_port_mapping_codecs.py",),
    "nat/port_mapping/pcp.py": ("tests/test_port_mapping_codecs.py",),
    "p2p/yamux.py": ("tests/test_yamux.py",),
    "p2p/noise.py": ("tests/test_noise.py",),
    "nat/delay_line.py": ("tests/test_delay_line.py",),
    "p2p/identity.py": ("tests/test_identity.py",),
    "training/data.py": ("tests/test_training_data.py",),
    "p2p/peer_exchange.py": ("tests/test_peer_exchange.py",),
    "nat/autonat.py": ("tests/test_autonat.py",),
    "p2p/auth.py": ("tests/test_auth.py",),
    "p2p/authority.py": ("tests/test_auth.py",),
    "nat/relay.py": ("tests/test_relay.py", "tests/test_nat_decisions.py"),
    "nat/circuit.py": ("tests/test_relay.py",),
    "p2p/dialer.py": ("tests/test_dialer.py",),
    "nat/holepunch.py": ("tests/test_holepunch_rounds.py",),
    "nat/port_mapping/upnp.py": ("tests/test_port_mapping_codecs.py", "tests/test_upnp.py"),
    "averaging/wire.py": ("tests/test_averaging_wire.py",),
    "training/state.py": ("tests/test_state_protocol.py",),
    "nat/autorelay.py": ("tests/test_autorelay.py",),
    "p2p/wire.py": ("tests/test_p2p_wire.py",),
    "p2p/varint.py": ("tests/test_varint.py",),
    "p2p/errors.py": ("tests/test_p2p_errors.py",),
    "p2p/trio_util.py": ("tests/test_trio_util.py",),
    "p2p/untrusted.py": ("tests/test_untrusted.py", "tests/test_addresses.py"),
    "averaging/tensor_stream.py": ("tests/test_tensor_stream.py",),
    "p2p/rpc/errors.py": ("tests/test_rpc_client.py", "tests/test_rpc_protocol.py"),
    "p2p/rpc/stream.py": ("tests/test_rpc_stream.py", "tests/test_rpc_protocol.py"),
    "p2p/rpc/pool.py": ("tests/test_rpc_stream.py", "tests/test_rpc_protocol.py"),
    "p2p/rpc/client.py": ("tests/test_rpc_client.py", "tests/test_rpc_protocol.py"),
    "p2p/rpc/endpoint.py": ("tests/test_rpc_endpoint.py", "tests/test_rpc_protocol.py"),
    "p2p/rpc/server.py": ("tests/test_rpc_server.py", "tests/test_rpc_endpoint.py", "tests/test_rpc_protocol.py"),
    "nat/relay_discovery.py": ("tests/test_relay_discovery.py",),
    "averaging/powersgd.py": ("tests/test_powersgd.py",),
    "p2p/identify.py": ("tests/test_identify.py",),
    "p2p/dht/protocol.py": ("tests/test_dht_protocol.py",),
    "training/moe/beam_search.py": ("tests/test_moe_beam_search.py",),
    "averaging/matchmaking.py": ("tests/test_matchmaking.py", "tests/test_matchmaking_join.py"),
    "averaging/allreduce.py": ("tests/test_allreduce.py", "tests/test_averaging_core.py"),
    "averaging/averager.py": ("tests/test_averager.py",),
    "training/moe/layer.py": ("tests/test_moe_layer.py",),
    "training/moe/server.py": ("tests/test_moe_server.py",),
    "training/optimizer.py": ("tests/test_optimizer.py",),
    "training/datasets/fetch.py": ("tests/test_fetch.py",),
    "training/datasets/service.py": ("tests/test_dataset_service.py",),
    "training/moe/client.py": ("tests/test_moe_client.py",),
    "training/datasets/store.py": ("tests/test_store.py", "tests/test_datasets.py"),
    "averaging/staging.py": ("tests/test_staging.py", "tests/test_serial.py", "tests/test_averaging_core.py"),
    "nat/port_mapping/mapping.py": ("tests/test_map_port.py",),
    "p2p/sim/engine.py": ("tests/test_sim_network.py",),
    "p2p/sim/network.py": ("tests/test_sim_network.py",),
    "p2p/sim/calibration.py": ("tests/test_sim_network.py",),
    "averaging/sim/moshpit.py": ("tests/test_moshpit_sim.py",),
    "p2p/settings.py": ("tests/test_settings_apply.py",),
    "p2p/config.py": ("tests/test_node_config.py",),
    "nat/port_mapping/common.py": ("tests/test_port_mapping_common.py", "tests/test_port_mapping_codecs.py"),
    "p2p/http.py": ("tests/test_http.py",),
    "p2p/collector.py": ("tests/test_collector.py",),
    "averaging/sim/matchmaking.py": ("tests/test_matchmaking_sim.py",),
    "p2p/output.py": ("tests/test_output.py",),
    "nat/metrics.py": ("tests/test_nat_metrics.py",),
    "p2p/metrics.py": ("tests/test_node_metrics.py",),
    "averaging/metrics.py": ("tests/test_averaging_metrics.py",),
    "training/metrics.py": ("tests/test_training_metrics.py",),
    "p2p/hooks.py": ("tests/test_hooks.py",),
    "p2p/lazy.py": ("tests/test_lazy.py",),
    "nat/events.py": ("tests/test_layer_events.py",),
    "averaging/events.py": ("tests/test_layer_events.py",),
    "training/events.py": ("tests/test_layer_events.py",),
    "training/datasets/events.py": ("tests/test_layer_events.py",),
    "p2p/events.py": ("tests/test_layer_events.py", "tests/test_output.py"),
    "training/checkpoints.py": ("tests/test_backbone.py",),
    "p2p/lockfile.py": ("tests/test_store.py", "tests/test_identity.py", "tests/test_backbone.py"),
}

KILLED = {"killed", "timeout"}


def check_config() -> None:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    tests = sorted({t for ts in MODULES.values() for t in ts})
    if sorted(conf["only_mutate"]) != sorted(MODULES) or sorted(conf["pytest_add_cli_args_test_selection"]) != tests:
        print("pyproject.toml [tool.mutmut] and .ci/mutate.py MODULES disagree:\n"
              f"  only_mutate should be {sorted(MODULES)}\n"
              f"  pytest_add_cli_args_test_selection should be {tests}", file=sys.stderr)
        sys.exit(2)


def module_of(mutant: str) -> str:
    """``averaging.robust.x_centered_clip__mutmut_3`` -> ``averaging/robust.py``."""
    for path in MODULES:
        dotted = path[:-3].replace("/", ".") + "."
        if mutant.startswith(dotted):
            return path
    raise ValueError(f"mutant {mutant!r} is in no module of MODULES")


def scores() -> tuple[dict[str, Counter[str]], dict[str, list[str]]]:
    out = subprocess.run([str(MUTMUT), "results", "--all", "true"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    counts: dict[str, Counter[str]] = {m: Counter() for m in MODULES}
    survivors: dict[str, list[str]] = {m: [] for m in MODULES}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if not sep:
            continue
        module = module_of(name)
        counts[module][status] += 1
        if status == "not checked":
            continue  # outside --only
        if status not in KILLED:
            survivors[module].append(name)
    return counts, survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goal", type=float, default=0.9)
    parser.add_argument("--json", type=Path, help="write the scores here")
    parser.add_argument("--survivors", action="store_true", help="list every surviving mutant")
    parser.add_argument("--no-run", action="store_true", help="score the last run again (mutants/ kept)")
    parser.add_argument("--only", nargs="+", metavar="MODULE", choices=sorted(MODULES),
                        help="mutate and score only these modules (paths as in MODULES)")
    args = parser.parse_args()
    check_config()
    only = args.only or list(MODULES)
    if not args.no_run:
        # a fresh run every time: mutmut's cache keys on source, not on the tests that changed
        subprocess.run(["rm", "-rf", str(ROOT / "mutants")], check=True)
        names = [m[:-3].replace("/", ".") + ".*" for m in args.only] if args.only else []
        subprocess.run([str(MUTMUT), "run", *names], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    counts, survivors = scores()
    counts = {m: c for m, c in counts.items() if m in only}
    below = []
    table = {}
    print(f"{'module':34} {'mutants':>7} {'killed':>6} {'score':>6}  survivors")
    for module, c in counts.items():
        total = sum(c.values())
        killed = sum(c[s] for s in KILLED)
        score = killed / total if total else 1.0
        table[module] = {"mutants": total, "killed": killed, "score": round(score, 4), "by_status": dict(c)}
        left = ", ".join(f"{n} {s}" for s, n in sorted(c.items()) if s not in KILLED) or "-"
        print(f"{module:34} {total:7} {killed:6} {score:6.1%}  {left}")
        if score < args.goal:
            below.append(module)
        if args.survivors:
            for name in survivors[module]:
                print(f"    {name}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    if below:
        print(f"under the goal of {args.goal:.0%}: {', '.join(below)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
