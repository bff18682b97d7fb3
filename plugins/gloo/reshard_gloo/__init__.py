"""reshard-gloo plugin."""
