"""reshard-nvshmem: transport ``nvshmem``, one-sided pipelined puts into NVSHMEM symmetric slots.

Modules: ``schedule`` (pure: which bytes go to which receiver slot in which round), ``slots`` (pure:
one rank's stream steps and signal counts), ``engine`` (issues the steps on pluggable stream ops),
``exchange`` (agreement on a run's messages over torch.distributed), ``symmetric`` (nvshmem4py:
bootstrap, symmetric memory, stream ops), ``transport`` (the ``CopyService``). Importing any of
them never imports nvshmem4py; only building the transport does.
"""
