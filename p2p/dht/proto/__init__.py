"""Protobuf messages of the DHT (generated ``*_pb2`` modules live here)."""
