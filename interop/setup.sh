#!/usr/bin/env bash
# Installs what the js-libp2p interop tests need, idempotently:
#   1. node 22 into interop/.node/ from the npm package pinned in package.json
#      ("nodeRuntime": package, exact version and sha512 integrity);
#   2. interop/node_modules/ via `npm ci` (run under that node 22), only when
#      node_modules is missing or was installed from another package-lock.json.
# Needs only python3, an `npm` client and the npm registry.  Prints the node 22 path last:
#   NODE22=/abs/path/to/interop/.node/bin/node
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE"
NODE_DIR="$HERE/.node"
NODE_BIN="$NODE_DIR/bin/node"
STAMP="$HERE/node_modules/.dedloc-lock.sha256"

log() { printf 'interop/setup: %s\n' "$*" >&2; }

# --- an npm client (any node >= 18 can run it; we run it under node 22 below) ---
if ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "no npm on PATH: installing Debian's npm"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
    else
        log "error: npm is needed (to fetch node 22 and the js packages) and is not on PATH"
        exit 1
    fi
fi

# --- the pinned node runtime, read from package.json without needing node -----
read_pin() { python3 -c 'import json,sys; print(json.load(open("package.json"))["nodeRuntime"][sys.argv[1]])' "$1"; }
NODE_PKG="$(read_pin package)"
NODE_VER="$(read_pin version)"
NODE_SRI="$(read_pin integrity)"

have_node() {
    [ -x "$NODE_BIN" ] && [ "$("$NODE_BIN" --version 2>/dev/null)" = "v$NODE_VER" ]
}

if have_node; then
    log "node v$NODE_VER already in .node/"
else
    log "fetching $NODE_PKG@$NODE_VER"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && npm pack --silent "$NODE_PKG@$NODE_VER" >/dev/null 2>"$tmp/pack.err") || {
        cat "$tmp/pack.err" >&2; log "error: npm pack $NODE_PKG@$NODE_VER failed"; exit 1; }
    tgz="$(ls "$tmp"/*.tgz)"
    got="$(python3 -c 'import base64,hashlib,sys; print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tgz")"
    if [ "$got" != "$NODE_SRI" ]; then
        log "error: integrity mismatch for $NODE_PKG@$NODE_VER: got $got, pinned $NODE_SRI"
        exit 1
    fi
    rm -rf "$NODE_DIR.partial"
    mkdir -p "$NODE_DIR.partial"
    tar -xzf "$tgz" -C "$NODE_DIR.partial" --strip-components=1 package/bin/node package/LICENSE
    rm -rf "$NODE_DIR"
    mv "$NODE_DIR.partial" "$NODE_DIR"
    have_node || { log "error: $NODE_BIN does not run"; exit 1; }
    rm -rf "$tmp"
    trap - EXIT
fi

# --- node_modules from the committed lockfile, under node 22 --------------------
export PATH="$NODE_DIR/bin:$PATH"   # npm's `#!/usr/bin/env node` now finds node 22
want="$(sha256sum package-lock.json package.json | sha256sum | cut -d' ' -f1)"
if [ -d node_modules ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    log "node_modules up to date"
else
    log "npm ci (node $(node --version), npm $(npm --version 2>/dev/null))"
    npm ci --no-audit --no-fund --loglevel=error >&2
    printf '%s\n' "$want" >"$STAMP"
fi

# a smoke check: the packages load under node 22
node --input-type=module -e "await import('libp2p'); await import('@libp2p/tcp'); await import('@libp2p/circuit-relay-v2');" \
    || { log "error: js-libp2p does not load under node 22"; exit 1; }

log "ready"
echo "NODE22=$NODE_BIN"
