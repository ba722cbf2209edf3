// A js-libp2p peer (TCP + Noise + Yamux, identify, ping) driven over stdin/stdout
// for dedloc's interop tests.  One JSON object per line in both directions.
//
// On start it prints
//   {"event":"listening","peer_id":"12D3...","addrs":["/ip4/127.0.0.1/tcp/N/p2p/12D3..."],
//    "agent_version":"...","protocols":[...]}
// then reads commands from stdin, one per line.  Every command may carry an "id"
// (any JSON value) that is echoed in its reply.  Replies carry "event" = the
// command name and "ok": true, or "event": "error" with "cmd", "error", "name".
//
//   {"cmd":"dial","addr":"/ip4/127.0.0.1/tcp/N/p2p/<id>"}
//       -> {"event":"dial","ok":true,"peer_id":...,"remote_addr":...,"elapsed_ms":<float>}
//   {"cmd":"ping","addr":...} | {"cmd":"ping","peer_id":...}
//       -> {"event":"ping","ok":true,"peer_id":...,"rtt_ms":<int from js-libp2p>,"elapsed_ms":<float>}
//   {"cmd":"identify","peer_id":...[,"fresh":true][,"timeout_ms":5000]}
//       -> {"event":"identify","ok":true,"peer_id":..., "fresh":{...}|null,
//           "fresh_error":{...}|null, "first":{...}|null, "peer_store":{...}}
//       "fresh" runs identify again over the open connection (default true);
//       "first" is the first identify of that peer that completed or failed
//       (normally the one js-libp2p ran by itself on connection open);
//       "peer_store" is what the peer store holds now, with the stored
//       signed peer record envelope re-verified here.
//   {"cmd":"peers"}   -> {"event":"peers","ok":true,"connections":[...]}
//   {"cmd":"hangup","peer_id":...} -> close every connection to it: {"event":"hangup","ok":true}
//   {"cmd":"handle","protocol":"/x/1.0.0"}
//       -> serve an echo protocol (echo bytes until the remote closes, then close);
//          js-libp2p then sends identify/push to connected peers
//   {"cmd":"echo","peer_id":...,"protocol":...,"data":"text"}
//       -> open a stream, send data, close the write side, read until EOF:
//          {"event":"echo","ok":true,"data":"what came back"}
//   {"cmd":"bulk","peer_id":...,"send_bytes":N,"send_seed":"<32 hex>","recv_bytes":M,
//    "recv_seed":"<32 hex>"[,"mode":"concurrent"|"after_eof"][,"protocol":...][,"timeout_ms":60000]}
//       -> js opens a bulk stream (below) to the peer as the client: sends the request
//          header, then N bytes of keystream(send_seed) in odd-sized chunks, half-closes,
//          and reads the reply to EOF:
//          {"event":"bulk","ok":true,"protocol":...,"sent_bytes":N,"sent_sha256":hex,
//           "received_bytes":<payload bytes>,"received_sha256":hex,
//           "trailer":{"peer_received_bytes":...,"peer_received_sha256":hex,
//                      "peer_sent_sha256":hex}|null,"stream_id":...,"elapsed_ms":...}
//   {"cmd":"quit"}    -> {"event":"quit","ok":true}, then the process exits 0.
//
// Bulk transfer protocol /dedloc/interop/bulk/1.0.0, which js serves from the start:
//   client -> server: a 25-byte header: mode (u8: 0 = the server sends after the
//     client's EOF, 1 = at once, while still receiving), M (u64 BE: bytes wanted
//     back), seed (16 bytes); then any number of payload bytes; then EOF (FIN).
//   server -> client: M bytes of keystream(seed); then a 72-byte trailer: payload
//     bytes it received (u64 BE), their sha256 (32), sha256 of the M bytes it
//     sent (32); then EOF.
//   keystream(seed) = AES-128-CTR with key = seed and a zero 16-byte IV, applied
//   to zeros: deterministic pseudo-random bytes both languages produce at GB/s.
//   Every bulk stream js served emits {"event":"bulk:served",...} (or
//   "bulk:failed") with the same numbers.
//
// Unsolicited events (no "id"): peer:connect, peer:disconnect, peer:identify
// (every identify that completed, the automatic one on connect included),
// identify:error, warning; and "fatal" if the node cannot start (then exit 1).
// The process exits when stdin closes.  It listens on JSPEER_LISTEN (default
// /ip4/127.0.0.1/tcp/0; loopback only) and dials loopback addresses only (and,
// in a lab namespace, JSPEER_LAB_PREFIX's).

import { createInterface } from 'node:readline'
import { performance } from 'node:perf_hooks'
import { createCipheriv, createHash } from 'node:crypto'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify, identifyPush } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { peerIdFromString, peerIdFromPublicKey, peerIdFromCID } from '@libp2p/peer-id'
import { publicKeyFromProtobuf } from '@libp2p/crypto/keys'
import { RecordEnvelope, PeerRecord } from '@libp2p/peer-record'
import { multiaddr } from '@multiformats/multiaddr'

const AGENT_VERSION = 'dedloc-interop-js/0.1.0'

function emit (obj) {
  process.stdout.write(JSON.stringify(obj) + '\n')
}

function errorInfo (err) {
  return {
    error: String(err?.message ?? err),
    name: err?.name ?? 'Error',
    ...(err?.code != null ? { code: String(err.code) } : {})
  }
}

const sleep = (ms) => new Promise(resolve => setTimeout(resolve, ms))

const listenAddr = process.env.JSPEER_LISTEN ?? '/ip4/127.0.0.1/tcp/0'
if (!listenAddr.startsWith('/ip4/127.0.0.1/') && !listenAddr.startsWith('/ip6/::1/')) {
  emit({ event: 'fatal', ...errorInfo(new Error(`refusing to listen off loopback: ${listenAddr}`)) })
  process.exit(2)
}

// JSPEER_NOISE_MUXER_EXTENSION=0: list no stream muxers in the Noise handshake's
// extensions (as a peer without inlined muxer negotiation does), so the muxer is
// negotiated with multistream-select after the handshake, both ways.
function noiseWithoutMuxerExtension () {
  const make = noise()
  return (components) => {
    const inner = make(components)
    const wrapped = Object.create(inner)
    wrapped.secureOutbound = (conn, options) => inner.secureOutbound(conn, { ...options, skipStreamMuxerNegotiation: true })
    wrapped.secureInbound = (conn, options) => inner.secureInbound(conn, { ...options, skipStreamMuxerNegotiation: true })
    return wrapped
  }
}
const muxerExtension = process.env.JSPEER_NOISE_MUXER_EXTENSION !== '0'

const node = await createLibp2p({
  start: false,
  addresses: { listen: [listenAddr] },
  transports: [tcp()],
  connectionEncrypters: [muxerExtension ? noise() : noiseWithoutMuxerExtension()],
  streamMuxers: [yamux()],
  // never dial anything but loopback, whatever a remote peer tells us
  connectionGater: {
    denyDialMultiaddr: (ma) => !isLoopback(ma.toString())
  },
  nodeInfo: { userAgent: AGENT_VERSION },
  services: {
    identify: identify(),
    identifyPush: identifyPush(),
    ping: ping()
  }
})

// The first identify result (or error) per peer: normally the one js-libp2p ran
// by itself when the connection opened.
const firstIdentify = new Map()

function describeIdentifyResult (result) {
  let publicKeyPresent = false
  let publicKeyMatches = false
  let publicKeyType = null
  if (result.publicKey != null) {
    publicKeyPresent = true
    try {
      const key = publicKeyFromProtobuf(result.publicKey)
      publicKeyType = key.type
      publicKeyMatches = peerIdFromPublicKey(key).equals(result.peerId)
    } catch {}
  }
  return {
    peer_id: result.peerId.toString(),
    protocol_version: result.protocolVersion ?? null,
    agent_version: result.agentVersion ?? null,
    protocols: [...(result.protocols ?? [])].sort(),
    listen_addrs: (result.listenAddrs ?? []).map(a => a.toString()),
    observed_addr: result.observedAddr?.toString() ?? null,
    public_key_present: publicKeyPresent,
    public_key_type: publicKeyType,
    public_key_matches: publicKeyMatches,
    // js-libp2p only returns signedPeerRecord once RecordEnvelope.openAndCertify
    // verified the signature and the record's peer id matched the connection's
    signed_peer_record: result.signedPeerRecord == null
      ? null
      : {
          verified: true,
          seq: result.signedPeerRecord.seq.toString(),
          addrs: result.signedPeerRecord.addresses.map(a => a.toString())
        }
  }
}

node.addEventListener('peer:connect', (evt) => {
  emit({ event: 'peer:connect', peer_id: evt.detail.toString() })
})
node.addEventListener('peer:disconnect', (evt) => {
  emit({ event: 'peer:disconnect', peer_id: evt.detail.toString() })
})
node.addEventListener('peer:identify', (evt) => {
  const info = describeIdentifyResult(evt.detail)
  if (!firstIdentify.has(info.peer_id)) firstIdentify.set(info.peer_id, info)
  emit({ event: 'peer:identify', ...info })
})

// A failed automatic identify (e.g. a signed peer record that does not verify)
// is swallowed by js-libp2p; wrap it so that the test can see why.
{
  const svc = node.services.identify
  const original = svc.identify.bind(svc)
  svc.identify = async (connection, options) => {
    try {
      return await original(connection, options)
    } catch (err) {
      const pid = connection.remotePeer.toString()
      if (!firstIdentify.has(pid)) firstIdentify.set(pid, { error: errorInfo(err) })
      emit({ event: 'identify:error', peer_id: pid, ...errorInfo(err) })
      throw err
    }
  }
}

function parsePeerId (s) {
  if (typeof s !== 'string') throw new Error('peer_id must be a string')
  return peerIdFromString(s)
}

// JSPEER_LAB_PREFIX (e.g. "/ip4/198.18."): also dial addresses under it. Only
// bench/wan.py sets it, for a peer it runs inside a namespace of its own NAT lab,
// where that prefix is the lab's internet and nothing else is reachable.
const labPrefix = process.env.JSPEER_LAB_PREFIX ?? null

function isLoopback (s) {
  return s.startsWith('/ip4/127.') || s.startsWith('/ip6/::1/') || (labPrefix != null && s.startsWith(labPrefix))
}

function parseTarget (cmd) {
  if (cmd.addr != null) {
    const ma = multiaddr(cmd.addr)
    // checked here too: the connection gater only sees addresses after DNS resolution
    if (!isLoopback(ma.toString())) throw new Error(`refusing to dial off loopback: ${ma}`)
    return ma
  }
  if (cmd.peer_id != null) return parsePeerId(cmd.peer_id)
  throw new Error('need "addr" or "peer_id"')
}

async function verifyStoredEnvelope (peerId, envelopeBytes) {
  if (envelopeBytes == null) return { present: false, verified: false }
  try {
    const envelope = await RecordEnvelope.openAndCertify(envelopeBytes, PeerRecord.DOMAIN)
    const record = PeerRecord.createFromProtobuf(envelope.payload)
    const signer = peerIdFromCID(envelope.publicKey.toCID())
    const ok = signer.equals(peerId) && record.peerId.equals(peerId)
    return {
      present: true,
      verified: ok,
      ...(ok ? {} : { error: `record for ${record.peerId}, signed by ${signer}` }),
      seq: record.seqNumber.toString(),
      addrs: record.multiaddrs.map(a => a.toString()),
      payload_type: Buffer.from(envelope.payloadType).toString('hex')
    }
  } catch (err) {
    return { present: true, verified: false, ...errorInfo(err) }
  }
}

async function peerStoreInfo (peerId) {
  let peer
  try {
    peer = await node.peerStore.get(peerId)
  } catch (err) {
    if (err?.name === 'NotFoundError') return null
    throw err
  }
  const meta = (k) => {
    const v = peer.metadata.get(k)
    return v == null ? null : Buffer.from(v).toString('utf8')
  }
  return {
    protocols: [...peer.protocols].sort(),
    addrs: peer.addresses.map(a => ({ addr: a.multiaddr.toString(), certified: a.isCertified })),
    agent_version: meta('AgentVersion'),
    protocol_version: meta('ProtocolVersion'),
    public_key_present: peer.id.publicKey != null,
    public_key_matches: peer.id.publicKey != null && peerIdFromPublicKey(peer.id.publicKey).equals(peerId),
    signed_peer_record: await verifyStoredEnvelope(peerId, peer.peerRecordEnvelope)
  }
}

async function openConnection (peerId, timeoutMs) {
  const conns = node.getConnections(peerId).filter(c => c.status === 'open')
  if (conns.length > 0) return conns[0]
  return await node.dial(peerId, { signal: AbortSignal.timeout(timeoutMs) })
}

// ---------------------------------------------------------------- bulk transfer

const BULK_PROTOCOL = '/dedloc/interop/bulk/1.0.0'
const BULK_HEADER = 25
const BULK_TRAILER = 72
const BULK_MODES = { after_eof: 0, concurrent: 1 }
// sizes the sender cycles through: frame/message boundaries fall everywhere
const BULK_CHUNKS = [65536, 1048576 + 7, 3, 262144, 99991, 65535 + 1]

function keystream (seed) {
  if (seed.length !== 16) throw new Error('a keystream seed is 16 bytes')
  const cipher = createCipheriv('aes-128-ctr', seed, Buffer.alloc(16))
  const zeros = Buffer.alloc(BULK_CHUNKS.reduce((a, b) => Math.max(a, b)))
  return (n) => cipher.update(zeros.subarray(0, n))
}

function parseSeed (hex, what) {
  if (typeof hex !== 'string' || !/^[0-9a-fA-F]{32}$/.test(hex)) throw new Error(`${what} must be 32 hex digits`)
  return Buffer.from(hex, 'hex')
}

function parseCount (n, what) {
  if (!Number.isSafeInteger(n) || n < 0) throw new Error(`${what} must be a non-negative integer`)
  return n
}

// The pieces of whatever a stream yields (Uint8Array or Uint8ArrayList).
function * piecesOf (buf) {
  if (buf instanceof Uint8Array) yield buf
  else yield * buf
}

function rejectOnAbort (signal) {
  return new Promise((_resolve, reject) => {
    if (signal.aborted) reject(signal.reason)
    signal.addEventListener('abort', () => reject(signal.reason), { once: true })
  })
}

// Send n bytes of keystream(seed) in odd-sized chunks, honouring backpressure.
async function sendKeystream (stream, seed, n, signal) {
  const next = keystream(seed)
  const hash = createHash('sha256')
  let left = n
  let i = 0
  while (left > 0) {
    const size = Math.min(left, BULK_CHUNKS[i++ % BULK_CHUNKS.length])
    const chunk = next(size)
    hash.update(chunk)
    left -= size
    if (!stream.send(chunk)) await stream.onDrain({ signal })
  }
  return hash.digest()
}

async function sendAll (stream, data, signal) {
  if (!stream.send(data)) await stream.onDrain({ signal })
}

function bulkHeader (mode, wanted, seed) {
  const header = Buffer.alloc(BULK_HEADER)
  header.writeUInt8(mode, 0)
  header.writeBigUInt64BE(BigInt(wanted), 1)
  seed.copy(header, 9)
  return header
}

// Server side: read the header, then the payload to EOF (hashing it), send
// the wanted bytes (at once or after EOF), then the trailer, then close.
async function serveBulk (stream, connection) {
  const start = performance.now()
  const signal = AbortSignal.timeout(120000)
  const received = createHash('sha256')
  let receivedBytes = 0
  let header = Buffer.alloc(0)
  let mode = null
  let wanted = 0
  let seed = null
  let sending = null
  const startSending = () => {
    sending = sendKeystream(stream, seed, wanted, signal)
    sending.catch(() => {}) // awaited below; avoid an unhandled rejection meanwhile
  }
  try {
    const reading = (async () => {
      for await (const buf of stream) {
        for (let piece of piecesOf(buf)) {
          if (mode === null) {
            const need = BULK_HEADER - header.length
            header = Buffer.concat([header, piece.subarray(0, need)])
            piece = piece.subarray(need)
            if (header.length < BULK_HEADER) continue
            mode = header.readUInt8(0)
            if (mode !== 0 && mode !== 1) throw new Error(`unknown bulk mode ${mode}`)
            wanted = Number(header.readBigUInt64BE(1))
            seed = header.subarray(9, 25)
            if (mode === 1) startSending()
          }
          if (piece.length > 0) {
            received.update(piece)
            receivedBytes += piece.length
          }
        }
      }
    })()
    await Promise.race([reading, rejectOnAbort(signal)])
    if (mode === null) throw new Error(`bulk stream ended inside its header (${header.length} bytes)`)
    if (sending === null) startSending()
    const sentHash = await Promise.race([sending, rejectOnAbort(signal)])
    const receivedHash = received.digest()
    const trailer = Buffer.alloc(BULK_TRAILER)
    trailer.writeBigUInt64BE(BigInt(receivedBytes), 0)
    receivedHash.copy(trailer, 8)
    sentHash.copy(trailer, 40)
    await sendAll(stream, trailer, signal)
    await stream.close({ signal })
    emit({
      event: 'bulk:served',
      peer_id: connection.remotePeer.toString(),
      stream_id: stream.id,
      mode: mode === 1 ? 'concurrent' : 'after_eof',
      received_bytes: receivedBytes,
      received_sha256: receivedHash.toString('hex'),
      sent_bytes: wanted,
      sent_sha256: sentHash.toString('hex'),
      elapsed_ms: performance.now() - start
    })
  } catch (err) {
    emit({
      event: 'bulk:failed',
      peer_id: connection.remotePeer.toString(),
      stream_id: stream.id,
      received_bytes: receivedBytes,
      ...errorInfo(err)
    })
    stream.abort(err)
  }
}

// Client side, for the "bulk" command.
async function bulkClient (cmd) {
  const peerId = parsePeerId(cmd.peer_id)
  const protocol = cmd.protocol ?? BULK_PROTOCOL
  const sendBytes = parseCount(cmd.send_bytes, 'send_bytes')
  const recvBytes = parseCount(cmd.recv_bytes, 'recv_bytes')
  const sendSeed = parseSeed(cmd.send_seed, 'send_seed')
  const recvSeed = parseSeed(cmd.recv_seed, 'recv_seed')
  const mode = BULK_MODES[cmd.mode ?? 'concurrent']
  if (mode == null) throw new Error(`mode must be one of ${Object.keys(BULK_MODES)}`)
  const signal = AbortSignal.timeout(cmd.timeout_ms ?? 60000)
  const start = performance.now()
  const stream = await node.dialProtocol(peerId, protocol, { signal })
  const received = createHash('sha256')
  let receivedBytes = 0
  // the last BULK_TRAILER bytes seen are held back: they are the trailer at EOF
  let tail = Buffer.alloc(0)
  const reading = (async () => {
    for await (const buf of stream) {
      for (const piece of piecesOf(buf)) {
        const joined = tail.length > 0 ? Buffer.concat([tail, piece]) : Buffer.from(piece.buffer, piece.byteOffset, piece.byteLength)
        const cut = Math.max(0, joined.length - BULK_TRAILER)
        if (cut > 0) {
          received.update(joined.subarray(0, cut))
          receivedBytes += cut
        }
        tail = Buffer.from(joined.subarray(cut)) // a copy: the stream may reuse its buffers
      }
    }
  })()
  reading.catch(() => {})
  let sentHash
  try {
    await sendAll(stream, bulkHeader(mode, recvBytes, recvSeed), signal)
    sentHash = await sendKeystream(stream, sendSeed, sendBytes, signal)
    await stream.close({ signal })
    await Promise.race([reading, rejectOnAbort(signal)])
  } catch (err) {
    stream.abort(err)
    throw err
  }
  const trailer = tail.length === BULK_TRAILER
    ? {
        peer_received_bytes: Number(tail.readBigUInt64BE(0)),
        peer_received_sha256: tail.subarray(8, 40).toString('hex'),
        peer_sent_sha256: tail.subarray(40, 72).toString('hex')
      }
    : null
  return {
    protocol: stream.protocol,
    stream_id: stream.id,
    sent_bytes: sendBytes,
    sent_sha256: sentHash.toString('hex'),
    // with no trailer, everything that came is counted as payload
    received_bytes: trailer == null ? receivedBytes + tail.length : receivedBytes,
    received_sha256: trailer == null ? received.update(tail).digest('hex') : received.digest('hex'),
    trailer,
    elapsed_ms: performance.now() - start
  }
}

const handlers = {
  async dial (cmd) {
    const timeoutMs = cmd.timeout_ms ?? 10000
    const start = performance.now()
    const conn = await node.dial(parseTarget(cmd), { signal: AbortSignal.timeout(timeoutMs) })
    return {
      peer_id: conn.remotePeer.toString(),
      remote_addr: conn.remoteAddr.toString(),
      direction: conn.direction,
      elapsed_ms: performance.now() - start
    }
  },

  async ping (cmd) {
    const timeoutMs = cmd.timeout_ms ?? 10000
    const target = parseTarget(cmd)
    const start = performance.now()
    const rtt = await node.services.ping.ping(target, { signal: AbortSignal.timeout(timeoutMs) })
    const elapsed = performance.now() - start
    let peerId = cmd.peer_id ?? null
    if (peerId == null) {
      const p2p = target.getComponents().filter(c => c.name === 'p2p').pop()
      peerId = p2p?.value ?? null
    }
    return { peer_id: peerId, rtt_ms: rtt, elapsed_ms: elapsed }
  },

  async hangup (cmd) {
    await node.hangUp(parseTarget(cmd))
    return {}
  },

  async identify (cmd) {
    const peerId = parsePeerId(cmd.peer_id)
    const timeoutMs = cmd.timeout_ms ?? 5000
    const deadline = Date.now() + timeoutMs
    let fresh = null
    let freshError = null
    if (cmd.fresh ?? true) {
      const conn = await openConnection(peerId, timeoutMs)
      // identify allows one outbound stream per connection: if js-libp2p's own
      // identify is still running, wait a little and try again
      for (;;) {
        try {
          const result = await node.services.identify.identify(conn, {
            signal: AbortSignal.timeout(Math.max(100, deadline - Date.now()))
          })
          fresh = describeIdentifyResult(result)
          break
        } catch (err) {
          const busy = err?.name === 'TooManyOutboundProtocolStreamsError' || /too many outbound/i.test(String(err?.message))
          if (busy && Date.now() + 100 < deadline) {
            await sleep(50)
            continue
          }
          freshError = errorInfo(err)
          break
        }
      }
    } else {
      // wait (bounded) for js-libp2p's own identify to have finished
      while (!firstIdentify.has(peerId.toString()) && Date.now() < deadline) await sleep(20)
    }
    return {
      peer_id: peerId.toString(),
      fresh,
      fresh_error: freshError,
      first: firstIdentify.get(peerId.toString()) ?? null,
      peer_store: await peerStoreInfo(peerId)
    }
  },

  async peers () {
    return {
      connections: node.getConnections().map(c => ({
        peer_id: c.remotePeer.toString(),
        remote_addr: c.remoteAddr.toString(),
        direction: c.direction,
        status: c.status,
        encryption: c.encryption ?? null,
        multiplexer: c.multiplexer ?? null
      }))
    }
  },

  async handle (cmd) {
    if (typeof cmd.protocol !== 'string') throw new Error('need "protocol"')
    await node.handle(cmd.protocol, async (stream) => {
      try {
        for await (const buf of stream) {
          if (!stream.send(buf)) await stream.onDrain({ signal: AbortSignal.timeout(10000) })
        }
        await stream.close({ signal: AbortSignal.timeout(10000) })
      } catch (err) {
        stream.abort(err)
      }
    })
    return { protocol: cmd.protocol, protocols: node.getProtocols().sort() }
  },

  async echo (cmd) {
    const peerId = parsePeerId(cmd.peer_id)
    const signal = AbortSignal.timeout(cmd.timeout_ms ?? 10000)
    const stream = await node.dialProtocol(peerId, cmd.protocol, { signal })
    const chunks = []
    const reading = (async () => {
      for await (const buf of stream) chunks.push(Buffer.from(buf.subarray()))
    })()
    try {
      if (!stream.send(Buffer.from(String(cmd.data ?? ''), 'utf8'))) await stream.onDrain({ signal })
      await stream.close({ signal })
      await Promise.race([
        reading,
        new Promise((_resolve, reject) => {
          signal.addEventListener('abort', () => reject(signal.reason), { once: true })
        })
      ])
    } catch (err) {
      stream.abort(err)
      throw err
    }
    return { protocol: stream.protocol, data: Buffer.concat(chunks).toString('utf8') }
  },

  async bulk (cmd) {
    return await bulkClient(cmd)
  },

  async quit () {
    return {}
  }
}

let quitting = false
async function shutdown (code) {
  if (quitting) return
  quitting = true
  try {
    await Promise.race([node.stop(), sleep(3000)])
  } catch {}
  process.exit(code)
}

async function handleLine (line) {
  line = line.trim()
  if (line === '') return
  let cmd
  try {
    cmd = JSON.parse(line)
    if (cmd === null || typeof cmd !== 'object' || typeof cmd.cmd !== 'string') {
      throw new Error('a command is a JSON object with a string "cmd"')
    }
  } catch (err) {
    emit({ event: 'error', cmd: null, line, ...errorInfo(err) })
    return
  }
  const idPart = cmd.id === undefined ? {} : { id: cmd.id }
  const handler = Object.hasOwn(handlers, cmd.cmd) ? handlers[cmd.cmd] : null
  if (handler == null) {
    emit({ event: 'error', ...idPart, cmd: cmd.cmd, ...errorInfo(new Error(`unknown cmd ${JSON.stringify(cmd.cmd)}`)) })
    return
  }
  try {
    const reply = await handler(cmd)
    emit({ event: cmd.cmd, ...idPart, ok: true, ...reply })
  } catch (err) {
    emit({ event: 'error', ...idPart, cmd: cmd.cmd, ...errorInfo(err) })
  }
  if (cmd.cmd === 'quit') await shutdown(0)
}

process.on('unhandledRejection', (err) => {
  emit({ event: 'warning', what: 'unhandledRejection', ...errorInfo(err) })
})
process.on('uncaughtException', (err) => {
  emit({ event: 'warning', what: 'uncaughtException', ...errorInfo(err) })
})
process.on('SIGTERM', () => { shutdown(0) })
process.on('SIGINT', () => { shutdown(0) })
process.stdout.on('error', () => { shutdown(0) })

try {
  await node.start()
  await node.handle(BULK_PROTOCOL, (stream, connection) => serveBulk(stream, connection), {
    maxInboundStreams: 64,
    maxOutboundStreams: 64
  })
} catch (err) {
  emit({ event: 'fatal', ...errorInfo(err) })
  process.exit(1)
}
emit({
  event: 'listening',
  peer_id: node.peerId.toString(),
  addrs: node.getMultiaddrs().map(a => a.toString()),
  agent_version: AGENT_VERSION,
  protocols: node.getProtocols().sort()
})

// Commands run concurrently (a slow dial does not hold up a quit); replies are
// matched by "id".  Once stdin closes, wait for the commands in flight, then exit.
const inFlight = new Set()
const rl = createInterface({ input: process.stdin, crlfDelay: Infinity })
rl.on('line', (line) => {
  const p = handleLine(line).finally(() => inFlight.delete(p))
  inFlight.add(p)
})
rl.on('close', async () => {
  await Promise.race([Promise.allSettled([...inFlight]), sleep(5000)])
  await shutdown(0)
})
