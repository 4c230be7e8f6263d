"""Hand-written compute shared by all model families: KV cache, attention, rotary, norms, MLPs, masks, blocks,
the block stack and client head, config reading and the Family a generated package assembles."""

from bloombee.models.core.attention import ATTENTIONS, Attention, FusedQKVAttention, QKNormAttention
from bloombee.models.core.block import DecoderBlock, ParallelDecoderBlock
from bloombee.models.core.config import BLOCK_CONFIG_FIELDS, CONFIG_ADAPTERS, BlockConfig, read_block_config
from bloombee.models.core.family import Family
from bloombee.models.core.kv_cache import KVCache
from bloombee.models.core.mlp import MLPS, GatedMLP, GeluMLP, MoEMLP
from bloombee.models.core.norms import NORMS, LayerNorm, RMSNorm
from bloombee.models.core.rotary import RotaryEmbedding
from bloombee.models.core.stack import BlockStack, ClientHead

__all__ = [
    "ATTENTIONS", "Attention", "FusedQKVAttention", "QKNormAttention", "DecoderBlock", "ParallelDecoderBlock",
    "BLOCK_CONFIG_FIELDS", "CONFIG_ADAPTERS", "BlockConfig", "read_block_config", "Family", "KVCache", "MLPS",
    "GatedMLP", "GeluMLP", "MoEMLP", "NORMS", "LayerNorm", "RMSNorm", "RotaryEmbedding", "BlockStack", "ClientHead",
]
