#!/usr/bin/env bash
# Writes (or, with --check, checks) the lock files from pyproject.toml and requirements/*.in,
# with uv's `pip compile`: exact versions and every file's sha256, for Python 3.11 on Linux.
#
#   requirements/runtime.txt   dedloc alone (a relay or a peer: `pip install dedloc`)
#   requirements/dev.txt       what `make venv` installs: runtime + [train] + [dev]
#   requirements/hivemind.txt  .venv-hivemind, the benchmarks' comparison peer
#
# Each is compiled with the existing lock as its starting point, so a run moves nothing that
# pyproject.toml still allows: `make lock` after editing pyproject.toml changes only what the
# edit needs. `make lock-upgrade` takes the newest of everything.
#
# --check compiles into a scratch folder and fails when any pinned name or version differs
# from the committed lock (pyproject.toml and the lock disagree). Only name==version lines are
# compared: a project that uploads one more wheel to a version already pinned adds a hash, and
# that is no disagreement. torch comes from the CPU wheel on local disk (--find-links
# /opt/wheels, where pip finds it too); PyPI's torch of the same version is a CUDA build of GBs.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
mode=${1:-write}
out=requirements
if [[ $mode == --check ]]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
    cp requirements/*.txt "$out"/
fi
upgrade=()
[[ $mode == --upgrade ]] && upgrade=(--upgrade)

compile() {  # compile OUTPUT INPUT... [FLAGS]
    local target=$1; shift
    "$UV" pip compile --quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
        --find-links /opt/wheels --no-emit-find-links --custom-compile-command "make lock" \
        "${upgrade[@]}" -o "$out/$target" "$@"
}
compile runtime.txt pyproject.toml requirements/build.in
compile dev.txt pyproject.toml requirements/build.in --extra train --extra dev
compile hivemind.txt requirements/hivemind.in

if [[ $mode == --check ]]; then
    status=0
    for f in runtime.txt dev.txt hivemind.txt; do
        pins() { grep -E '^[A-Za-z0-9_.-]+==' "$1" | sed 's/ .*//' | sort; }
        if ! diff <(pins "requirements/$f") <(pins "$out/$f") >"$out/$f.diff"; then
            echo "lock: requirements/$f disagrees with pyproject.toml / requirements/*.in (run 'make lock'):" >&2
            sed 's/^/  /' "$out/$f.diff" >&2
            status=1
        fi
    done
    [[ $status == 0 ]] && echo "lock: requirements/*.txt agree with pyproject.toml and requirements/*.in"
    exit $status
fi
