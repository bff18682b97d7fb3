"""reshard-nvshmem plugin."""
