"""Each family's real checkpoints load one to one: the tensor names and shapes transformers saves a real model's
checkpoint under (its config, 2 blocks, built on the meta device) are exactly what the server's blocks and the
client's head read."""

import pytest
import torch
import transformers
from transformers.core_model_loading import revert_weight_conversion

from bloombee.loading import CheckpointReader, dht_prefix, load_block_stack, load_client_head
from bloombee.models import family_for_config, served_config
from bloombee.models.core.masks import stateless_causal_mask
from bloombee.models.core.stack import BlockStack, ClientHead
from conftest import make_tiny_model, make_tiny_multimodal_gemma3

# the shapes that matter of real hub models' config.json (layers cut to 2 below)
REAL_CONFIGS = {
    "meta-llama/Meta-Llama-3-70B": ("LlamaConfig", dict(
        hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mistralai/Mistral-7B-v0.1": ("MistralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        sliding_window=4096, tie_word_embeddings=False)),
    "mistralai/Mixtral-8x7B-v0.1": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    "Qwen/Qwen3-32B": ("Qwen3Config", dict(
        hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False)),
    "tiiuae/falcon-40b": ("FalconConfig", dict(
        hidden_size=8192, num_attention_heads=128, num_kv_heads=8, new_decoder_architecture=True, parallel_attn=True,
        bias=False, alibi=False, vocab_size=65024)),
    "tiiuae/falcon-7b": ("FalconConfig", dict(
        hidden_size=4544, num_attention_heads=71, multi_query=True, new_decoder_architecture=False,
        parallel_attn=True, bias=False, alibi=False, vocab_size=65024)),
    "Qwen/Qwen2.5-72B-Instruct": ("Qwen2Config", dict(
        hidden_size=8192, intermediate_size=29568, num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
        rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072,
        max_window_layers=70, tie_word_embeddings=False)),
    "Qwen/Qwen2.5-0.5B": ("Qwen2Config", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "Qwen/Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936, tie_word_embeddings=False)),
    "Qwen/Qwen3-235B-A22B": ("Qwen3MoeConfig", dict(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        vocab_size=151936, tie_word_embeddings=False)),
    "microsoft/Phi-3-mini-4k-instruct": ("Phi3Config", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        sliding_window=2047, tie_word_embeddings=False)),
    "microsoft/Phi-3-medium-128k-instruct": ("Phi3Config", dict(
        hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10, vocab_size=32064,
        max_position_embeddings=131072, original_max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 64,
                             long_factor=[1.0 + i / 8 for i in range(64)]))),
    "google/gemma-2-9b": ("Gemma2Config", dict(
        hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        vocab_size=256000, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True)),
    "google/gemma-2-27b": ("Gemma2Config", dict(
        hidden_size=4608, intermediate_size=36864, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        vocab_size=256000, query_pre_attn_scalar=144, sliding_window=4096, tie_word_embeddings=True)),
    "google/gemma-3-1b-it": ("Gemma3TextConfig", dict(
        hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True)),
    "google/gemma-7b": ("GemmaConfig", dict(
        hidden_size=3072, intermediate_size=24576, num_attention_heads=16, num_key_value_heads=16, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, hidden_act="gelu", tie_word_embeddings=True)),
    "bigscience/bloom": ("BloomConfig", dict(hidden_size=14336, n_head=112, vocab_size=250880)),
    "bigscience/bloomz-7b1": ("BloomConfig", dict(hidden_size=4096, n_head=32, vocab_size=250880)),
    "openai/gpt-oss-120b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=128, num_experts_per_tok=4, vocab_size=201088, sliding_window=128, tie_word_embeddings=False)),
    "deepseek-ai/DeepSeek-V3": ("DeepseekV3Config", dict(  # first_k_dense_replace 1 (of 3): a dense and an MoE block
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, tie_word_embeddings=False)),
    "google/gemma-2b": ("GemmaConfig", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        vocab_size=256000, rms_norm_eps=1e-6, hidden_act="gelu", tie_word_embeddings=True)),
}


def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


@pytest.mark.parametrize("hub_id", REAL_CONFIGS)
def test_a_real_checkpoints_tensors_are_what_the_servers_and_the_client_read(hub_id):
    config_class, values = REAL_CONFIGS[hub_id]
    config = getattr(transformers, config_class)(**values, num_hidden_layers=2)
    family = family_for_config(config)
    with torch.device("meta"):
        reference = getattr(transformers, family.reference_model_class)(config)
        checkpoint = shapes(revert_weight_conversion(reference, reference.state_dict()))  # as saved (e.g. experts)
        blocks = shapes(BlockStack(family, config, 0, 2).state_dict())
        head = shapes(ClientHead(family, config).state_dict())
    read_by_blocks, read_by_head = {}, {}
    for name, shape in checkpoint.items():
        targets = [f"blocks.{index}.{local}" for index in range(2)
                   if (local := family.block_tensor_name(name, index)) is not None]
        local_head = family.head_tensor_name(name)
        assert len(targets) + (local_head is not None) == 1, f"{name} is read by {targets} and the head {local_head}"
        if targets:
            read_by_blocks[targets[0]] = shape
        else:
            read_by_head[local_head] = shape
    assert read_by_blocks == blocks
    assert read_by_head == head


def test_a_checkpoint_saved_from_the_base_model_loads_and_generates_as_the_full_one(tmp_path):
    """bigscience's bloom checkpoints were saved from BloomModel: their names lack "transformer." (the spec's
    base_prefix) and they hold no lm_head (tied). Servers and client load such a folder, and generate as the model."""
    model = make_tiny_model("bloom", num_layers=2)
    model.transformer.save_pretrained(tmp_path)
    assert not any(name.startswith("transformer.") for name in CheckpointReader(tmp_path).keys())
    stack, head = load_block_stack(tmp_path, 0, 2), load_client_head(tmp_path)
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    positions = torch.arange(5)
    with torch.no_grad():
        hidden = stack(head.embed(ids), positions[None], None, positions, stateless_causal_mask(5))
        assert torch.equal(head.logits(hidden), model(ids).logits)


GEMMA3_27B_TEXT = dict(hidden_size=5376, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=16,
                       head_dim=128, vocab_size=262208, query_pre_attn_scalar=168, sliding_window=1024)


def test_a_multimodal_checkpoints_text_model_is_what_the_servers_and_the_client_read():
    """google/gemma-3-27b-it is multimodal (Gemma3Config): its text model's tensors, which its checkpoint keeps under
    language_model., are read one to one; the vision tower's by nobody."""
    config = transformers.Gemma3Config(text_config={**GEMMA3_27B_TEXT, "num_hidden_layers": 2})
    text = served_config(config)
    assert text is config.text_config
    family = family_for_config(text)
    with torch.device("meta"):
        reference = transformers.Gemma3ForConditionalGeneration(config)
        checkpoint = shapes(revert_weight_conversion(reference, reference.state_dict()))
        blocks = shapes(BlockStack(family, text, 0, 2).state_dict())
        head = shapes(ClientHead(family, text).state_dict())
    read_by_blocks, read_by_head = {}, {}
    for name, shape in checkpoint.items():
        targets = [f"blocks.{index}.{local}" for index in range(2)
                   if (local := family.block_tensor_name(name, index)) is not None]
        local_head = family.head_tensor_name(name)
        if not name.startswith("language_model."):
            assert not targets and local_head is None, name
        elif targets:
            read_by_blocks[targets[0]] = shape
        else:
            read_by_head[local_head] = shape
    assert read_by_blocks == blocks
    assert read_by_head == head


def test_a_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path):
    """A multimodal gemma-3 folder: servers and client load its text model, which gives the multimodal model's logits
    for a text prompt; its DHT prefix is its name, as any model's."""
    model = make_tiny_multimodal_gemma3(num_layers=2)
    model.save_pretrained(tmp_path)
    assert dht_prefix(tmp_path) == tmp_path.name
    stack, head = load_block_stack(tmp_path, 0, 2), load_client_head(tmp_path)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    positions = torch.arange(6)
    with torch.no_grad():
        hidden = stack(head.embed(ids), positions[None], None, positions, stateless_causal_mask(6))
        assert (head.logits(hidden) - model(input_ids=ids).logits).abs().max() <= 1e-4
