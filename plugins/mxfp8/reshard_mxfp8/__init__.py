"""reshard-mxfp8 plugin."""
