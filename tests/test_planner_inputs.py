"""Planner input validation (errors name the field) and model shapes derived from a config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from bloombee.planner import PlanInputError, PlanInputs
from bloombee.planner.model_config import ModelConfigError, block_counts, model_section_from_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plans" / "e6.yaml"


@pytest.fixture
def raw():
    return yaml.safe_load(EXAMPLE.read_text())


def _error(tmp_path, data, suffix=".yaml") -> str:
    path = tmp_path / f"input{suffix}"
    path.write_text(yaml.safe_dump(data) if suffix != ".json" else __import__("json").dumps(data))
    with pytest.raises(PlanInputError) as err:
        PlanInputs.from_file(path)
    return str(err.value)


def test_example_file_loads(raw):
    inputs = PlanInputs.from_file(EXAMPLE)
    assert inputs.node_names == ["a100-california", "rtx4090-new-jersey", "rtx4090-canada"]
    assert PlanInputs.from_dict(raw) == inputs


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d["nodes"][1].__setitem__("gpu_memory_gib", -1), "nodes[1].gpu_memory_gib"),
        (lambda d: d["nodes"][0]["link"].__setitem__("uplink_mbs", 5), "nodes[0].link.uplink_mbs"),
        (lambda d: d["nodes"][2]["link"].pop("downlink_mbps"), "nodes[2].link.downlink_mbps"),
        (lambda d: d["nodes"][0]["cost"]["table"]["mlp_ms"].pop(), "nodes[0].cost.table.mlp_ms"),
        (lambda d: d["nodes"][0]["cost"].__setitem__("coefficients", {"mlp_ms": [1], "attn_gpu_ms": [1], "attn_cpu_ms": [1]}), "nodes[0].cost"),
        (lambda d: d["workload"].__setitem__("batch_sizes", [0, 8]), "workload.batch_sizes"),
        (lambda d: d["workload"].__setitem__("dtype", "int3"), "workload.dtype"),
        (lambda d: d["model"].pop("params_per_block"), "model.params_per_block"),
        (lambda d: d["model"].pop("head_dim"), "model.kv_bytes_per_token_per_block"),
        (lambda d: d["nodes"][1].__setitem__("name", "a100-california"), "nodes[1].name"),
        (lambda d: d["nodes"][0].__setitem__("name", "client"), "nodes[0].name"),
        (lambda d: d.__setitem__("link_overrides", [{"src": "mars", "dst": "client", "bandwidth_mbps": 1}]), "link_overrides[0].src"),
        (lambda d: d["link_matrix"]["bandwidth_mbps"][0].pop(), "link_matrix.bandwidth_mbps"),
        (lambda d: d["link_matrix"]["names"].__setitem__(0, "venus"), "link_matrix.names[0]"),
        (lambda d: d["nodes"][0]["compression"].__setitem__("ratio", 0), "nodes[0].compression.ratio"),
        (lambda d: d.pop("client"), "client"),
    ],
)
def test_errors_name_the_field(tmp_path, raw, edit, field):
    data = copy.deepcopy(raw)
    edit(data)
    message = _error(tmp_path, data)
    assert field in message, message


def test_json_input_and_unreadable_files(tmp_path, raw):
    data = copy.deepcopy(raw)
    data["nodes"][0]["host_memory_gib"] = "lots"
    assert "nodes[0].host_memory_gib" in _error(tmp_path, data, suffix=".json")
    with pytest.raises(PlanInputError, match="cannot read"):
        PlanInputs.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(PlanInputError, match="cannot parse"):
        PlanInputs.from_file(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(PlanInputError, match="mapping"):
        PlanInputs.from_file(listing)


def test_overrides_merge_into_the_file(raw):
    inputs = PlanInputs.from_file(EXAMPLE, overrides={"workload": {"seq_len": 1024, "batch_sizes": [4]}})
    assert inputs.workload.seq_len == 1024 and inputs.workload.batch_sizes == [4]
    assert inputs.workload.micro_batches == raw["workload"]["micro_batches"]


def test_model_bytes_follow_the_dtype():
    spec = PlanInputs.from_file(EXAMPLE).model
    assert spec.weight_bytes("float16") == 2 * spec.params_per_block
    assert spec.weight_bytes("float32") == 4 * spec.params_per_block
    assert spec.kv_bytes_per_token("bfloat16") == 2 * 52 * 128 * 2
    assert spec.activation_bytes("float16") == 6656 * 2


# ------------------------------------------------------------------------------- model configs


def _layer_params(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == config.num_hidden_layers]
    return sum(p.numel() for p in layers[0][-1].parameters())  # the last block: DeepSeek-V3's first ones are dense


def _configs():
    from transformers import (BloomConfig, DeepseekV3Config, FalconConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig, GptOssConfig,
                              LlamaConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, vocab_size=128)
    return {
        "llama-gqa": LlamaConfig(**small, num_key_value_heads=2),
        "llama-bias": LlamaConfig(**small, num_key_value_heads=4, attention_bias=True, mlp_bias=True, head_dim=16),
        "mixtral": MixtralConfig(**small, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "qwen2": Qwen2Config(**small, num_key_value_heads=2),
        "qwen3": Qwen3Config(**small, num_key_value_heads=2, head_dim=8),
        "gemma": GemmaConfig(**small, num_key_value_heads=2, head_dim=16),
        "gemma2": Gemma2Config(**small, num_key_value_heads=2, head_dim=16),
        "gemma3": Gemma3TextConfig(**small, num_key_value_heads=2, head_dim=16),
        "phi3": Phi3Config(**small, num_key_value_heads=2, pad_token_id=0),
        "qwen3-moe": Qwen3MoeConfig(**small, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2),
        "falcon-40b": FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                                   new_decoder_architecture=True, num_kv_heads=2),
        "bloom": BloomConfig(hidden_size=64, n_layer=2, n_head=8, vocab_size=128),
        "deepseek-v3": DeepseekV3Config(**small, moe_intermediate_size=32, n_routed_experts=4, n_group=1, topk_group=1,
                                        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16,
                                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        "gpt-oss": GptOssConfig(**small, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_a_blocks_parameters_are_counted_on_the_families_own_block_as_transformers_has_them(name):
    config = _configs()[name]
    assert block_counts(config)[0] == _layer_params(config)


def test_a_model_type_bloombee_does_not_serve_is_named():
    from transformers import GPT2Config

    with pytest.raises(ModelConfigError, match="model type 'gpt2' is not supported.*params_per_block"):
        model_section_from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128), name="gpt2")


def test_model_section_from_config():
    config = _configs()["llama-gqa"]
    section = model_section_from_config(config, name="tiny")
    assert section == {
        "name": "tiny",
        "num_blocks": 2,
        "hidden_size": 64,
        "params_per_block": _layer_params(config),
        "linear_params_per_block": 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 96,  # q, o; k, v of 2 KV heads; the MLP
        "linear_rows_per_block": 64 + 2 * 16 + 64 + 2 * 96 + 64,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 96,
    }


def test_latent_attention_is_planned_with_the_cache_it_keeps():
    """DeepSeek-V3's cache holds one latent (kv_lora_rank) and one rope key per token and block: the planner's
    2 x num_key_value_heads x head_dim KV elements are those, not 2 x heads x head widths."""
    section = model_section_from_config(_configs()["deepseek-v3"], name="deepseek")
    assert 2 * section["num_key_value_heads"] * section["head_dim"] == 16 + 4


def test_a_multimodal_config_is_sized_from_its_text_config():
    from transformers import Gemma3Config, Gemma3TextConfig

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128)
    section = model_section_from_config(Gemma3Config(text_config=text), name="gemma-3")
    assert section["num_blocks"] == 2
    assert section["params_per_block"] == _layer_params(Gemma3TextConfig(**text))
