"""Ask the home router to forward our listen port: PCP, NAT-PMP or UPnP IGD.

Why: a volunteer behind a home NAT cannot be dialled, so every byte to it goes
through a relay or waits for hole punching. Many home routers (miniupnpd in
OpenWrt and many vendor firmwares, Apple base stations, FRITZ!Box) will forward
a port on request; with a forward the node is directly reachable and serves
others at full speed. :func:`map_port` asks, keeps the forward alive while the
``async with`` block runs, and removes it on exit.

Three protocols, because routers speak different subsets:

* PCP (RFC 6887) MAP, the successor of NAT-PMP: one UDP exchange with port 5351,
  a nonce that makes the mapping ours alone.
* NAT-PMP (RFC 6886): the same port, the older and more widespread message set.
* UPnP IGD: SSDP discovery, the device description over HTTP, then SOAP calls to
  the WANIPConnection/WANPPPConnection control URL.

Layout: a module per protocol (``pcp``, ``natpmp``, ``upnp``), each with its
wire format as pure functions (``*_request`` builds bytes, ``decode_*``/
``parse_*`` turn bytes into values or raise) tested without sockets, thin trio
I/O below them, and its mapper; ``common`` holds what they share; ``mapping``
has :func:`probe` and :func:`map_port` on top.

What may leave the host: UDP to the default gateway (or the one given) on port
5351, SSDP M-SEARCH unicast to it and multicast to 239.255.255.250 with
``IP_MULTICAST_TTL`` 2 from the interface facing it, and HTTP to the address
that answered the search. Nothing else: LOCATION and control URLs must be IP
literals of the host that answered, so a forged SSDP reply cannot send us
anywhere. Every read is capped (:data:`MAX_XML` for bodies) and every wait has a
timeout.
"""

from __future__ import annotations

from .common import (
    Protocol,
    Method,
    PMP_PORT,
    PCP_VERSION,
    SSDP_GROUP,
    SSDP_PORT,
    SSDP_TTL,
    MAX_XML,
    MAX_HTTP_HEAD,
    MAX_SSDP_DATAGRAM,
    MAX_PCP_MESSAGE,
    MAX_UPNP_LEASE,
    IGD_SEARCH_TARGETS,
    WAN_SERVICE_TYPES,
    PortMappingError,
    MalformedResponse,
    MappingRefused,
    PortMappingUnavailable,
    parse_default_gateway,
    default_gateway,
    local_address_towards,
    _ipv4,
    _check_port,
    _udp_exchange,
    _describe,
    _Grant,
    _Mapper,
)
from .natpmp import (
    NATPMP_RESULTS,
    NatPmpAddress,
    NatPmpMapping,
    natpmp_address_request,
    natpmp_map_request,
    natpmp_delete_request,
    decode_natpmp_response,
    natpmp_retransmit_delays,
    natpmp_address_reply,
    natpmp_map_reply,
    natpmp_external_address,
    natpmp_map,
    _NatPmpMapper,
)
from .pcp import (
    PCP_OPCODE_ANNOUNCE,
    PCP_OPCODE_MAP,
    PCP_RESULTS,
    _PCP_HEADER,
    _PCP_MAP,
    PcpAnnounce,
    PcpMapping,
    _mapped,
    _unmapped,
    _pcp_request_header,
    pcp_announce_request,
    pcp_map_request,
    decode_pcp_response,
    pcp_retransmit_delays,
    pcp_announce_reply,
    pcp_map_reply,
    pcp_announce,
    pcp_map,
    _PcpMapper,
)
from .upnp import (
    HttpResponse,
    http_request,
    parse_http_response,
    _dechunk,
    SsdpResponse,
    ssdp_search_request,
    parse_ssdp_response,
    IgdService,
    _local,
    parse_xml,
    _child_text,
    _same_host_http_url,
    parse_device_description,
    UPNP_ERRORS,
    _SERVICE_TYPE,
    soap_envelope,
    parse_soap_fault,
    decode_soap_response,
    http_exchange,
    UpnpGateway,
    soap_call,
    ssdp_search,
    discover_upnp,
    _UpnpMapper,
)
from .mapping import (
    mappable_port,
    PortMappingConfig,
    GatewaySupport,
    _resolve_gateway,
    _Discovery,
    probe,
    PortMapping,
    _establish,
    RENEW_RETRY_MAX,
    _keep_renewed,
    map_port,
    _unmap_quietly,
)

__all__ = [
    "mappable_port",
    "PortMappingConfig",
    "Protocol",
    "Method",
    "PMP_PORT",
    "PCP_VERSION",
    "SSDP_GROUP",
    "SSDP_PORT",
    "SSDP_TTL",
    "MAX_XML",
    "MAX_HTTP_HEAD",
    "MAX_SSDP_DATAGRAM",
    "MAX_PCP_MESSAGE",
    "MAX_UPNP_LEASE",
    "IGD_SEARCH_TARGETS",
    "WAN_SERVICE_TYPES",
    "PortMappingError",
    "MalformedResponse",
    "MappingRefused",
    "PortMappingUnavailable",
    "parse_default_gateway",
    "default_gateway",
    "local_address_towards",
    "NATPMP_RESULTS",
    "NatPmpAddress",
    "NatPmpMapping",
    "natpmp_address_request",
    "natpmp_map_request",
    "natpmp_address_reply",
    "natpmp_map_reply",
    "natpmp_delete_request",
    "decode_natpmp_response",
    "natpmp_retransmit_delays",
    "natpmp_external_address",
    "natpmp_map",
    "PCP_OPCODE_ANNOUNCE",
    "PCP_OPCODE_MAP",
    "PCP_RESULTS",
    "PcpAnnounce",
    "PcpMapping",
    "pcp_announce_request",
    "pcp_map_request",
    "pcp_announce_reply",
    "pcp_map_reply",
    "decode_pcp_response",
    "pcp_retransmit_delays",
    "pcp_announce",
    "pcp_map",
    "HttpResponse",
    "http_request",
    "parse_http_response",
    "SsdpResponse",
    "ssdp_search_request",
    "parse_ssdp_response",
    "IgdService",
    "parse_xml",
    "parse_device_description",
    "UPNP_ERRORS",
    "soap_envelope",
    "parse_soap_fault",
    "decode_soap_response",
    "http_exchange",
    "UpnpGateway",
    "soap_call",
    "ssdp_search",
    "discover_upnp",
    "_UpnpMapper",
    "GatewaySupport",
    "probe",
    "PortMapping",
    "RENEW_RETRY_MAX",
    "map_port",
]
