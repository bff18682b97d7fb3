"""reshard-nccl plugin."""
