"""The built-in catalogue: configs copied from each model's public Hugging Face ``config.json``.

Multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``) are not part of the
catalogue shapes.
"""

from __future__ import annotations

from .configs import GPTConfig, MLAConfig

CONFIGS: dict[str, GPTConfig] = {
    # A small GPT like the one the Megatron extractor tests build on CPU (hidden 64, 4 heads, 2 query
    # groups, gated MLP), with a 4-expert MoE second half so every layout kind appears.
    "tiny-gpt": GPTConfig(
        "tiny-gpt",
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn=256,
        vocab=1024,
        experts=4,
        moe_ffn=128,
        first_dense_layers=2,
    ),
    # meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8, intermediate_size 14336, vocab_size 128256.
    "llama3-8b": GPTConfig(
        "llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256
    ),
    # meta-llama/Meta-Llama-3-70B config.json: hidden_size 8192, num_hidden_layers 80,
    # num_attention_heads 64, num_key_value_heads 8, intermediate_size 28672, vocab_size 128256.
    "llama3-70b": GPTConfig(
        "llama3-70b", hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256
    ),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, moe_intermediate_size 768,
    # intermediate_size 6144 (unused: every layer is MoE), vocab_size 151936, Q/K RMSNorm.
    "qwen3-30b-a3b": GPTConfig(
        "qwen3-30b-a3b",
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        ffn=6144,
        vocab=151936,
        qk_norm=True,
        experts=128,
        moe_ffn=768,
    ),
    # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, num_hidden_layers 61,
    # first_k_dense_replace 3, intermediate_size 18432, moe_intermediate_size 2048,
    # n_routed_experts 256, n_shared_experts 1, num_attention_heads 128, q_lora_rank 1536,
    # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128,
    # vocab_size 129280, topk_method noaux_tc (router expert bias, kept in fp32 by Megatron).
    "deepseek-v3": GPTConfig(
        "deepseek-v3",
        hidden=7168,
        layers=61,
        heads=128,
        kv_heads=128,
        ffn=18432,
        vocab=129280,
        experts=256,
        moe_ffn=2048,
        first_dense_layers=3,
        shared_expert_ffn=2048,
        expert_bias=True,
        mla=MLAConfig(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
    ),
}
