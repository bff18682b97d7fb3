"""Rank coordination: how the ranks of a refit stay in step and fail alike.

- groups: ``refit_group`` (one view of a process group or a ``TransferGroup``), ``transfer_group``
  (a group joining separate jobs), ``store_calls`` (bounded calls of a group's store);
- rounds: ``gather`` (every rank's bytes, bounded), ``agree`` (the agreement, start and closing
  rounds), ``problems`` (every rank raises any rank's problem), ``bounded`` (a collective waited
  within the refit's timeout);
- failures: ``failures`` (the failure board: a rank's error reaches its peers), ``watcher`` (ends a
  wait when a peer failed), ``broken`` (a group whose collective was abandoned refuses to refit).
"""
