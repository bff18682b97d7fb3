"""Quick start: refit a Megatron-Core GPTModel (tensor parallel 2) into a transformers Llama.

Run it as it is (it spawns a 2-process Gloo world on loopback; CPU only; needs megatron-core and
transformers)::

    python examples/megatron_to_hf.py

Each rank holds half of a Megatron TP2 model (group-major fused ``linear_qkv``, stride-2 fused
``linear_fc1``, a vocabulary of 100 padded to 128 rows) and a whole ``LlamaForCausalLM``.
``reshard_core.refit`` detects both formats and moves every Megatron shard straight into the HF
tensors (q/k/v split out of the fused QKV, gate/up out of fc1, padding rows never sent); the
padded vocabulary is the one thing it cannot know, so the source format names the real size.
The check: HF's logits equal Megatron's own TP2 forward (fp32, CPU) on the same tokens.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import reshard_core
from reshard_core.testing.world import run_world

WORLD = 2
VOCAB, PADDED_VOCAB = 100, 128  # Megatron pads to a multiple of make_vocab_size_divisible_by·TP
HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, LAYERS = 64, 8, 2, 8, 96, 2
TOKENS = torch.tensor([[3, 17, 42, 99, 0, 64, 7], [88, 5, 23, 61, 12, 90, 31]])


def build_megatron(tp: int):
    """A Llama-like Megatron-Core GPTModel (local spec: RMSNorm, RoPE, gated SiLU, GQA) in TP ``tp``."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from reshard_core.testing.models import build_pg_collection

    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6, init_method_std=0.2,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=PADDED_VOCAB, max_sequence_length=16,
        position_embedding_type="rope", rotary_base=10000, parallel_output=False,
        share_embeddings_and_output_weights=False, pg_collection=build_pg_collection(tp=tp),
    )  # fmt: skip


def build_llama():
    """The inference model: a transformers Llama with the same shapes and the real vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def step(rank: int, world: int) -> float:
    """One rank: build both models, refit, compare logits; returns the largest logits difference."""
    from reshard_core.formats.megatron import MegatronFormat
    from reshard_core.testing.megatron_forward import allow_cpu_forward, gpt_logits
    from reshard_core.testing.models import init_megatron

    warnings.filterwarnings("ignore", module=r"(megatron|torch\.distributed)\.")  # CUDA-minded advice
    init_megatron()
    allow_cpu_forward()
    torch.manual_seed(0)  # Megatron's CPU init draws the whole weight, then keeps this rank's shard
    train = build_megatron(tp=world)
    infer = build_llama()

    report = reshard_core.refit(train, infer, src_format=MegatronFormat(vocab_size=VOCAB))
    if rank == 0:
        print(report)
    real_bytes = sum(p.numel() * p.element_size() for p in infer.parameters())
    assert report.bytes_received + report.bytes_local == real_bytes  # no padding row was sent

    seq = TOKENS.shape[1]
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked
    megatron = gpt_logits(train, TOKENS, torch.arange(seq).expand_as(TOKENS), causal)[..., :VOCAB]
    with torch.no_grad():
        hf = infer(TOKENS).logits
    diff = float((hf - megatron).abs().max())
    if rank == 0:
        spread = float(megatron.max() - megatron.min())
        print(f"logits {tuple(hf.shape)}: max |HF - Megatron TP{world}| = {diff:.2e} (span {spread:.2f})")
    dist.barrier()
    return diff


if __name__ == "__main__":
    diffs = run_world(step, WORLD, timeout=240)
    ok = max(diffs) < 1e-4
    print("verified: HF logits equal Megatron's on every rank" if ok else f"MISMATCH: {max(diffs):.2e}")
    raise SystemExit(0 if ok else 1)
