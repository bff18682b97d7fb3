"""Refit benchmark: warm refit seconds vs the wire floor and vs Megatron-Core's refit, per layout pair.

The same measurement as ``reshard bench`` (see ``reshard_bench.refit_bench``; needs reshard-bench),
runnable from a checkout: ``python benchmarks/bench_refit.py [reshard bench options]``, e.g.
``--size small --reps 3`` or ``--pair tp=2->tp=4 --json``. Defaults: the ~0.38 GB bf16 GPT (hidden
1024, 8 layers, vocab 32000) on 4 processes over Gloo, pairs TP2→TP4 (DP2 source), TP1→TP4,
TP4→TP2PP2, TP2PP2→TP1; with megatron-core installed the models are Megatron GPTModels and
Megatron-Core's own ``swap_model_weights(..., "gloo")`` is timed on them too (a case past
``--megatron-deadline`` seconds is reported as not finished).
"""

from __future__ import annotations

import sys

from reshard_core.cli.main import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
