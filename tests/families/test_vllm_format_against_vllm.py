"""Format "vllm" agrees, bit for bit, with vLLM's own weight loader for every family, at TP1 and TP2.

vLLM's ``load_weights`` fills a real vLLM model (built in the test's processes, no engine) from an
HF checkpoint; every logical tensor the format reads back on each rank must be exactly the
checkpoint's region its layout names, and every padding view zero (the vocab's padding rows,
GPT-OSS's ``w2_bias`` on the ranks after the first). An independent oracle for the families' vLLM
tables: fused ``qkv_proj`` / ``fused_qkv_a_proj`` / ``gate_up_proj``, interleaved GPT-OSS experts,
per-head sinks, fp32 routers.
"""

from __future__ import annotations

import pytest
import tiny
from vllm_harness import write_model_dir
from vllm_loaded import loaded_problems

from reshard_core.testing.world import run_world

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", tiny.KINDS)
def test_the_format_reads_back_what_vllms_loader_wrote_at_tp1_and_tp2(tmp_path, kind):
    model_dir = str(write_model_dir(tmp_path / kind, tiny.hf_model(kind, seed=3), tokenizer=False))
    for tp in (1, 2):
        results = run_world(loaded_problems, tp, model_dir, tiny.config(kind).dtype, timeout=300)
        assert [problems for problems, _ in results] == [[]] * tp, f"TP{tp}"
        assert all(compared > 0 for _, compared in results)
