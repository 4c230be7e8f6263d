"""BlockConfig: the hyperparameters of one block, normalised from a transformers config.

A generated ``<family>/config.py`` holds the spec's field mapping (``FIELDS``) and defaults (``DEFAULTS``);
``read_block_config`` reads them into a BlockConfig and applies the spec's config adapter (one of
``CONFIG_ADAPTERS``) for derived values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bloombee.models.core.rotary import rope_layer_types, rope_parameters


@dataclass
class BlockConfig:
    hidden_size: int
    num_heads: int
    norm_eps: float
    intermediate_size: int | None = None  # None: 4 x hidden_size (bloom's configs name no width)
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    output_bias: bool | None = None  # the attention's output projection (None: as attention_bias; qwen2: none)
    mlp_bias: bool = False
    sliding_window: int | None = None
    alibi: bool = False  # attention scores biased by ALiBi slopes times key positions (bloom); set by the family
    attention_sinks: bool = False  # a learned logit per head joins each softmax and is dropped after it (gpt_oss)
    attn_scale: float | None = None  # the scores' scale where an adapter derives it (deepseek_v3: YaRN's mscale)
    # multi-head latent attention (deepseek_v3) where kv_lora_rank is set: the cache holds a latent and a rope key
    q_lora_rank: int | None = None  # queries through a rank-r bottleneck (None: one projection)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False  # the rope dimensions rotate in adjacent pairs (deepseek_v3)
    rope_layer_type: str | None = None  # the key of this layer's rope parameters where they differ by layer (gemma3)
    qk_norm_class: str = "RMSNorm"  # the norm QKNormAttention applies to each head's queries and keys (core.norms)
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power (None: head_dim's)
    attn_softcap: float | None = None  # scores pass through cap * tanh(scores / cap) before the mask (gemma2)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    swiglu_alpha: float = 1.702  # PackedMoEMLP's clamped SwiGLU: g * sigmoid(alpha * g) (gpt_oss)
    swiglu_limit: float | None = None  # ... with the gate clamped to <= limit and up to [-limit, limit]
    # GroupLimitedMoEMLP (deepseek_v3): sigmoid scores, experts chosen within the best groups, shared experts
    num_shared_experts: int = 0
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    qkv_layout: str = "separate"  # separate | interleaved | multi_query | grouped | concatenated (fused checkpoints)
    parallel_attention: bool = False
    separate_mlp_norm: bool = True  # parallel blocks: a second norm for the MLP input
    # falcon-style switches read from the config by the "falcon" adapter
    multi_query: bool = False
    new_decoder_architecture: bool = False
    num_parallel_norms: int | None = None

    def __post_init__(self):
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.output_bias is None:
            self.output_bias = self.attention_bias

    @property
    def latent(self) -> bool:
        """Multi-head latent attention: the KV cache holds per token one latent and one rope key for all heads."""
        return self.kv_lora_rank is not None

    @property
    def query_dim(self) -> int:
        """Width of one head's query (and key)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Width of the rotated part of a head (the whole head but in latent attention)."""
        return self.qk_rope_head_dim if self.latent else self.head_dim

    @property
    def cache_layout(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of the KV cache; latent attention's "keys" are its rope keys and its
        "values" its latents."""
        if self.latent:
            return 1, self.qk_rope_head_dim, self.kv_lora_rank
        return self.num_kv_heads, self.head_dim, self.head_dim

    @property
    def kv_elements_per_token(self) -> int:
        heads, key, value = self.cache_layout
        return heads * (key + value)


BLOCK_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(BlockConfig))


def standard_adapter(hf_config, cfg: BlockConfig, layer_index: int) -> BlockConfig:
    """Decoder-only pre-norm families: a per-layer sliding window when the config lists layer types, and the layer's
    own rope parameters where the config keeps them per layer type."""
    layer_types = getattr(hf_config, "layer_types", None)
    if cfg.sliding_window is not None and layer_types is not None:
        if layer_types[layer_index] != "sliding_attention":
            cfg.sliding_window = None
    rope_types = rope_layer_types(hf_config)
    if rope_types is not None:
        cfg.rope_layer_type = rope_types[layer_index]
    return cfg


def falcon_adapter(hf_config, cfg: BlockConfig, layer_index: int) -> BlockConfig:
    """Falcon: fused QKV layout, KV heads and norm arrangement follow new_decoder_architecture / multi_query."""
    if getattr(hf_config, "alibi", False):
        raise ValueError("Falcon checkpoints with alibi=True are not supported (only rotary Falcon models).")
    if cfg.new_decoder_architecture:
        cfg.qkv_layout = "grouped"
        two_norms = (cfg.num_parallel_norms or 2) == 2
        cfg.parallel_attention = True
        cfg.separate_mlp_norm = two_norms
    elif cfg.multi_query:
        cfg.qkv_layout = "multi_query"
        cfg.num_kv_heads = 1
        cfg.separate_mlp_norm = not cfg.parallel_attention
    else:
        cfg.qkv_layout = "interleaved"
        cfg.num_kv_heads = cfg.num_heads
        cfg.separate_mlp_norm = not cfg.parallel_attention
    return cfg


def sparse_moe_adapter(hf_config, cfg: BlockConfig, layer_index: int) -> BlockConfig:
    """A mixture of experts on every layer (qwen3_moe): configs that give some layers a dense MLP are refused."""
    dense = getattr(hf_config, "mlp_only_layers", None) or []
    step = getattr(hf_config, "decoder_sparse_step", 1)
    if dense or step != 1:
        raise ValueError(f"{hf_config.model_type} configs with dense-MLP layers (mlp_only_layers {dense}, "
                         f"decoder_sparse_step {step}) are not supported: every layer must be a mixture of experts.")
    return standard_adapter(hf_config, cfg, layer_index)


def bloom_adapter(hf_config, cfg: BlockConfig, layer_index: int) -> BlockConfig:
    """BLOOM: the released models' residual arrangement and projections; configs computing either differently (a
    residual taken after the norm, tensor-parallel-exact slices) are refused."""
    if getattr(hf_config, "apply_residual_connection_post_layernorm", False):
        raise ValueError("bloom configs with apply_residual_connection_post_layernorm=True are not supported.")
    if getattr(hf_config, "slow_but_exact", False) and getattr(hf_config, "pretraining_tp", 1) > 1:
        raise ValueError("bloom configs with slow_but_exact=True and pretraining_tp > 1 are not supported.")
    return cfg


def deepseek_adapter(hf_config, cfg: BlockConfig, layer_index: int) -> BlockConfig:
    """DeepSeek-V3: its first first_k_dense_replace layers have a dense MLP of intermediate_size (no experts), and
    the scores scale by (qk_nope + qk_rope)^-1/2 times YaRN's mscale squared where the rope is YaRN."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    if layer_index < getattr(hf_config, "first_k_dense_replace", 0):
        cfg.num_experts, cfg.intermediate_size = 0, hf_config.intermediate_size
    cfg.attn_scale = yarn_apply_mscale(rope_parameters(hf_config), cfg.query_dim ** -0.5)
    return standard_adapter(hf_config, cfg, layer_index)


CONFIG_ADAPTERS = {"standard": standard_adapter, "falcon": falcon_adapter, "sparse_moe": sparse_moe_adapter,
                   "bloom": bloom_adapter, "deepseek": deepseek_adapter}


def read_config_field(hf_config, attribute: str, field: str, defaults: dict, family: str):
    """``hf_config.<attribute>`` for block field ``field``; the family's default when it is missing or None."""
    value = getattr(hf_config, attribute, None)
    if value is None:
        if field not in defaults:
            raise ValueError(f"{family} config lacks {attribute!r} (block field {field!r}).")
        value = defaults[field]
    return value


def read_block_config(hf_config, layer_index: int, family: str, fields: dict[str, str], defaults: dict,
                      adapter: str) -> BlockConfig:
    """The BlockConfig of block ``layer_index``: mapped fields read, unmapped defaults as constants, then adapted."""
    values = {field: value for field, value in defaults.items() if field not in fields}
    for field, attribute in fields.items():
        values[field] = read_config_field(hf_config, attribute, field, defaults, family)
    return CONFIG_ADAPTERS[adapter](hf_config, BlockConfig(**values), layer_index)
