"""reshard-bench: the ``reshard demo`` and ``reshard bench`` commands and what they measure with.

- ``plugin``: the hook module (entry point ``reshard``: ``bench``) that adds both commands.
- ``demo_cmd``, ``bench_cmd``: the commands (options, reports); ``commands``: what both share.
- ``demo``, ``refit_bench``: the work on every rank and the report; ``worlds``: how their worlds spawn.
- ``gpt``, ``layouts``, ``pairs``: a pure-torch GPT in FSDP2, Megatron-style and declared layouts,
  or Megatron-Core's GPTModel, as a checked source/destination pair.
- ``floor``, ``timing``, ``notes``, ``megatron_peer``: the wire floor, fair timing, report notes,
  Megatron-Core's own refit on CPU.
"""
