"""reshard-ipc plugin: the ``ipc`` transport (``reshard_ipc.transport.IpcCopyService``).

Ranks on one host move bytes through POSIX shared memory: each rank stages what it sends in its own
segment and the receiver copies it out, with no socket in between. Pairs on different hosts go over a
fallback transport (``gloo`` by default). Loaded by name through the ``reshard.transports`` entry point.

- ``options``: ``IpcOptions``, what a user may set (fallback, channel size, a host label).
- ``segment``: shared-memory segments: create, map, unlink, and the sweep of a dead creator's.
- ``channel``: one direction between two ranks inside a segment: slots and their counters.
- ``hosts``: which peers share this host, decided through the group's store and a probe.
- ``pump``: the background thread that moves chunks through the channels.
- ``transport``: ``IpcCopyService``, the transport itself.
"""
