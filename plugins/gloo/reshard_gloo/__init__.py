"""reshard-gloo plugin: the ``gloo`` transport (``reshard_gloo.transport.GlooCopyService``).

Moves CPU tensors over torch.distributed Gloo point-to-point ops and stages CUDA tensors through
pinned host memory; needs no CUDA. Loaded by name through the ``reshard.transports`` entry point.
"""
