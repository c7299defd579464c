"""Shards between the trainer's device and the wire: flat parameter and gradient buffers
(flat), device and host copies in the compute dtype (device, accelerator), compressed
pushes with error feedback (push_compression), and one step's pushes and pulls in a
thread pool (shard_io).
"""
