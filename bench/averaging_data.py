"""The tensors and weights of the averaging benchmark, shared by the dedloc and hivemind workers.

A peer's tensor and weight in a round follow from the round's seed and the
peer's id (its base58 text), so any member can rebuild any other member's
contribution from a member list and check its own result against the exact
weighted average, computed in float64. Needs only torch (the hivemind venv
imports it too).
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch


def tensor_of(peer_id: str, seed: int, elements: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(peer_id.encode()))
    return torch.randn(elements, generator=g)


def weight_of(peer_id: str, seed: int) -> float:
    """1, 2 or 3: uneven weights, so an unweighted mean would show as an error."""
    return float(1 + (zlib.crc32(peer_id.encode()) + seed) % 3)


def max_error(result: torch.Tensor, contributors: list[str], seed: int, stride: int = 1) -> float:
    """Largest absolute difference between ``result`` and the exact weighted average of ``contributors``.

    ``stride`` > 1 checks every stride-th value only (every part still is: a 400 MB check in float64
    would hold gigabytes per peer).
    """
    if not contributors:
        return float("inf")
    weights = {pid: weight_of(pid, seed) for pid in contributors}
    total = sum(weights.values())
    picked = result.flatten()[::stride].double()
    exact = torch.zeros(picked.numel(), dtype=torch.float64)
    for pid, w in weights.items():
        exact += tensor_of(pid, seed, result.numel())[::stride].double() * (w / total)
    err = float((picked - exact).abs().max().item())
    return err if err == err else float("inf")  # NaN counts as wrong


def tree_uss_mib(pid: int | None = None) -> float:
    """The memory a process and all its descendants hold alone (USS: their private pages), in MiB.

    The descendants count because hivemind's networking is a child process (its Go daemon,
    ``p2pd``) and its DHT and averager are forked ones: a soak that read the Python process alone
    would miss where its connections live. Private pages, not the resident set: forked children
    share their parent's pages (torch's, at least), which a sum of resident sets would count once
    per process. Leaked memory is private either way. A process that ends while it is read counts
    as nothing.
    """
    pid = os.getpid() if pid is None else pid
    total_kib, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total_kib += sum(int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:")))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total_kib / 1024


def worker_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line both workers take (the driver starts either with the same arguments)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR")
    parser.add_argument("--boot", action="store_true", help="relay/bootstrap (DHT) node only")
    parser.add_argument("--peers", type=int, default=4, help="group target size")
    parser.add_argument("--min-size", type=int, default=0, help="group minimum size (default: --peers)")
    parser.add_argument("--elements", type=int, default=10_000_000)
    parser.add_argument("--up", type=float, default=0.0, help="upload, Mbit/s (0: measure; hivemind: unused)")
    parser.add_argument("--down", type=float, default=0.0, help="download, Mbit/s (0: measure; hivemind: bandwidth=)")
    parser.add_argument("--compute", type=float, default=0.0, help="samples/s (0: unknown; hivemind: unused)")
    parser.add_argument("--role", choices=("full", "sender", "aux"), default="full")
    parser.add_argument("--split", choices=("adaptive", "equal", "measured"), default="adaptive",
                        help="adaptive: the LP on the declared --up/--down; measured: the LP on the rates measured "
                             "in earlier rounds (nothing declared); equal: equal parts")
    parser.add_argument("--gather-time", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--stall-timeout", type=float, default=15.0)
    parser.add_argument("--chunk-elements", type=int, default=None, help="dedloc: AllreduceConfig.chunk_elements")
    parser.add_argument("--check-stride", type=int, default=1, help="check every n-th value of the result")
    parser.add_argument("--max-chunks-ahead", type=int, default=None, help="dedloc: AllreduceConfig.max_chunks_ahead")
    parser.add_argument("--crypto-threads", type=int, default=None,
                        help="dedloc: NoiseConfig.crypto_threads (default: chosen by the cores)")
    parser.add_argument("--device", default="cpu", help="dedloc: where the averaged tensor lives (cuda: staged "
                        "through page-locked buffers, averaging/staging.py)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="dedloc: torch's intra-op threads (0: torch's own choice, one per core)")
    return parser
