#!/usr/bin/env bash
# Create .venv-libtorrent: a separate Python 3.11 venv holding libtorrent-rasterbar's Python binding
# (bench/libtorrent.lock: libtorrent 2.1.1, exact, with hashes) for bench/datasets.py's comparison.
# Idempotent: a stamp file records the lock it was installed from; a new lock rebuilds it.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-libtorrent
LOCK=bench/libtorrent.lock
STAMP="$VENV/.installed-$(sha256sum "$LOCK" | cut -c1-16)"

if [[ -f "$STAMP" ]]; then
    echo "setup_libtorrent: $VENV already set up ($STAMP)"
    exit 0
fi

PY=${PYTHON:-python3.11}
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --require-hashes --no-deps -r "$LOCK"
"$VENV/bin/python" -c "import libtorrent; print('setup_libtorrent: libtorrent', libtorrent.__version__, 'OK')"
touch "$STAMP"
