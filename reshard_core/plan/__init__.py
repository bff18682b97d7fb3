"""Planning: the layout table, validation, the per-rank planner, batches and the plan cache.

``plan_rank(table, rank, max_batch_bytes=..., ignore=..., tied=...)`` is a pure function of the
table and the rank; ``cached_plan_rank`` keys it by ``plan_cache_key``. Op records live in ``ops``.
"""
