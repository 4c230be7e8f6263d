"""Shared fixtures: tiny random checkpoints (one per model family variant) saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch

# variant -> (transformers config class, model class, config kwargs); hidden 64, 4 heads, fp32
TINY_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
               max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=0)
TINY_VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, num_key_value_heads=4)),
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, num_key_value_heads=2,
                                                         attention_bias=True, mlp_bias=True)),
    "llama-rope-llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama-rope-linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=96, num_key_value_heads=2,
                                                           sliding_window=8)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, num_key_value_heads=2, head_dim=32)),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, use_sliding_window=True, sliding_window=6,
        max_window_layers=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=96, num_key_value_heads=2)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(intermediate_size=96, num_key_value_heads=2, head_dim=32)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
        head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=96, num_key_value_heads=2, sliding_window=8)),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 16 for i in range(8)],
                             long_factor=[2.0 + i / 4 for i in range(8)]))),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        sliding_window_pattern=2,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_key_value_heads=2,
                                                           num_local_experts=4, num_experts_per_tok=2)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=48, num_attention_heads=6)),  # slopes past 2^k
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(  # a limit small enough to clamp
        intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, swiglu_limit=0.1, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32))),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek-v3-plain": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # one query projection, rope halves
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, rope_interleave=False)),
    "falcon-7b": ("FalconConfig", "FalconForCausalLM", dict(
        multi_query=True, parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False)),
    "falcon-sequential": ("FalconConfig", "FalconForCausalLM", dict(
        multi_query=False, parallel_attn=False, new_decoder_architecture=False, bias=True, alibi=False)),
    "falcon-40b": ("FalconConfig", "FalconForCausalLM", dict(
        new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, bias=False, alibi=False)),
}


def make_tiny_model(variant: str, num_layers: int = 4, seed: int = 0, **overrides):
    """A random transformers model of the variant (eval mode, fp32)."""
    import transformers

    config_cls, model_cls, kwargs = TINY_VARIANTS[variant]
    kwargs = {**TINY_COMMON, **kwargs, "num_hidden_layers": num_layers, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # make norms non-trivial so loading mistakes show
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name.split(".")[-2]:
                p.add_(torch.randn_like(p) * 0.1)
        for name, buffer in model.named_buffers():  # and DeepSeek-V3's routing corrections
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.1)
    return model


def make_tiny_multimodal_gemma3(num_layers: int = 4, seed: int = 0):
    """A random Gemma3ForConditionalGeneration (as gemma-3-4b..27b) whose text model is the gemma3 variant's."""
    import transformers

    text = {**TINY_COMMON, **TINY_VARIANTS["gemma3"][2], "num_hidden_layers": num_layers}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=127, boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """Factory: tiny_checkpoint(variant, num_layers=4, **save_kwargs) -> (folder, transformers model)."""

    def make(variant: str, num_layers: int = 4, save_kwargs: dict | None = None, **overrides):
        model = make_tiny_model(variant, num_layers, **overrides)
        folder = tmp_path / f"{variant}-{num_layers}"
        model.save_pretrained(folder, **(save_kwargs or {}))
        return folder, model

    return make


@pytest.fixture
def single_thread_torch():
    """Tiny models run fastest (and steadiest on a shared machine) with one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
