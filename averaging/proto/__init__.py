"""Protobuf wire formats of the averaging layer (generated ``*_pb2`` modules, checked in)."""
