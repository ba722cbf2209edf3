"""Every layer's event records: how one becomes a ``--json`` line (p2p/events.py: peer ids as text,
enums as values, compact, in field order) and each record's name there, and the human lines, each
checked to the byte with its plurals, its missing values and its edges (p2p/events.py,
nat/events.py, averaging/events.py, training/events.py, training/datasets/events.py; the printer
that writes them: tests/test_output.py)."""

from __future__ import annotations

import json
import time

import pytest

from averaging.events import AverageFailed, Averaged
from nat.events import (DashboardServing, HolePunched, ModeChanged, NatStatus, PingSummary, ReachabilityChanged,
                        RelayLost, RelayReserved)
from nat.reachability import MappingKind, NatMode
from p2p import events as ev
from p2p.dht.events import DHTIsolated, DHTJoined, DHTMode, DHTModeChanged
from p2p.events import Event
from p2p.hooks import Direction, PathKind
from p2p.hooks import Reachability
from training.datasets.events import (DatasetComplete, DatasetProgress, DatasetPublished, SeederBanned, Seeding,
                                      ShardFetched)
from training.events import (Checkpointed, TakenUp, ExpertProcesses, ExpertProcessExited, ExpertsServing, GlobalStepDone,
                             StateDownloaded, TrainingStatus, bar, count)

from .kit import numbered_peer_id

PEER = numbered_peer_id(7)
TAIL = str(PEER)[-8:]

# ---------------------------------------------------------------------- p2p


def at(record: Event, ts: float = 1234.5) -> Event:
    record.ts = ts
    return record


def test_a_record_is_plain_json_in_field_order_with_ids_as_text_and_enums_as_values() -> None:
    before = time.time()
    assert before <= Event().ts <= time.time()  # stamped when made
    record = at(ev.ConnectionOpened(PEER, "/ip4/1.2.3.4/tcp/1", Direction.INBOUND, PathKind.RELAYED))
    assert record.to_json() == (
        f'{{"event":"connection_opened","ts":1234.5,"peer_id":"{PEER}","addr":"/ip4/1.2.3.4/tcp/1",'
        '"direction":"inbound","kind":"relayed"}')
    assert record.to_dict() == {"event": "connection_opened", "ts": 1234.5, "peer_id": str(PEER),
                                "addr": "/ip4/1.2.3.4/tcp/1", "direction": "inbound", "kind": "relayed"}
    nested = NatStatus({"peers": [PEER, numbered_peer_id(8)], "modes": (NatMode.PUBLIC,),  # type: ignore[dict-item]
                        "by": {PEER: PathKind.DIRECT, 3: "x"}})  # type: ignore[dict-item]
    assert nested.to_dict()["metrics"] == {"peers": [str(PEER), str(numbered_peer_id(8))], "modes": ["public"],
                                           "by": {str(PEER): "direct", "3": "x"}}
    assert json.loads(at(ev.Error("it broke")).to_json()) == {"event": "error", "ts": 1234.5, "message": "it broke",
                                                        "peer_id": None}
    assert Event().human() is None and at(Event()).to_dict() == {"event": "event", "ts": 1234.5}


def test_the_node_s_lines_say_what_was_trimmed_pushed_refused_and_rejoined() -> None:
    assert ev.ConnectionsTrimmed(closed=12, peers=5, before=212, after=200).human() == (
        "holding 212 connections, over the high water: closed 12 to 5 peers of least use (200 open)")
    assert ev.ClosedSwarm(PEER).human() == f"{PEER} runs a closed swarm, and this peer has no access pass for it"
    assert ev.Rejoining(3).human() == "cut off from every peer: dialing the 3 initial peers again"
    assert ev.Rejoining(1).human() == "cut off from every peer: dialing the 1 initial peer again"
    assert ev.IdentifyPushed(["/a"], ["/p"], 1, 0).human() == "our addresses or protocols changed: told 1 connected peer"
    assert ev.IdentifyPushed(["/a"], ["/p"], 4, 2).human() == (
        "our addresses or protocols changed: told 4 connected peers (2 could not be told)")
    assert ev.IdentifyPushed([], [], 0, 0).human() == "our addresses or protocols changed: told 0 connected peers"


@pytest.mark.parametrize("record, name", [
    (ev.Listening(PEER, []), "listening"),
    (ev.ConnectionOpened(PEER, "a", Direction.OUTBOUND, PathKind.DIRECT), "connection_opened"),
    (ev.ConnectionClosed(PEER, "a", PathKind.DIRECT), "connection_closed"),
    (ev.ConnectionsTrimmed(1, 1, 2, 1), "connections_trimmed"), (ev.PeerConnected(PEER, "a", 0.1), "peer_connected"),
    (ev.Ping(PEER, 1.0), "ping"), (ev.Message(PEER, "x"), "message"), (ev.PeerCount(0, []), "peer_count"),
    (ev.Error("x"), "error"), (ev.ClosedSwarm(PEER), "closed_swarm"), (ev.Rejoining(1), "rejoining"),
    (ev.IdentifyPushed([], [], 0, 0), "identify_pushed"), (ev.Closed(PEER), "closed"),
    (DHTJoined(DHTMode.AUTO, 3, 0.5), "dht_joined"), (DHTModeChanged(DHTMode.CLIENT, "private"), "dht_mode"),
    (DHTIsolated(2), "dht_isolated")])
def test_the_p2p_records_are_named_for_json(record: Event, name: str) -> None:
    assert json.loads(record.to_json())["event"] == name


def test_defaults_a_closed_connection_untrimmed_a_ping_s_path_unknown_an_error_from_nobody() -> None:
    assert ev.ConnectionClosed(PEER, "a", PathKind.DIRECT).trimmed is False
    assert ev.Ping(PEER, 1.0).kind is None and ev.Error("x").peer_id is None
    assert [str(m) for m in DHTMode] == ["auto", "server", "client"]


# ---------------------------------------------------------------------- nat


def test_a_relay_slot_says_where_we_are_reached_and_until_when_in_local_time() -> None:
    expire = 1_700_000_000.0
    until = time.strftime("%H:%M:%S", time.localtime(expire))
    assert RelayReserved(PEER, expire, ["/ip4/1.2.3.4/tcp/1/p2p-circuit", "/ip4/9.9.9.9/tcp/1"]).human() == (
        f"relay slot on {PEER}: reachable at /ip4/1.2.3.4/tcp/1/p2p-circuit (held until {until}, renewed before then)")
    assert RelayReserved(PEER, expire, []).human() == f"relay slot on {PEER} (held until {until}, renewed before then)"


def test_a_hole_punch_says_how_the_path_went_direct_or_that_it_stays_relayed() -> None:
    def line(success: bool, method: str, attempts: int, elapsed: float, addr: str | None = "/ip4/5.6.7.8/tcp/2") -> str:
        return HolePunched(PEER, success, method, attempts, elapsed, addr).human()  # type: ignore[arg-type]

    after = "s after the relayed one opened"
    assert line(True, "reversal", 1, 0.5) == f"direct connection to …{TAIL} at /ip4/5.6.7.8/tcp/2, 0.50 {after} (dialed back)"
    assert line(True, "punch", 1, 0.254) == f"direct connection to …{TAIL} at /ip4/5.6.7.8/tcp/2, 0.25 {after} (hole punch, 1 round)"
    assert line(True, "punch", 2, 1.0) == f"direct connection to …{TAIL} at /ip4/5.6.7.8/tcp/2, 1.00 {after} (hole punch, 2 rounds)"
    assert line(False, "none", 1, 3.0, None) == f"no direct connection to …{TAIL} after 1 hole-punch round (3.00 s): staying relayed"
    assert line(False, "punch", 3, 3.0) == f"no direct connection to …{TAIL} after 3 hole-punch rounds (3.00 s): staying relayed"


def test_a_ping_summary_gives_the_round_trips_then_whether_and_when_the_path_went_direct() -> None:
    assert PingSummary(PEER, 5, 1.234, 2.345, 0, None).human() == "5 pings, rtt min 1.23 ms, median 2.35 ms"
    assert PingSummary(PEER, 3, 1.0, 2.0, 1, 0.75).human() == (
        "3 pings, rtt min 1.00 ms, median 2.00 ms; relayed at first, direct after 0.75 s")
    assert PingSummary(PEER, 3, 1.0, 2.0, 2, None).human() == (
        "3 pings, rtt min 1.00 ms, median 2.00 ms; relayed: 2 upgrade attempt(s) found no direct path")
    assert PingSummary(PEER, 0, None, None, 0, None).human() == "no pings"
    assert PingSummary(PEER, 1, 1.0, None, 0, None).human() == "no pings"  # either missing: no figures
    assert PingSummary(PEER, 1, None, 1.0, 0, None).human() == "no pings"


def test_the_dashboard_says_where_its_two_pages_are() -> None:
    assert DashboardServing("http://127.0.0.1:9100/metrics", "http://127.0.0.1:9100/").human() == (
        "metrics at http://127.0.0.1:9100/metrics, live page at http://127.0.0.1:9100/")


def test_the_nat_layer_s_records_are_named_for_json_and_plain_there() -> None:
    records: list[tuple[Event, str]] = [
        (ReachabilityChanged(Reachability.PUBLIC, MappingKind.NONE, ["/ip4/1.2.3.4/tcp/1"]), "reachability"),
        (RelayReserved(PEER, 1.0, []), "relay_reserved"), (RelayLost(PEER, "expired"), "relay_lost"),
        (HolePunched(PEER, True, "punch", 1, 0.1), "hole_punch"),  # type: ignore[arg-type]
        (PingSummary(PEER, 0, None, None, 0, None), "ping_summary"),
        (ModeChanged(NatMode.RELAYED, "private"), "nat_mode"), (DashboardServing("m", "p"), "dashboard"),
        (NatStatus({"reservations": 1}), "nat_status")]
    for record, name in records:
        assert json.loads(record.to_json())["event"] == name
    assert ReachabilityChanged(Reachability.PUBLIC, MappingKind.NONE, []).to_dict()["mapping"] == "none"
    assert RelayLost(PEER, "expired").to_dict()["relay"] == PEER.to_base58()
    assert RelayLost(PEER, "x").human() is None and ModeChanged(NatMode.CLIENT, "y").human() is None  # the default


# ---------------------------------------------------------------------- averaging


def test_a_round_says_with_how_many_as_what_in_what_time_what_moved_and_the_means() -> None:
    assert Averaged(3, ["a", "b", "c"], "full", 0.3333, True, "", {}, 1.234, 2_500_000, 1_250_000, 1.0, 0.5).human() == (
        "round 3: averaged with 2 others as full (share 33%) in 1.23 s, 2.5 MB out, 1.2 MB in: mean 1.0000 -> 0.5000")
    assert Averaged(4, ["a", "b"], "sender", 0.0, False, "part 1: reducer gone", {"b": "gone"}, 2.0, 0, 0, 0.25,
                    0.25).human() == ("round 4: PARTIAL with 1 other as sender (share 0%) in 2.00 s, 0.0 MB out, "
                                      "0.0 MB in: mean 0.2500 -> 0.2500 (part 1: reducer gone)")
    assert Averaged(5, ["a", "b"], "full", 0.5, True, "", {}, 1.0, 10**12, 3 * 10**12, 0, 0).human() == (
        "round 5: averaged with 1 other as full (share 50%) in 1.00 s, 1000000.0 MB out, 3000000.0 MB in: "
        "mean 0.0000 -> 0.0000")  # MB of 10^6 bytes
    assert AverageFailed(5, "no group in 30 s").human() == "round 5: no average: no group in 30 s"
    assert json.loads(AverageFailed(5, "x").to_json())["event"] == "average_failed"
    assert Averaged(1, [], "", 0, True, "", {}, 0, 0, 0, 0, 0).to_dict()["event"] == "averaged"


# ---------------------------------------------------------------------- training


def test_a_bar_fills_by_share_clamped_and_a_count_never_passes_the_whole() -> None:
    assert [bar(3, 4, 8), bar(1, 3, 8), bar(5, 4, 8), bar(-1, 4, 8), bar(1, 0, 8), bar(1, -2, 8)] == [
        "[######..]", "[###.....]", "[########]", "[........]", "[........]", "[........]"]
    assert bar(1, 2) == "[" + "#" * 12 + "." * 12 + "]"  # 24 wide by default
    assert (bar(1, 1, 4), bar(0.5, 0.5, 4), bar(1, 0.5, 4)) == ("[####]", "[####]", "[####]")  # any whole above 0
    assert (count(5, 4), count(3, 4), count(4, 4)) == ("4/4", "3/4", "4/4")


def test_a_training_status_line_has_the_bar_the_rates_the_losses_the_peers_and_the_time_to_the_step() -> None:
    assert TrainingStatus(7, 300, 1024, 120.4, 40.6, 2.5, None, 1, 12.4, 90).human() == (
        "step 7 [#######.................] 300/1024 | swarm 120 samples/s, mine 41 | loss 2.500 (swarm ?) "
        "| 1 peer | next step ~12 s")
    assert TrainingStatus(7, 2000, 1024, 0, 0, float("nan"), 1.0, 3, 0, 0).human() == (
        "step 7 [########################] 1024/1024 | swarm 0 samples/s, mine 0 | loss ? (swarm 1.000) "
        "| 3 peers | next step now")
    assert TrainingStatus(7, 0, 8, 0, 0, float("inf"), None, 0, float("inf"), 0).human().endswith(
        "| loss ? (swarm ?) | 0 peers | next step ?")
    assert TrainingStatus(7, 0, 8, 0, 0, None, None, 2, -1.0, 0).human().endswith("| 2 peers | next step now")
    assert TrainingStatus(7, 0, 8, 0, 0, None, None, 2, 0.6, 0).human().endswith("| next step ~1 s")  # not yet
    assert TrainingStatus(7, 0, 8, 0, 0, None, None, 2, float("nan"), 0).human().endswith("| next step ?")


def test_a_step_done_says_how_it_was_averaged_its_loss_and_whether_partial_or_missed() -> None:
    def line(group: int, averaged: bool, complete: bool = True, summary: str = "", loss: float | None = 2.125,
             missed: bool = False) -> str:
        return GlobalStepDone(8, 1024, 300, group, averaged, complete, summary, 0.5, missed, not averaged, loss).human()

    assert line(3, True) == "step 8 done: 1024 samples (300 mine), averaged with 2 others in 0.50 s, loss 2.125"
    assert line(2, True, False, "1 part partial", None) == (
        "step 8 done: 1024 samples (300 mine), averaged with 1 other in 0.50 s, loss ? PARTIAL (1 part partial)")
    assert line(1, False) == "step 8 done: 1024 samples (300 mine), alone in 0.50 s, loss 2.125"
    assert line(0, False, False, "no group", missed=True) == "step 8: missed (no group); taking the swarm's state"


def test_a_state_taken_a_checkpoint_and_the_expert_servers_say_what_and_where() -> None:
    assert StateDownloaded(9, 1.5, str(PEER)).human() == f"took the swarm's state at step 9 from {TAIL} in 1.50 s"
    assert Checkpointed(10, "/tmp/ck.pt", str(PEER)).human() == f"checkpoint of step 10 saved to /tmp/ck.pt (from {TAIL})"
    assert TakenUp(120, "/ck/checkpoint-000120.pt", 121, 14).human() == (
        "taken up from the last backbone: serving the checkpoint of step 120 (/ck/checkpoint-000120.pt); the curve "
        "goes on from step 121, the board of 14 volunteers")
    assert TakenUp(-1, "", 3, 1).human() == (
        "taken up from the last backbone: no checkpoint; the curve goes on from step 3, the board of 1 volunteer")
    assert ExpertsServing(8, "ffn", "expert.[0:8]", 512, "cpu").human() == (
        "serving 8 ffn experts (expert.[0:8], hidden 512) on cpu")
    assert ExpertsServing(4, "nop", "e.[0:4]", 64, "cuda:0", 1, 2).human() == (
        "serving 4 nop experts (e.[0:4], process 1 of 2, hidden 64) on cuda:0")
    assert ExpertProcesses(2, 8, "e.[0:8]").human() == "serving e.[0:8] in 2 processes (a peer each, 4 experts per process)"
    assert ExpertProcesses(3, 8, "e.[0:8]").human() == "serving e.[0:8] in 3 processes (a peer each, 2+ experts per process)"
    assert ExpertProcessExited(1, 3, -9).human() == (
        "serve-experts: process 1 of 3 exited with status -9; stopping the others")


@pytest.mark.parametrize("record, name", [
    (TrainingStatus(1, 0, 1, 0, 0, None, None, 0, 0, 0), "training_status"),
    (GlobalStepDone(1, 0, 0, 1, False, True, "", 0, False, True, None), "global_step"),
    (StateDownloaded(1), "state_downloaded"), (Checkpointed(1, "p", "s"), "checkpointed"),
    (TakenUp(1, "p", 1, 0), "taken_up"),
    (ExpertsServing(1, "ffn", "e", 1, "cpu"), "experts_serving"), (ExpertProcesses(1, 1, "e"), "expert_processes"),
    (ExpertProcessExited(0, 1, 1), "expert_process_exited"),
    (DatasetPublished("n", "d", "c", 1, 1, "e"), "dataset_published"),
    (DatasetProgress("n", 0, 1, 0, 0, 0, 1), "dataset_progress"), (ShardFetched("n", "p", 1), "dataset_shard"),
    (SeederBanned("n", "p", "r"), "dataset_seeder_banned"), (DatasetComplete("n", "d", 1, 1, {}, 0), "dataset_complete"),
    (Seeding("n", "d", 1, 1, 0), "dataset_seeding")])
def test_the_training_and_dataset_records_are_named_for_json(record: Event, name: str) -> None:
    assert json.loads(record.to_json())["event"] == name


def test_state_downloaded_defaults_to_no_time_and_no_source() -> None:
    assert (StateDownloaded(3).seconds, StateDownloaded(3).source) == (0.0, "")
    assert (ExpertsServing(1, "ffn", "e", 1, "cpu").process, ExpertsServing(1, "ffn", "e", 1, "cpu").processes) == (0, 1)


# ---------------------------------------------------------------------- datasets


def test_dataset_lines_give_sizes_in_mib_or_gib_rates_in_mbit_and_their_plurals() -> None:
    assert DatasetPublished("wiki", "ab" * 16, "c", 1, 3 << 20, "cd" * 16).human() == (
        "dataset wiki (abababababab): 1 shard, 3.0 MiB published (entry cdcdcdcdcdcd)")
    assert DatasetPublished("wiki", "ab" * 16, "c", 2, 3 << 30, "cd" * 16).human() == (
        "dataset wiki (abababababab): 2 shards, 3.00 GiB published (entry cdcdcdcdcdcd)")
    assert DatasetPublished("w", "d", "c", 2, (1 << 30) - (1 << 20), "e").human() == (
        "dataset w (d): 2 shards, 1023.0 MiB published (entry e)")  # a GiB from exactly one
    assert DatasetPublished("w", "d", "c", 2, 1 << 30, "e").human() == "dataset w (d): 2 shards, 1.00 GiB published (entry e)"
    assert DatasetProgress("wiki", 1 << 20, 4 << 20, 1e6, 1, 0, 4).human() == (
        "wiki [######..................] 1.0 MiB/4.0 MiB | 8.0 Mbit/s | 0/4 shards | 1 seeder")
    assert DatasetProgress("wiki", 5 << 20, 4 << 20, 0.0, 2, 4, 4, 1).human() == (
        "wiki [########################] 4.0 MiB/4.0 MiB | 0.0 Mbit/s | 4/4 shards | 2 seeders (1 banned)")
    assert DatasetProgress("w", 0, 1 << 20, 0.0, 0, 0, 1).human().endswith("| 0 seeders")
    assert "| 1000000.0 Mbit/s |" in DatasetProgress("w", 0, 1, 1.25e11, 1, 0, 1).human()  # Mbit of 10^6 bits
    assert ShardFetched("wiki", "/d/0.bin", 1536 << 10).human() == "wiki: /d/0.bin (1.5 MiB) checked and written"
    assert SeederBanned("wiki", "Qm", "bad piece 3").human() == "wiki: seeder Qm banned: bad piece 3"
    assert DatasetComplete("wiki", "/d", 8 << 20, 2.0, {"a": 1, "b": 2}, 0).human() == (
        "wiki: complete in /d (8.0 MiB in 2.0 s, 33.6 Mbit/s, from 2 seeders)")
    assert DatasetComplete("wiki", "/d", 8 << 20, 0.0, {"a": 1}, 0).human() == (
        "wiki: complete in /d (8.0 MiB in 0.0 s, 0.0 Mbit/s, from 1 seeder)")  # no rate from no time
    assert DatasetComplete("w", "/d", 10**12, 0.5, {}, 0).human() == (
        "w: complete in /d (931.32 GiB in 0.5 s, 16000000.0 Mbit/s, from 0 seeders)")
    assert Seeding("wiki", "ab" * 16, 4, 8 << 20, 3 << 30).human() == (
        "seeding wiki (abababababab): 4 shards, 8.0 MiB; served 3.00 GiB")
    assert DatasetProgress("w", 0, 1, 0, 0, 0, 1).banned == 0
