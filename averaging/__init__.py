"""Decentralized averaging: DHT group formation, butterfly all-reduce, load balancing.

May import :mod:`p2p` and :mod:`nat`; arrives with its own issue. Available so far:

* :mod:`averaging.tensor_stream`: send and receive torch tensors over any byte
  stream (a libp2p stream from ``Node.new_stream``), chunk by chunk without
  extra copies, with dtype and shape in a protobuf header
  (averaging/proto/tensor.proto) and limits a peer cannot exceed.
"""
