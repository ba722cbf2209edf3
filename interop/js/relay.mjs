// A js-libp2p circuit relay v2 server (TCP + Noise + Yamux, identify, ping,
// circuitRelayServer) for dedloc's NAT tests: the same role `dedloc relay` plays
// in tests/test_nat_matrix.py, played by js-libp2p.
//
//   node js/relay.mjs [--port 4001] [--listen /ip4/0.0.0.0/tcp/4001]
//                     [--identify-max-inbound-streams N]
//
// It listens on /ip4/0.0.0.0/tcp/<port> (default 4001; or on --listen) and, when
// ready, prints one JSON line
//   {"event":"listening","peer_id":"12D3...","addrs":["/ip4/.../tcp/4001/p2p/12D3..."],
//    "limits":{"data":"<bytes>","duration_ms":<ms>},"protocols":[...]}
// then reads commands from stdin, one JSON object per line:
//   {"cmd":"stats"} -> {"event":"stats","reservations":[{"peer_id":..,"addr":..,"limit":{..}}],
//                       "connections":[{"peer_id":..,"remote_addr":..,"direction":..}]}
//   {"cmd":"quit"}  -> exits 0
// It also prints unsolicited {"event":"peer:connect"|"peer:disconnect","peer_id":...}.
// It exits (0) when stdin closes, on SIGTERM and on SIGINT. Start failures print
// {"event":"fatal",...} and exit 1. DEBUG=libp2p:circuit-relay* shows js's own log
// on stderr.
//
// Limits: js's circuit relay v2 server limits each relayed connection to 2 min
// and 128 KiB (go-libp2p's defaults) unless told otherwise. The NAT matrix moves
// 4 MiB through relayed connections and keeps them for the whole cell, so the
// defaults are raised (still applied, so the STOP/HOP `limit` fields are sent and
// our client sees a limited relay, as with a real one): 1 GiB and 30 min per
// relayed connection, 1024 reservations, 1 h reservation TTL. (js sends the
// duration limit on the wire as its millisecond value, in the Limit.duration field
// that circuit-v2.md defines in seconds.)
//
// Identify runs at js-libp2p's defaults, like any js relay out there: one inbound
// identify stream per connection at a time, a second one is reset.
// --identify-max-inbound-streams raises that (debugging only).

import { createInterface } from 'node:readline'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { circuitRelayServer } from '@libp2p/circuit-relay-v2'

const AGENT_VERSION = 'dedloc-interop-js-relay/0.1.0'
const DATA_LIMIT = 1n << 30n // bytes per relayed connection, both directions together
const DURATION_LIMIT_MS = 30 * 60 * 1000 // js treats this as milliseconds
const RESERVATION_TTL_MS = 60 * 60 * 1000

function emit (obj) {
  process.stdout.write(JSON.stringify(obj, (_, v) => typeof v === 'bigint' ? v.toString() : v) + '\n')
}

function errorInfo (err) {
  return { error: String(err?.message ?? err), name: String(err?.name ?? 'Error') }
}

function parseArgs (argv) {
  const out = { listen: null, port: 4001, identifyMaxInbound: null }
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]
    if (arg === '--port') out.port = Number(argv[++i])
    else if (arg === '--listen') out.listen = argv[++i]
    else if (arg === '--identify-max-inbound-streams') out.identifyMaxInbound = Number(argv[++i])
    else throw new Error(`unknown argument ${arg}`)
  }
  if (!Number.isInteger(out.port) || out.port < 0 || out.port > 65535) throw new Error(`bad port ${out.port}`)
  return out
}

let node
try {
  const args = parseArgs(process.argv.slice(2))
  node = await createLibp2p({
    start: false,
    addresses: { listen: [args.listen ?? `/ip4/0.0.0.0/tcp/${args.port}`] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    nodeInfo: { userAgent: AGENT_VERSION },
    connectionManager: { maxConnections: 1024 },
    services: {
      identify: identify(args.identifyMaxInbound == null ? {} : { maxInboundStreams: args.identifyMaxInbound }),
      ping: ping(),
      relay: circuitRelayServer({
        reservations: {
          maxReservations: 1024,
          reservationTtl: RESERVATION_TTL_MS,
          applyDefaultLimit: true,
          defaultDataLimit: DATA_LIMIT,
          defaultDurationLimit: DURATION_LIMIT_MS
        },
        maxInboundHopStreams: 256,
        maxOutboundStopStreams: 1024
      })
    }
  })
  await node.start()
} catch (err) {
  emit({ event: 'fatal', ...errorInfo(err) })
  process.exit(1)
}

let stopping = false
async function shutdown (code) {
  if (stopping) return
  stopping = true
  try {
    await Promise.race([node.stop(), new Promise(resolve => setTimeout(resolve, 3000))])
  } catch {}
  process.exit(code)
}
process.on('SIGTERM', () => { shutdown(0) })
process.on('SIGINT', () => { shutdown(0) })

node.addEventListener('peer:connect', (evt) => emit({ event: 'peer:connect', peer_id: evt.detail.toString() }))
node.addEventListener('peer:disconnect', (evt) => emit({ event: 'peer:disconnect', peer_id: evt.detail.toString() }))

emit({
  event: 'listening',
  peer_id: node.peerId.toString(),
  addrs: node.getMultiaddrs().map(a => a.toString()),
  agent_version: AGENT_VERSION,
  limits: { data: DATA_LIMIT, duration_ms: DURATION_LIMIT_MS },
  protocols: node.getProtocols()
})

function stats () {
  const reservations = []
  for (const [peer, r] of node.services.relay.reservations.entries()) {
    reservations.push({
      peer_id: peer.toString(),
      addr: r.addr?.toString() ?? null,
      limit: r.limit == null ? null : { data: r.limit.data, duration: r.limit.duration }
    })
  }
  const connections = node.getConnections().map(c => ({
    peer_id: c.remotePeer.toString(),
    remote_addr: c.remoteAddr.toString(),
    direction: c.direction,
    status: c.status
  }))
  return { event: 'stats', reservations, connections }
}

const rl = createInterface({ input: process.stdin, crlfDelay: Infinity })
rl.on('line', (line) => {
  if (line.trim() === '') return
  let msg
  try {
    msg = JSON.parse(line)
  } catch (err) {
    emit({ event: 'error', cmd: null, ...errorInfo(err) })
    return
  }
  if (msg.cmd === 'stats') emit(stats())
  else if (msg.cmd === 'quit') shutdown(0)
  else emit({ event: 'error', cmd: msg.cmd ?? null, error: `unknown command ${JSON.stringify(msg.cmd)}`, name: 'Error' })
})
rl.on('close', () => { shutdown(0) })
