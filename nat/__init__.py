"""NAT traversal for dedloc nodes: reachability, circuit relay v2, autorelay, DCUtR, port mapping.

Built on :mod:`p2p` (and only on it); arrives with the NAT traversal issue.
"""
