#!/usr/bin/env bash
# Wheels for a lent GPU machine (the device tool's nvidia-h200: x86-64, its own Python 3.12 with
# torch, numpy, scipy and pytest, and no network), made here where pip reaches the registries.
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]        (default 3.12, the device's; 3.11 for a rehearsal here)
#
# Writes .whl/ (git ignores it; a device call carries it: carry=[".whl"]):
#   .whl/dedloc/    dedloc's runtime dependencies at requirements.lock's versions, and pytest-trio
#   .whl/hivemind/  hivemind 1.1.12 and its dependencies at bench/hivemind.lock's versions
#   .whl/tools/     py-spy 0.4.3 (a sampling profiler, unpacked, not installed: bench/gpu_spy.sh)
#   .whl/both/      the wheels both lists name at the same version, kept once (the call carries
#                   64 MiB in all, the working tree included)
# bench/gpu_session.sh installs both+dedloc into one folder and both+hivemind into another, so the
# two sides keep their own protobuf, as .venv and .venv-hivemind do here.
#
# Left out: what the device's image holds (torch, numpy, scipy and torch's own dependencies),
# packaging tools, type stubs, and grpcio on dedloc's side (py-libp2p names it; nothing imports it).
# Exceptions, each for want of a wheel for that Python:
#   fastecdsa 3.0.1 for requirements.lock's 2.3.2, which PyPI has only as C source needing GMP;
#     py-libp2p imports it at start for ECDSA keys, which dedloc never uses (its keys are Ed25519),
#     so only the import has to work, and 3.0.1 has the same modules.
#   python-baseconv, varint, prefetch-generator: pure-Python sources, built into wheels here.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.12}
PIP=(.venv/bin/python -m pip)
[[ -x .venv/bin/python ]] || { echo "gpu_wheels: run make venv first" >&2; exit 1; }
PLATFORMS=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${p}_x86_64")
done
# Pure-Python sources with no wheel on PyPI: built here (py3-none-any runs on any Python 3).
SOURCES="python-baseconv varint prefetch-generator"

names() {  # the pinned names of a lock, less what the device's image or a build needs instead
    grep -E '^[A-Za-z0-9]' "$1" | sed 's/ .*//' \
        | grep -v -E '^(pip|setuptools|wheel|uv|mypy-protobuf|types-[a-z-]+|torch|numpy|scipy|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec)=='
}

fetch() {  # fetch DIR NAME==VERSION...
    local dir=$1; shift
    mkdir -p "$dir"
    for spec in "$@"; do
        name=${spec%%==*}
        if [[ " $SOURCES " == *" $name "* ]]; then
            "${PIP[@]}" wheel -q --no-deps -w "$dir" "$spec"
        else
            "${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
                "${PLATFORMS[@]}" -d "$dir" "$spec"
        fi
    done 2> >(grep -v "^WARNING: Location" >&2)
}

rm -rf .whl
dedloc=$(names requirements.lock | grep -v -E '^(grpcio|fastecdsa)==')
fetch .whl/dedloc $dedloc fastecdsa==3.0.1 \
    "$(grep -E '^pytest-trio==' requirements-dev.lock | sed 's/ .*//')"
fetch .whl/hivemind $(names bench/hivemind.lock)
# py-spy, the sampling profiler the diagnosis steps attach to a worker (bench/gpu_spy.sh): a binary, unpacked there
fetch .whl/tools py-spy==0.4.3
mkdir -p .whl/both
for wheel in .whl/dedloc/*.whl; do
    if [[ -f .whl/hivemind/${wheel##*/} ]]; then
        mv "$wheel" .whl/both/ && rm ".whl/hivemind/${wheel##*/}"
    fi
done
echo "gpu_wheels: Python $VERSION: $(ls .whl/dedloc | wc -l) for dedloc, $(ls .whl/hivemind | wc -l) for hivemind," \
     "$(ls .whl/both | wc -l) for both; $(du -sh .whl | cut -f1) in .whl"
