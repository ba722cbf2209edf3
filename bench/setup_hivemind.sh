#!/usr/bin/env bash
# Create .venv-hivemind: a separate Python 3.11 venv holding hivemind for the
# DHT comparison benchmark (bench/dht.py). It is kept apart from .venv because
# hivemind pins protobuf/pydantic versions that conflict with the project's.
# Idempotent: a stamp file records the lock it was installed from; a new lock rebuilds it.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-hivemind
LOCK=bench/hivemind.lock  # hivemind 1.1.12 and torch 2.13.0 (CPU), exact versions with hashes (make lock)
STAMP="$VENV/.installed-$(sha256sum "$LOCK" | cut -c1-16)"

if [[ -f "$STAMP" ]]; then
    echo "setup_hivemind: $VENV already set up ($STAMP)"
    exit 0
fi

PY=${PYTHON:-python3.11}
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "setup_hivemind: $PY not found (set PYTHON=/path/to/python3.11)" >&2
    exit 1
fi

rm -rf "$VENV"
"$PY" -m venv "$VENV"
# torch in the lock is the CPU build on local disk (pip's find-links), never PyPI's CUDA one.
"$VENV/bin/python" -m pip install --quiet --require-hashes --no-deps -r "$LOCK"
"$VENV/bin/python" -m pip check

# Sanity checks: hivemind imports and its bundled p2pd binary runs.
"$VENV/bin/python" - <<'PY'
import os, subprocess
import hivemind
from hivemind.p2p import p2p_daemon
p2pd = os.path.join(os.path.dirname(p2p_daemon.__file__), "..", "hivemind_cli", "p2pd")
p2pd = os.path.normpath(p2pd)
assert os.access(p2pd, os.X_OK), f"p2pd not executable: {p2pd}"
out = subprocess.run([p2pd, "-help"], capture_output=True, text=True, timeout=30)
assert "listen" in (out.stdout + out.stderr), "p2pd -help printed nothing useful"
print(f"setup_hivemind: hivemind {hivemind.__version__} OK, p2pd at {p2pd}")
PY

touch "$STAMP"
echo "setup_hivemind: done"
