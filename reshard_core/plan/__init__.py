"""Planning: the layout table, validation, the per-rank planner, batches and the plan cache.

``plan_rank(table, rank, options)`` is a pure function of the table, the rank and the
``PlanOptions``; ``cached_plan_rank`` keys it by ``plan_cache_key``. Op records live in
``ops``.
"""
