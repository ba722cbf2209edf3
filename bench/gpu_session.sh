#!/usr/bin/env bash
# The GPU issue's measurements in one prepared run on a lent machine ("What a GPU volunteer gets").
#
# Here first: bash bench/gpu_wheels.sh (the wheels the machine cannot fetch, into .whl/). The session has
# 15 minutes of device time, the machine's start (1-2 min) included, and one call may run 10: two calls,
# the second at once while the machine is warm (it goes back 30 s after a call), each step's own limit
# bounding a hang:
#   run(command="bash bench/gpu_session.sh env tests net-tests training allreduce allreduce-loop noise-threads moe-profile", carry=[".whl"], timeout_s=450)
#   run(command="bash bench/gpu_session.sh moe", carry=[".whl"], timeout_s=330)
# (expected here from the CPU rehearsal and the last H100 run: ~6 min and ~4.5 min: the moe step's 12 cases,
# dedloc's server as one process and as 4 beside hivemind's, at ~18 s each), then give_back.
# Each step writes its log and JSON in $WORK; as each step ends, $WORK is packed into $OUT/session.tgz
# (a call brings back at most 8 files from $OUT) beside a copy of the summary, so a call stopped at its
# limit still brings back the steps that finished (and the second call's package and summary hold the
# first's too: $WORK stays on the warm machine); a rerun names only the steps it wants.
#
# Steps (in this order by default; each under its own time limit):
#   env        the card, the driver, torch, the cores (nvidia-smi, torch.cuda)
#   tests      the CUDA-only tests and the Noise and staging tests (pytest)
#   net-tests  the network layer's and averaging's loopback tests on 8 workers, every node sealing and
#              opening on the crypto threads the machine's cores allow (CI's 2 cores never do)
#   training   bench/gpu_training.py: alone, 2 peers synchronous, 2 peers with delayed updates
#   allreduce  bench/allreduce_speed.py: 2 peers, 40 and 400 MB, against the data plane and gloo, each node
#              sealing and opening on the crypto threads its cores allow (p2p.noise.crypto_threads_for)
#   allreduce-loop  the same at 400 MB with every node's crypto on its event loop (--crypto-threads 0)
#   noise-threads  bench/noise_threads.py: what a thread hop costs the loop and a write there (the facts
#              behind NoiseConfig's offload_bytes and split_bytes, measured on 2 cores)
#   moe        bench/moe_gpu.py: one expert server on the GPU, dedloc's (one process, and 4: serve-experts
#              --processes 4) against hivemind's
#   moe-profile  dedloc's server alone at 1024 rows with its event loop under cProfile (written every 2 s:
#              bench/moe_gpu_peer.py, DEDLOC_BENCH_PROFILE), where its time goes on the GPU host
# Diagnosis (not in the default list; docs/AVERAGING.md, "The training round on the H200"):
#   diagnose   bench/allreduce_speed.py's 2 peers at 100 MB with the tensors on the host or the GPU, torch's
#              intra-op threads 1 or one per core: which of the two slows a round (on a CPU, the rehearsal: cpu:1 only)
#   spy-round  py-spy (every thread, then the GIL's holder) on one peer averaging 400 MB of GPU tensors
#   spy-training  the training bench's sync run, 3 steps: its rounds under cProfile, py-spy on peer 0, and
#              --probe-memory (a CPU op's cost on pageable and page-locked chunks, during a round and after);
#              skipped when diagnose already showed a slow GPU round
# py-spy comes as a wheel in .whl/tools/ (bench/gpu_wheels.sh), unpacked to $SITE/tools/py-spy.
#
# The third run (2026-12-04 18:00, docs/AVERAGING.md "Third GPU run") measured the serial.py fix with torch's
# own threads (the round 27 -> 239 MB/s) and delayed updates at target 8192 (0.85x alone, but computing 73%),
# and found the lone process computing only 80% of its wall time: ~8 ms of each micro-batch on the event
# loop, making its batch (fixed since: a pool of sentences, bench/gpu_training_peer.py's Data) and
# accumulating its gradients (training/accumulator.py: fused since, ~400 kernel launches -> a handful).
# The next session with a machine measures those, and prints where each step's time outside compute goes
# (batches, step() calls, global steps):
#   run(command="bash bench/gpu_session.sh env training allreduce-loop", carry=[".whl"], timeout_s=420)
#   run(command="GPU_TRAINING_ARGS='--setups alone,dpu --target 8192 --steps 2 --dpu-steps 6' GPU_SPY_TRAINING_ARGS='--setups dpu --target 8192 --dpu-steps 3 --timeout 200' bash bench/gpu_session.sh training spy-training", carry=[".whl"], timeout_s=420)
# (the first: allreduce-loop is the 400 MB round with every node's crypto on its event loop, never measured
# on the 16 cores, against the allreduce step's 291 MB/s with 4 crypto threads: which the rule should choose;
# the second: delayed updates where the compute hides the round, and py-spy on a DPU peer, every thread
# and then the GIL's holder: is the round 2.5x slower beside compute for the GIL?), then, if the machine
# is still warm and 4 minutes are left, run(command="bash bench/gpu_session.sh moe", ...) with
# GPU_MOE_REPEATS=1; then give_back. For the expert server, still to compare: --server-threads 1
# against the default (docs/MOE.md).
#
# A rehearsal on a CPU (the same installs and commands at small sizes): bash bench/gpu_wheels.sh 3.11,
# then GPU_SESSION_DEVICE=cpu PYTHON=<a Python with torch, numpy, scipy and pytest> bash bench/gpu_session.sh
# GPU_SESSION_INSTALL=0 uses PYTHON's own packages instead of the wheels, and GPU_SESSION_MOE_SYSTEMS=dedloc
# leaves hivemind out: tests/test_bench_smoke.py runs the steps so with .venv's Python, so that a bench's
# renamed option fails here and not on the machine's time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
PY=${PYTHON:-python3}
DEVICE=${GPU_SESSION_DEVICE:-cuda}
SITE=${GPU_SESSION_SITE:-/tmp/dedloc-site}
MOE_SYSTEMS=${GPU_SESSION_MOE_SYSTEMS:-dedloc,hivemind}
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(env tests net-tests training allreduce allreduce-loop noise-threads moe moe-profile)
WORK=${GPU_SESSION_WORK:-/tmp/gpu-session}
mkdir -p "$OUT" "$WORK"
SUMMARY=$WORK/summary.txt  # kept in $WORK: a second call on the warm machine adds to the first's
FAILED=()

install() {  # install NAME: .whl/both and .whl/NAME into $SITE/NAME, once
    [[ -f $SITE/$1/.done ]] && return 0
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/$1" \
        .whl/both/*.whl ".whl/$1"/*.whl && touch "$SITE/$1/.done"
}

pack() {  # the summary into $OUT, and $WORK into $OUT/session.tgz, replaced whole: never half written
    cp "$SUMMARY" "$OUT/summary.txt" && tar -czf "$OUT/session.tgz.part" -C "$WORK" . \
        && mv "$OUT/session.tgz.part" "$OUT/session.tgz"
}

step() {  # step NAME LIMIT_S COMMAND...: the command's output in $WORK/NAME.log; its status and time in the summary
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    [[ $rc == 0 ]] || FAILED+=("$name")
    if [[ $rc != 0 && $DEVICE != cpu ]]; then
        # A bench stopped by its limit leaves its workers behind (each in a session of its own, so that the
        # bench can kill their groups): on the lent machine, which runs nothing else, end them before the
        # next step. Never in a rehearsal, where other tests' workers may be running beside this one.
        pkill -9 -f "bench/[a-z_]*peer\.py|nat\.cli relay|p2pd" 2>/dev/null
    fi
    echo "$name rc=$rc ${limit}s-limit $((SECONDS - start))s" | tee -a "$SUMMARY"
    tail -n 25 "$WORK/$name.log"
    pack
}

if [[ ${GPU_SESSION_INSTALL:-1} == 0 ]]; then
    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
    DEDLOC_SITE="" HIVEMIND_SITE=""
elif install dedloc && install hivemind; then
    export PYTHONPATH=$PWD:$SITE/dedloc PYTHONUNBUFFERED=1
    DEDLOC_SITE=$SITE/dedloc HIVEMIND_SITE=$SITE/hivemind
else
    echo "gpu_session: the wheels did not install: run bash bench/gpu_wheels.sh here and carry .whl" >&2
    exit 2
fi
# py-spy (its wheel in .whl/tools/, from bench/gpu_wheels.sh): a binary, unpacked once; the spy steps only
SPY=${PY_SPY:-$SITE/tools/py-spy}
if [[ ! -x $SPY ]] && compgen -G ".whl/tools/py_spy-*.whl" > /dev/null; then
    mkdir -p "$SITE/tools" && "$PY" -c "import glob, sys, zipfile
w = zipfile.ZipFile(glob.glob('.whl/tools/py_spy-*.whl')[0])
name = next(n for n in w.namelist() if n.endswith('/scripts/py-spy'))
open(sys.argv[1], 'wb').write(w.read(name))" "$SPY" && chmod +x "$SPY"
fi
echo "gpu_session: $(date -u +%FT%TZ), device $DEVICE, steps ${STEPS[*]}" | tee -a "$SUMMARY"

if [[ $DEVICE == cpu ]]; then  # a rehearsal: every step at a size a CPU does in seconds
    TRAINING=(--device cpu --size tiny --micro 4 --seq 32 --target 32 --steps 2 --dpu-steps 3 --timeout 150)
    ALLREDUCE=(--peers 2 --mbytes 4 --rounds 1 --data-plane-mib 16)  # the GPU run's peers: 4 cost CI 15 s
    LOOP=(--peers 2 --mbytes 4 --rounds 1 --data-plane-mib 16 --no-gloo --crypto-threads 0)
    HOPS=(--sizes 256 --threads 0,1 --writes 5)
    MOE=(--device cpu --hidden 64 --experts 2 --batches 16 --clients 2 --callers 2 --seconds 1 --repeats 1 --timeout 60
         --server-processes 1,2)
    # the nop experts here (the serving stack alone), so that the rehearsal runs both kinds
    PROFILED=(--device cpu --hidden 64 --experts 2 --batches 16 --clients 1 --callers 1 --seconds 3 --timeout 60
              --expert-cls nop)
    ROUND=(--peers 2 --mbytes 4 --rounds 1 --no-gloo --data-plane-mib 0)
    SPY_ROUND=(--peers 2 --mbytes 8 --rounds 6 --no-gloo --data-plane-mib 0)
    read -r -a SPY_TRAINING <<< "${GPU_SPY_TRAINING_ARGS:---device cpu --size tiny --micro 4 --seq 32 --target 32 --steps 6 --setups sync --timeout 150 --probe-memory}"
    SPY_DELAY=1 SPY_TRAINING_DELAY=3 SPY_TRAINING_LIMIT=120
    TESTS=(-x -q tests/test_averaging_core.py -k "device or pool")
    # the step's command, not the tests again (the suite runs test_noise.py: 30-60 s on CI's 2 cores)
    NET_TESTS=(-q tests/test_noise.py -k "usable_cores or crypto_threads")
else
    TRAINING=()
    ALLREDUCE=(--peers 2 --mbytes 40,400 --rounds 3)
    LOOP=(--peers 2 --mbytes 400 --rounds 3 --no-gloo --crypto-threads 0)
    HOPS=()
    # dedloc's server as one process and as 4 (serve-experts --processes): 12 cases of ~18 s
    # --timeout 30: a side that hangs (hivemind's at 1024 rows on 2026-12-04's third run, past the step's
    # 300 s) costs its attempts ~100 s, not the step (its servers and clients were ready in seconds)
    MOE=(--device cuda --batches 64,1024 --clients 8 --callers 4 --seconds 6 --repeats "${GPU_MOE_REPEATS:-2}"
         --server-processes 1,4 --timeout 30)
    PROFILED=(--device cuda --batches 1024 --clients 8 --callers 4 --seconds 10)
    ROUND=(--peers 2 --mbytes 100 --rounds 2 --no-gloo --data-plane-mib 0)
    SPY_ROUND=(--peers 2 --mbytes 400 --rounds 6 --no-gloo --data-plane-mib 0)
    # the sync run of the training step, 3 steps: at 2026-12-04's 27 s rounds, 4 rounds and the warm-up
    # GPU_SPY_TRAINING_ARGS: another run to spy on, e.g. a DPU peer whose round runs beside its compute thread
    # (which of them holds the GIL: the second pass samples only its holder)
    read -r -a SPY_TRAINING <<< "${GPU_SPY_TRAINING_ARGS:---setups sync --steps 2 --timeout 200 --probe-memory}"
    SPY_DELAY=8 SPY_TRAINING_DELAY=30 SPY_TRAINING_LIMIT=170
    TESTS=(-q tests/test_averaging_core.py tests/test_averaging.py tests/test_noise.py tests/test_node.py tests/test_cli.py
           -k "cuda or device or pool or refuses or noise or seal")
    NET_TESTS=(-q -n 8 tests/test_noise.py tests/test_node.py tests/test_rpc_node.py tests/test_tensor_stream.py
               tests/test_relay.py tests/test_averaging.py tests/test_moe.py)
fi

for name in "${STEPS[@]}"; do
    case $name in
    env)
        step env 60 bash -c "nvidia-smi; nproc; free -g; \"$PY\" -c 'import sys, torch; print(sys.version);
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())'" ;;
    tests)
        step tests 120 "$PY" -m pytest -p no:cacheprovider "${TESTS[@]}" ;;
    net-tests)
        step net-tests 150 "$PY" -m pytest -p no:cacheprovider "${NET_TESTS[@]}" ;;
    training)
        # GPU_TRAINING_ARGS: more options for this run (--torch-threads 1, --setups sync,dpu, ...)
        step training "${GPU_TRAINING_LIMIT:-300}" "$PY" bench/gpu_training.py "${TRAINING[@]}" ${GPU_TRAINING_ARGS:-} \
            --json "$WORK/gpu_training.json" ;;
    allreduce)
        step allreduce 150 "$PY" bench/allreduce_speed.py "${ALLREDUCE[@]}" --json "$WORK/allreduce_speed.json" ;;
    allreduce-loop)
        step allreduce-loop 90 "$PY" bench/allreduce_speed.py "${LOOP[@]}" --json "$WORK/allreduce_loop.json" ;;
    noise-threads)
        step noise-threads 60 "$PY" bench/noise_threads.py "${HOPS[@]}" --json "$WORK/noise_threads.json" ;;
    moe)
        step moe 300 "$PY" bench/moe_gpu.py "${MOE[@]}" --systems "$MOE_SYSTEMS" --python-dedloc "$PY" --python-hivemind "$PY" \
            --path-dedloc "$DEDLOC_SITE" --path-hivemind "$HIVEMIND_SITE" --json "$WORK/moe_gpu.json" ;;
    diagnose)  # the training round's 27 MB/s on the H200 (2026-12-04) against allreduce_speed's 328: tensors
        # on the GPU (staging) or on the host, torch's intra-op threads one or one per core (0)
        for cfg in cpu:1 cuda:1 cuda:0 cpu:0; do
            dev=${cfg%:*} threads=${cfg#*:}
            [[ $DEVICE == cpu && $dev == cuda ]] && continue
            [[ $DEVICE == cpu && $threads == 0 ]] && continue  # the rehearsal: one config runs the loop
            step "round-$dev-$threads" 75 "$PY" bench/allreduce_speed.py "${ROUND[@]}" --device "$dev" \
                --torch-threads "$threads" --json "$WORK/round_${dev}_${threads}.json"
        done ;;
    spy-round)  # every thread of one peer (py-spy) while it averages 400 MB of GPU tensors, torch's threads its own
        step spy-round 90 env PY_SPY="$SPY" PYTHON="$PY" bash bench/gpu_spy.sh "$WORK/spy-round" 8 "$SPY_DELAY" \
            'averaging_pee[r]\.py' "$PY" bench/allreduce_speed.py "${SPY_ROUND[@]}" --device "$DEVICE" --torch-threads 0 ;;
    spy-training)  # the training path itself: one sync peer's rounds under cProfile, and py-spy on all its threads
        # (skipped when diagnose already reproduced the slow round with GPU tensors: spy-round shows that one)
        slow=$("$PY" -c "import glob, json, sys
rates = [c.get('mb_per_s', 0) for f in glob.glob(sys.argv[1] + '/round_cuda_*.json') for c in json.load(open(f))['cases']]
print(int(any(r < 100 for r in rates)))" "$WORK" 2>/dev/null)
        if [[ $slow == 1 ]]; then
            echo "spy-training skipped: a GPU round of diagnose ran under 100 MB/s" | tee -a "$SUMMARY"
            continue
        fi
        mkdir -p "$WORK/training-profile"
        # another run given (GPU_SPY_TRAINING_ARGS): py-spy alone, no cProfile (it doubled the sync round's
        # time on 2026-12-04, and would hold the GIL on the event loop's side of the question asked)
        profile_dir=$WORK/training-profile
        [[ -n ${GPU_SPY_TRAINING_ARGS:-} ]] && profile_dir=""
        DEDLOC_BENCH_PROFILE=$profile_dir step spy-training "$SPY_TRAINING_LIMIT" env PY_SPY="$SPY" \
            PYTHON="$PY" bash bench/gpu_spy.sh "$WORK/spy-training" 20 "$SPY_TRAINING_DELAY" \
            'gpu_training_pee[r]\.py.*--index 0' "$PY" bench/gpu_training.py "${SPY_TRAINING[@]}" \
            --json "$WORK/spy_training.json"
        "$PY" -c "import pstats, glob, sys
for f in sorted(glob.glob(sys.argv[1] + '/*.prof')):
    print('==', f); pstats.Stats(f).sort_stats('tottime').print_stats(25)" "$WORK/training-profile" \
            > "$WORK/training-profile.txt" 2>&1
        head -n 50 "$WORK/training-profile.txt" ;;
    moe-profile)
        mkdir -p "$WORK/moe-profile"
        DEDLOC_BENCH_PROFILE=$WORK/moe-profile step moe-profile 80 "$PY" bench/moe_gpu.py "${PROFILED[@]}" \
            --systems dedloc --python-dedloc "$PY" --path-dedloc "$DEDLOC_SITE" --json "$WORK/moe_profiled.json"
        "$PY" -c "import pstats, glob, sys
for f in sorted(glob.glob(sys.argv[1] + '/*.prof')):
    print('==', f); pstats.Stats(f).sort_stats('tottime').print_stats(25)" "$WORK/moe-profile" > "$WORK/moe-profile.txt" 2>&1
        head -n 60 "$WORK/moe-profile.txt" ;;
    *)
        echo "gpu_session: no step $name (env tests net-tests training allreduce allreduce-loop noise-threads moe moe-profile" \
             "diagnose spy-round spy-training)" >&2
        exit 2 ;;
    esac
done
echo "gpu_session: done $(date -u +%FT%TZ)${FAILED[*]:+, failed: ${FAILED[*]}}" | tee -a "$SUMMARY"
pack
[[ ${#FAILED[@]} == 0 ]]
