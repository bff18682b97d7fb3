"""Drop-in surfaces of other refit libraries, backed by reshard.

- ``reshard_core.compat.megatron``: Megatron-Core's ``megatron.core.resharding.refit`` surface
  (``swap_model_weights``, ``prepare_swap_model_weights``, ``reshard_model_weights``, the caches).

Nothing here is imported by ``import reshard_core``; each module imports only what it needs.
"""
