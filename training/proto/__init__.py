"""Protobuf wire formats of the training layer (generated ``*_pb2`` modules, checked in)."""
