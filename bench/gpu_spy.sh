#!/usr/bin/env bash
# Where a worker's threads spend a round, sampled from outside (py-spy), for the GPU session's diagnosis.
#
#   bash bench/gpu_spy.sh OUT SECONDS DELAY PATTERN COMMAND...
#
# Runs COMMAND; DELAY s after the first process whose command line matches the regex PATTERN (a
# `--boot` node never) appears, py-spy records it for SECONDS at 100 Hz, every thread, idle ones too,
# without stopping it: raw stacks in OUT.raw, and in OUT.txt each thread's share of the samples and
# its most frequent innermost frames. Write PATTERN with a bracket (averaging_pee[r]\.py) so that it
# never matches this script's own command line. PY_SPY: the py-spy binary. Exit status: COMMAND's.
set -uo pipefail
out=$1 seconds=$2 delay=$3 pattern=$4
shift 4
SPY=${PY_SPY:-py-spy}
"$@" &
cmd=$!
pid=""
for _ in $(seq 1200); do
    for p in $(pgrep -f "$pattern"); do
        grep -qa -- --boot "/proc/$p/cmdline" 2>/dev/null || { pid=$p; break; }
    done
    [[ -n $pid ]] && break
    kill -0 "$cmd" 2>/dev/null || break
    sleep 0.1
done
if [[ -n $pid ]]; then
    sleep "$delay"
    echo "gpu_spy: recording pid $pid for ${seconds}s: $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-200)"
    "$SPY" record --pid "$pid" --duration "$seconds" --rate 100 --threads --idle --nonblocking --format raw \
        -o "$out.raw" > "$out.spy.log" 2>&1 || echo "gpu_spy: py-spy failed: $(tail -n 3 "$out.spy.log")"
    # then as long again, only the samples of the thread holding the GIL: who keeps it from the event loop
    "$SPY" record --pid "$pid" --duration "$seconds" --rate 100 --threads --gil --nonblocking --format raw \
        -o "$out.gil.raw" >> "$out.spy.log" 2>&1 || echo "gpu_spy: py-spy --gil failed: $(tail -n 3 "$out.spy.log")"
    "${PYTHON:-python3}" - "$out.raw" "$out.gil.raw" > "$out.txt" 2>&1 <<'PY'
import collections, os, re, sys
for path in sys.argv[1:]:
    if not os.path.exists(path):
        continue
    what = "the thread holding the GIL only" if path.endswith(".gil.raw") else "every thread, idle ones too"
    print(f"#### {os.path.basename(path)}: {what}")
    threads, leaves = collections.Counter(), collections.defaultdict(collections.Counter)
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        name = re.sub(r"^thread \(\w+\):? ?", "", frames[0]) or frames[0]
        threads[name] += int(count)
        leaves[name][" <- ".join(reversed(frames[-3:][1 if len(frames) <= 3 else 0:]))] += int(count)
    total = sum(threads.values()) or 1
    for name, n in threads.most_common():
        print(f"== {name}: {n} samples ({n / total:.0%} of all threads' samples)")
        for leaf, k in leaves[name].most_common(12):
            print(f"   {k / n:6.1%}  {leaf}")
PY
    head -n 60 "$out.txt"
fi
wait "$cmd"
