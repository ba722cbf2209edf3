// A js-libp2p peer with the whole NAT stack, for the NAT lab: TCP + Noise +
// Yamux, identify, ping, circuit relay v2 (transport: reservations and relayed
// dials), DCUtR and AutoNAT v2 -- what a js-libp2p app behind a home router runs.
// interop/test_js_nat.py puts it behind each NAT kind of nat/lab.py, against a
// dedloc peer, through a dedloc relay.
//
//   node js/natpeer.mjs --listen /ip4/0.0.0.0/tcp/4001 --relay <relay multiaddr> --lab-prefix /ip4/11.0. [--no-identify-push]
//
// It dials the relay, asks for a reservation (listening on /p2p-circuit), and
// prints {"event":"listening","peer_id":...,"addrs":[...]} once started. Then
// unsolicited events, one JSON object per line:
//   {"event":"addrs","addrs":[...]}           our advertised addresses changed
//                                              (a reservation; an address AutoNAT confirmed)
//   {"event":"connection:open","peer_id":..,"remote_addr":..,"direction":..,"limited":bool,"t_ms":..}
//   {"event":"connection:close","peer_id":..,"remote_addr":..,"limited":bool,"t_ms":..}
// and commands on stdin, one JSON object per line, each answered by one line
// (carrying the command's "id", as peer.mjs's replies do):
//   {"cmd":"dial","addrs":[...]}  -> {"event":"dial","ok":true,"limited":bool,"elapsed_ms":..}
//   {"cmd":"state","peer_id":..}  -> {"event":"state","ok":true,"connections":[{"remote_addr","limited"}]}
//   {"cmd":"ping","peer_id":..}   -> {"event":"ping","ok":true,"rtt_ms":..}
//   {"cmd":"identify","peer_id":..} -> identify over our first connection to it:
//                                    {"event":"identify","ok":true,"protocols":[..],"limited":bool}
//   {"cmd":"quit"}                -> exits 0 (so does a closed stdin)
// Errors answer {"event":"error","cmd":..,"error":..}. Start failures print
// {"event":"fatal",...} and exit 1.
//
// It dials nothing outside --lab-prefix (the lab's internet, a /15 that exists only
// inside the test's namespaces), whatever a peer tells it.

import { createInterface } from 'node:readline'
import { performance } from 'node:perf_hooks'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify, identifyPush } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { circuitRelayTransport } from '@libp2p/circuit-relay-v2'
import { dcutr } from '@libp2p/dcutr'
import { autoNATv2 } from '@libp2p/autonat-v2'
import { peerIdFromString } from '@libp2p/peer-id'
import { multiaddr } from '@multiformats/multiaddr'

const AGENT_VERSION = 'dedloc-interop-js-natpeer/0.1.0'
const started = performance.now()

function emit (obj) {
  process.stdout.write(JSON.stringify(obj) + '\n')
}

function errorInfo (err) {
  return { error: String(err?.message ?? err), name: String(err?.name ?? 'Error') }
}

function parseArgs (argv) {
  const out = { listen: '/ip4/0.0.0.0/tcp/4001', relay: null, labPrefix: null, identifyPush: true }
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]
    if (arg === '--listen') out.listen = argv[++i]
    else if (arg === '--relay') out.relay = argv[++i]
    else if (arg === '--lab-prefix') out.labPrefix = argv[++i]
    // rust-libp2p's default, and js-libp2p without the service: address changes are never pushed
    else if (arg === '--no-identify-push') out.identifyPush = false
    else throw new Error(`unknown argument ${arg}`)
  }
  if (out.relay == null || out.labPrefix == null) throw new Error('--relay and --lab-prefix are required')
  return out
}

let args
let node
try {
  args = parseArgs(process.argv.slice(2))
  const allowed = (ma) => ma.toString().startsWith(args.labPrefix) || ma.toString().startsWith('/p2p/')
  node = await createLibp2p({
    start: false,
    addresses: { listen: [args.listen, '/p2p-circuit'] },
    transports: [tcp(), circuitRelayTransport()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    connectionGater: {
      // relayed addresses are checked by their relay's part
      denyDialMultiaddr: (ma) => !allowed(ma.toString().includes('/p2p-circuit') ? multiaddr(ma.toString().split('/p2p-circuit')[0]) : ma)
    },
    nodeInfo: { userAgent: AGENT_VERSION },
    services: {
      identify: identify(),
      ...(args.identifyPush ? { identifyPush: identifyPush() } : {}),
      ping: ping(),
      dcutr: dcutr(),
      autoNAT: autoNATv2()
    }
  })
  node.addEventListener('self:peer:update', () => {
    emit({ event: 'addrs', addrs: node.getMultiaddrs().map(a => a.toString()), t_ms: performance.now() - started })
  })
  node.addEventListener('connection:open', (evt) => {
    const c = evt.detail
    emit({ event: 'connection:open', id: c.id, peer_id: c.remotePeer.toString(), remote_addr: c.remoteAddr.toString(),
           direction: c.direction, limited: c.limits != null, t_ms: performance.now() - started })
  })
  node.addEventListener('connection:close', (evt) => {
    const c = evt.detail
    emit({ event: 'connection:close', id: c.id, peer_id: c.remotePeer.toString(), remote_addr: c.remoteAddr.toString(),
           direction: c.direction, limited: c.limits != null, t_ms: performance.now() - started })
  })
  await node.start()
  await node.dial(multiaddr(args.relay))
} catch (err) {
  emit({ event: 'fatal', ...errorInfo(err) })
  process.exit(1)
}

emit({ event: 'listening', peer_id: node.peerId.toString(), addrs: node.getMultiaddrs().map(a => a.toString()) })

async function handle (cmd) {
  if (cmd.cmd === 'dial') {
    const t0 = performance.now()
    const conn = await node.dial(cmd.addrs.map(a => multiaddr(a)), { signal: AbortSignal.timeout(cmd.timeout_ms ?? 30000) })
    return { limited: conn.limits != null, remote_addr: conn.remoteAddr.toString(), elapsed_ms: performance.now() - t0 }
  }
  if (cmd.cmd === 'state') {
    const conns = cmd.peer_id == null ? node.getConnections() : node.getConnections(peerIdFromString(cmd.peer_id))
    return { connections: conns.map(c => ({ peer_id: c.remotePeer.toString(), remote_addr: c.remoteAddr.toString(),
                                            limited: c.limits != null, status: c.status })) }
  }
  if (cmd.cmd === 'identify') {
    const conn = node.getConnections(peerIdFromString(cmd.peer_id))[0]
    if (conn == null) throw new Error('not connected')
    const result = await node.services.identify.identify(conn, { signal: AbortSignal.timeout(cmd.timeout_ms ?? 10000) })
    return { protocols: result.protocols, limited: conn.limits != null }
  }
  if (cmd.cmd === 'ping') {
    const rtt = await node.services.ping.ping(peerIdFromString(cmd.peer_id), { signal: AbortSignal.timeout(cmd.timeout_ms ?? 10000) })
    return { rtt_ms: rtt }
  }
  throw new Error(`unknown command ${cmd.cmd}`)
}

async function quit () {
  try {
    await Promise.race([node.stop(), new Promise(resolve => setTimeout(resolve, 3000))])
  } catch {}
  process.exit(0)
}

process.on('SIGTERM', quit)
const lines = createInterface({ input: process.stdin })
lines.on('close', quit)
for await (const line of lines) {
  if (!line.trim()) continue
  let cmd
  try {
    cmd = JSON.parse(line)
  } catch (err) {
    emit({ event: 'error', cmd: null, ...errorInfo(err) })
    continue
  }
  if (cmd.cmd === 'quit') await quit()
  try {
    emit({ event: cmd.cmd, ok: true, id: cmd.id, ...(await handle(cmd)) })
  } catch (err) {
    emit({ event: 'error', cmd: cmd.cmd, id: cmd.id, ...errorInfo(err) })
  }
}
