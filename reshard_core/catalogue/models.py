"""The built-in catalogue: configs copied from each model's public Hugging Face ``config.json``.

Multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``) are not part of the
catalogue shapes.
"""

from __future__ import annotations

from .configs import GPTConfig, LinearAttentionConfig, MLAConfig

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
        experts_per_token=8,
        family="deepseek_v3",
    ),
    # moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, DeepSeek-V3's architecture):
    # hidden_size 7168, num_hidden_layers 61, first_k_dense_replace 1, intermediate_size 18432,
    # moe_intermediate_size 2048, n_routed_experts 384, num_experts_per_tok 8, n_shared_experts 1,
    # num_attention_heads 64, MLA ranks as DeepSeek-V3's, vocab_size 163840.
    "kimi-k2": GPTConfig(
        "kimi-k2",
        hidden=7168,
        layers=61,
        heads=64,
        kv_heads=64,
        ffn=18432,
        vocab=163840,
        experts=384,
        experts_per_token=8,
        moe_ffn=2048,
        first_dense_layers=1,
        shared_expert_ffn=2048,
        expert_bias=True,
        mla=MLAConfig(
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
        ),
        family="kimi_k2",
    ),
    # zai-org/GLM-4.5 config.json: hidden_size 5120, num_hidden_layers 92, first_k_dense_replace 3,
    # num_attention_heads 96, num_key_value_heads 8, head_dim 128, attention_bias (q/k/v), use_qk_norm,
    # partial_rotary_factor 0.5, intermediate_size 12288, moe_intermediate_size 1536, n_routed_experts
    # 160, num_experts_per_tok 8, n_shared_experts 1, vocab_size 151552 (router and bias fp32).
    "glm-4.5": GPTConfig(
        "glm-4.5",
        hidden=5120,
        layers=92,
        heads=96,
        kv_heads=8,
        head_dim=128,
        ffn=12288,
        vocab=151552,
        qk_norm=True,
        qkv_bias=True,
        experts=160,
        experts_per_token=8,
        moe_ffn=1536,
        first_dense_layers=3,
        shared_expert_ffn=1536,
        expert_bias=True,
        family="glm4_moe",
    ),
    # openai/gpt-oss-120b config.json: hidden_size 2880, num_hidden_layers 36, num_attention_heads 64,
    # num_key_value_heads 8, head_dim 64, intermediate_size 2880, num_local_experts 128,
    # num_experts_per_tok 4, vocab_size 201088; biases on q/k/v/o, the router and the experts;
    # learned attention sinks.
    "gpt-oss-120b": GPTConfig(
        "gpt-oss-120b",
        hidden=2880,
        layers=36,
        heads=64,
        kv_heads=8,
        head_dim=64,
        ffn=2880,
        vocab=201088,
        qkv_bias=True,
        linear_bias=True,
        sinks=True,
        experts=128,
        experts_per_token=4,
        moe_ffn=2880,
        family="gpt_oss",
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: hidden_size 2048, num_hidden_layers 48,
    # full_attention_interval 4, num_attention_heads 16, num_key_value_heads 2, head_dim 256 (q_proj
    # holds the output gate too), linear_num_key_heads 16, linear_num_value_heads 32,
    # linear_key/value_head_dim 128, linear_conv_kernel_dim 4, num_experts 512, num_experts_per_tok 10,
    # moe_intermediate_size 512, shared_expert_intermediate_size 512, intermediate_size 5632 (unused: every
    # layer is MoE), vocab_size 151936.
    "qwen3-next-80b": GPTConfig(
        "qwen3-next-80b",
        hidden=2048,
        layers=48,
        heads=16,
        kv_heads=2,
        head_dim=256,
        ffn=5632,
        vocab=151936,
        qk_norm=True,
        experts=512,
        experts_per_token=10,
        moe_ffn=512,
        shared_expert_ffn=512,
        shared_expert_gate=True,
        linear_attention=LinearAttentionConfig(
            key_heads=16, value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4, full_every=4
        ),
        family="qwen3_next",
    ),
}
