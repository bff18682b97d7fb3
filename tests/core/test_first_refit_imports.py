"""The first refit in a process imports what it needs and nothing else.

A fresh interpreter joins a 1-rank Gloo world and refits plain modules: torch's DTensor package
(about a second on first import, sympy included) and the model frameworks stay unimported, and so
do the MXFP8 plugin's destination and Transformer Engine extraction modules. Then a transformers
model is refit: transformers is the user's own import, and reshard still imports neither
Megatron-Core nor vLLM (format detection reads class-module names only).
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys, tempfile, os
import torch
import torch.distributed as dist

store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
import reshard_core

def loaded(*names):
    return sorted(n for n in names if n in sys.modules)

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

WATCH = ("torch.distributed.tensor", "sympy", "transformers", "megatron", "megatron.core", "vllm",
         "transformer_engine", "reshard_mxfp8.destinations", "reshard_mxfp8.te_extract")
torch.manual_seed(0)
src, dst = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)), torch.nn.Sequential(
    torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
report = reshard_core.refit(src, dst)
plain = {"exact": same(src, dst), "bytes_local": report.bytes_local, "loaded": loaded(*WATCH)}

from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
hf_src, hf_dst = LlamaForCausalLM(config), LlamaForCausalLM(config)
reshard_core.refit(hf_src, hf_dst)
hf = {"exact": same(hf_src, hf_dst), "loaded": loaded("megatron", "megatron.core", "vllm")}
print(json.dumps({"plain": plain, "hf": hf}))
dist.destroy_process_group()
"""


def test_first_refit_imports_no_framework_and_no_dtensor():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["plain"] == {"exact": True, "bytes_local": (8 * 4 + 4 + 4 * 2 + 2) * 4, "loaded": []}
    assert result["hf"] == {"exact": True, "loaded": []}
