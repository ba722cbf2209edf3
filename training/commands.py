"""The ``dedloc`` entry point: every layer's commands in one parser, each imported only when it runs.

``train``, ``backbone`` and ``demo`` are this layer's (their code: ``training/cli.py``, ``training/demo.py``); the parser of each
layer below adds its own (p2p/commands.py dispatches). ``dedloc --help``, ``id``, ``ping``, ``relay`` and
the other network commands never import torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from averaging.commands import build_parser as averaging_parser
from nat.commands import authority_options, nat_options, peer_options
from p2p.commands import common_options, directory, positive_seconds, run, seconds

DEFAULT_WORKDIR = "dedloc-example"


def run_options(p: argparse.ArgumentParser) -> None:
    """What names a run and its model: the same on every peer of it."""
    g = p.add_argument_group("the run")
    g.add_argument("--run-id", default="dedloc-example", help="only peers with the same run id train together")
    g.add_argument("--target-batch-size", type=int, default=256, metavar="N",
                   help="samples the swarm accumulates per global step (default: %(default)s)")
    g.add_argument("--workdir", type=directory, default=DEFAULT_WORKDIR,
                   help="where the example's corpus and tokenizer are generated (default: ./%(default)s)")
    g.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="a tokenizers JSON file (default: trained from the example corpus under --workdir)")
    g.add_argument("--model-seed", type=int, default=0, help="seed of the initial weights (the same on every peer)")
    g.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw",
                   help="torch's AdamW, or LAMB (pytorch_optimizer's; DeDLOC's for ALBERT) (default: %(default)s)")
    g.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: %(default)s)")
    g.add_argument("--warmup-steps", type=int, default=5, metavar="N", help="linear warm-up, in global steps")
    g.add_argument("--report-every", type=positive_seconds, default=2.0, metavar="SECONDS",
                   help="how often the progress is printed (default: %(default)s)")


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser, sub = averaging_parser()

    p = sub.add_parser("train", help="join a training run: the example model, trained with the swarm",
                       description="Run a peer (as `dedloc peer`) that trains a small ALBERT masked language model "
                       "with every peer of --run-id: each computes gradients on its own batches at its own pace, "
                       "and when the swarm has --target-batch-size samples, every peer averages them (one "
                       "all-reduce round) and takes the same optimizer step. A peer that joins late downloads the "
                       "swarm's state first; one that joins after every other left takes the run up from the "
                       "checkpoint of its backbone (an --initial-peers peer running `dedloc backbone`). Shows the run's progress: global step, samples/s, loss, peers.")
    peer_options(p)
    run_options(p)
    g = p.add_argument_group("training")
    g.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="shard files or directories (.txt lines, .jsonl, .parquet; default: the example corpus), "
                   "or swarm:NAME: a dataset of the swarm, fetched under --workdir/datasets/NAME as training "
                   "runs (it starts on the first shard checked) and seeded to the others")
    g.add_argument("--data-timeout", type=positive_seconds, default=600.0, metavar="SECONDS",
                   help="with swarm:NAME: give up if no shard arrived within this long (default: %(default)s)")
    g.add_argument("--text-field", default="text", help="the field of JSON lines / column of parquet with the text")
    g.add_argument("--shuffle-buffer", type=int, default=10_000, metavar="N", help="examples mixed before use")
    g.add_argument("--data-seed", type=int, default=None, help="this peer's data order (default: random)")
    g.add_argument("--batch-size", type=int, default=16, metavar="N", help="local batch (default: %(default)s)")
    g.add_argument("--max-steps", type=int, default=0, metavar="N", help="stop after N global steps (0: --duration)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the averaged gradients (0: no clipping)")
    g.add_argument("--centered-clip", action="store_true",
                   help="robust aggregation: the gradient parts this peer reduces are CenteredClip's, not the mean "
                   "(for a swarm whose peers are not all trusted; suspects are named in the step's report)")
    g.add_argument("--delay-updates", action="store_true",
                   help="delayed parameter updates: average step t while computing step t+1 (one step stale)")
    g.add_argument("--group-size", type=int, default=64, metavar="N", help="largest averaging group")
    g.add_argument("--gather-time", type=seconds, default=3.0, metavar="SECONDS",
                   help="how long a round's leader waits for peers known to be at the step that have not "
                        "joined yet (one that fell behind takes the state first: ~2 s across a continent); "
                        "a round with all of them starts at once (default: %(default)s)")
    g.add_argument("--match-timeout", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="give up on a step's round after this long (default: %(default)s)")
    g.add_argument("--threads", type=int, default=1, metavar="N", help="torch threads (default: %(default)s)")
    g.add_argument("--device", default="auto",
                   help="where the model computes: auto (a GPU if torch sees one, else the CPU), cpu, cuda, cuda:1 ...")
    g.add_argument("--amp", action="store_true",
                   help="mixed precision: float16 with a loss scaler on a GPU, bfloat16 on a CPU (slower than "
                        "float32 on a CPU without bfloat16 instructions: the train command warns)")
    g.add_argument("--auxiliary", action="store_true",
                   help="help the run average without training (a CPU-only machine): join every step's "
                   "round with weight 0 and reduce a part of the gradients; the peer must be reachable")
    p.set_defaults(func="training.cli:cmd_train")

    p = sub.add_parser("backbone", help="watch a training run: learning curve, contributions, checkpoints",
                       description="Run a public peer (as `dedloc relay`) that follows --run-id's progress in the "
                       "DHT, keeps the learning curve (curve.jsonl) and the samples each peer contributed "
                       "(contributions.json) under --checkpoint-dir, and every --checkpoint-every steps "
                       "downloads the swarm's state and saves it there. It serves the newest checkpoint: a trainer "
                       "that joined through it (--initial-peers) and finds every other gone takes the run up "
                       "from there. Restarted on the same --checkpoint-dir (one backbone each), it takes up its "
                       "checkpoint, curve and contributions where they stopped. It is a relay and bootstrap node "
                       "too (as `dedloc relay`): a run's public machine.")
    common_options(p)
    nat_options(p)
    p.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR", help="other bootstrap nodes to join")
    authority_options(p)
    run_options(p)
    p.add_argument("--checkpoint-dir", type=directory, default="dedloc-checkpoints", help="where files go (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="global steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=0, metavar="N",
                   help="keep only the newest N checkpoints, deleting older ones as new ones are saved (default: 0, "
                   "keep all)")
    p.add_argument("--datasets", nargs="+", default=None, metavar="NAME",
                   help="the run's datasets in the swarm: the leaderboard credits who served them and who added "
                   "their shards (bytes served as each seeder's signed tracker record says, no faster than 1 Gbit/s)")
    p.set_defaults(func="training.cli:cmd_backbone", data=None)

    p = sub.add_parser("serve-experts", help="host mixture-of-experts experts for Learning@home (a grid of presets)",
                       description="Run a peer (as `dedloc peer`) that hosts one expert per uid of --expert-pattern "
                       "(e.g. ffn.[0:4].[0:8]: 32 experts of a 2-d grid), declares them in the DHT (every prefix, "
                       "refreshed), serves their forward and backward in batches on --device, applies each "
                       "expert's optimizer on the gradients trainers send, and checkpoints them. Trainers use "
                       "them through training.moe.RemoteMixtureOfExperts.")
    peer_options(p)
    g = p.add_argument_group("experts")
    g.add_argument("--expert-cls", choices=("ffn", "nop"), default="ffn",
                   help="the preset module (hivemind's ffn and nop) (default: %(default)s)")
    g.add_argument("--expert-pattern", required=True, metavar="PATTERN",
                   help="uids to host: PREFIX.[a:b].[c:d] ... or fixed coordinates (ffn.3.[0:8])")
    g.add_argument("--hidden-dim", type=int, default=1024, metavar="N", help="rows of [N] in and out")
    g.add_argument("--lr", type=float, default=1e-3, help="each expert's Adam learning rate (default: %(default)s)")
    g.add_argument("--device", default="auto", help="auto (a GPU if torch sees one), cpu, cuda, cuda:1 ...")
    g.add_argument("--threads", type=int, default=0, metavar="N",
                   help="torch's CPU threads per process (default 0: the cores this process may use, a container's "
                   "quota included, shared among --processes; less where other programs share the cores: threads "
                   "that outnumber the cores spin in each other's way)")
    g.add_argument("--max-batch-size", type=int, default=4096, metavar="ROWS", help="largest batch per expert")
    g.add_argument("--min-batch-size", type=int, default=1, metavar="ROWS",
                   help="a smaller batch waits up to --max-wait for more rows before it computes (for callers "
                   "far away, whose requests arrive few at a time; default: %(default)s, no wait)")
    g.add_argument("--max-wait", type=seconds, default=0.0, metavar="SECONDS",
                   help="the most a batch waits for --min-batch-size rows (default: none)")
    g.add_argument("--update-period", type=positive_seconds, default=30.0, metavar="SECONDS",
                   help="how often the experts are declared in the DHT (each declaration lives 3x this)")
    g.add_argument("--checkpoint-dir", type=directory, default=None,
                   help="save and load the experts here, one server at a time (default: none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the experts' initial weights (each expert's "
                   "from it and its uid)")
    g.add_argument("--processes", type=int, default=1, metavar="N",
                   help="serve the experts from N processes, a peer each (its own identity: --identity's file, "
                   "then FILE.1, FILE.2 ...; fixed --listen and --metrics ports + 1, + 2 ...), each hosting every "
                   "N-th expert on --device: for a GPU host whose cores one process's network loop cannot keep "
                   "busy (default: %(default)s)")
    p.set_defaults(func="training.moe.cli:cmd_serve_experts")

    p = sub.add_parser("dataset", help="datasets carried by the swarm: create, add, get, seed, list, show",
                       description="Publish a directory of shards as a dataset of the swarm (`create`), add shards to "
                       "one (`add`), fetch one from its seeders, checking every piece, and seed it (`get`), seed what "
                       "you hold (`seed`), and see what the swarm holds (`list`, `show`). Each runs a peer as "
                       "`dedloc peer` does; `create`, `add`, `seed` and `get` (unless --no-seed) keep seeding until "
                       "Ctrl-C or --duration. `dedloc train --data swarm:NAME` trains on one as it arrives.")
    ds = p.add_subparsers(dest="dataset_command", required=True, metavar="ACTION")

    def dataset_options(q: argparse.ArgumentParser, *, upload: bool = True) -> None:
        peer_options(q)
        if upload:
            q.add_argument("--upload-rate-mbit", type=float, default=None, metavar="MBIT/S",
                           help="cap what this peer uploads to others (default and 0: no cap)")
        q.set_defaults(func="training.datasets.cli:cmd_dataset")

    q = ds.add_parser("create", help="publish DIR's shard files as dataset NAME, and seed it")
    q.add_argument("name", metavar="NAME")
    q.add_argument("directory", type=directory, metavar="DIR")
    q.add_argument("--schema", choices=("text", "jsonl", "parquet"), default=None,
                   help="how the shards read (default: from their suffixes)")
    q.add_argument("--text-field", default="text", help="the field of JSON lines / column of parquet with the text")
    q.add_argument("--piece-size-kib", type=int, default=1024, metavar="KIB",
                   help="bytes per piece, a power of two (default: %(default)s KiB)")
    dataset_options(q)
    q = ds.add_parser("add", help="add FILES to dataset NAME as an entry of yours, and seed them")
    q.add_argument("name", metavar="NAME")
    q.add_argument("files", nargs="+", metavar="FILE")
    q.add_argument("--dir", type=directory, default=None, metavar="DIR", help="your copy of the dataset, where the files go "
                   "(default: ./NAME)")
    dataset_options(q)
    q = ds.add_parser("get", help="fetch dataset NAME into DIR (resuming), checking every piece, and seed it")
    q.add_argument("name", metavar="NAME", help="NAME, or NAME@<creator> where several creators used the name")
    q.add_argument("directory", type=directory, metavar="DIR")
    q.add_argument("--no-seed", action="store_true", help="exit once it is complete instead of seeding it")
    q.add_argument("--max-seeders", type=int, default=16, metavar="N", help="seeders fetched from at once")
    q.add_argument("--allow-relayed", action="store_true",
                   help="fetch from seeders reached only through a relay (its circuits are limited; by default "
                   "such a seeder waits for a hole punch)")
    dataset_options(q)
    q = ds.add_parser("seed", help="seed the datasets in DIR ... (made by create, add or get)")
    q.add_argument("directories", nargs="+", type=directory, metavar="DIR")
    dataset_options(q)
    q = ds.add_parser("list", help="the datasets in the swarm")
    dataset_options(q, upload=False)
    q = ds.add_parser("show", help="dataset NAME: shards, seeders, whether the swarm holds it whole")
    q.add_argument("name", metavar="NAME")
    dataset_options(q, upload=False)
    q = ds.add_parser("retract", help="take entries out of a dataset you created (or, as a closed swarm's "
                      "authority, of any dataset)")
    q.add_argument("name", metavar="NAME")
    q.add_argument("entries", nargs="+", metavar="ENTRY", help="entry ids (hex, or their start), as `show --json` lists")
    q.add_argument("--authority-dir", type=directory, default=None, metavar="DIR",
                   help="sign as the closed swarm's authority (its key in DIR, as `dedloc authority` keeps it)")
    dataset_options(q, upload=False)

    p = sub.add_parser("demo", help="a live local swarm behind NATs (as root) or on loopback: relay, peers, DHT, "
                       "averaging, then training",
                       description="Start a bootstrap node and several peers in their own processes. As root, each "
                       "runs in its own network namespace, the peers behind NATs of different kinds (public, cone, "
                       "port-changing, symmetric, ...; nothing leaves the machine); otherwise on 127.0.0.1 only, the "
                       "last peer outbound-only and the one before it reachable only through the relay. They find "
                       "each other, exchange messages, store and read a DHT value, average tensors in groups (each "
                       "round checked against the exact average), then train the example model together for "
                       "--train-time seconds on a dataset the swarm carries, the loss falling, beside the run's "
                       "backbone, which saves its state; then every trainer leaves, and a newcomer takes the run up "
                       "from the backbone's checkpoint. Everything stops on Ctrl-C.")
    p.add_argument("--network", choices=("auto", "namespaces", "loopback"), default="auto",
                   help="namespaces: the NAT lab (needs root); auto: namespaces where they work, else loopback "
                   "(default: %(default)s)")
    p.add_argument("--peers", type=int, default=4, help="number of peers besides the bootstrap node (default: %(default)s)")
    p.add_argument("--duration", type=positive_seconds, default=90.0, metavar="SECONDS",
                   help="longest the swarm may take to form and average (default: %(default)s)")
    p.add_argument("--train-time", type=seconds, default=150.0, metavar="SECONDS",
                   help="how long the peers train together (0: no training) (default: %(default)s)")
    p.add_argument("--until-shown", action="store_true",
                   help="end the training as soon as it has shown what it shows (every trainer fetched the data "
                   "from the swarm and averaged in global steps, the loss fell by a tenth), --train-time at most: "
                   "for scripts and tests")
    p.add_argument("--json", action="store_true", help="print the nodes' events as JSON lines")
    p.set_defaults(func="training.demo:cmd_demo")
    return parser, sub


def main(argv: Sequence[str] | None = None) -> int:
    parser, sub = build_parser()
    return run(parser, argv, sub)


if __name__ == "__main__":
    sys.exit(main())
