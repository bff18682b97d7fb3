"""reshard-nccl plugin: the ``nccl`` transport (``reshard_nccl.transport.NcclCopyService``).

Batched NCCL point-to-point of CUDA tensors on a dedicated stream (ordering rules in
``reshard_nccl.streams``). On a machine without CUDA or NCCL it loads and reports why it is
unavailable. Loaded by name through the ``reshard.transports`` entry point.
"""
