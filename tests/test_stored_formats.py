"""Checkpoints storing weights compactly load dequantised, from files written here in those formats: gpt-oss's MXFP4
experts give the blocks the weights transformers itself dequantises from the same folder, and its tokens; DeepSeek-V3's
block-scaled float8 weights give the weights they mean, and the tokens of the model with those weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from bloombee.loading import CheckpointReader, load_block_stack, load_client_head
from bloombee.models.core import masks
from conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread_torch")

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_GROUP = 32


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight [experts, in, out] in MXFP4: blocks [experts, out, in / 32, 16] (two e2m1 codes a byte, the
    first in the low nibble) and power-of-two scales [experts, out, in / 32] (e8m0: the exponent plus 127)."""
    groups = weight.transpose(1, 2).unflatten(-1, (-1, MXFP4_GROUP))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100) / 6.0))
    codes = ((groups / torch.exp2(exponent))[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent[..., 0] + 127).to(torch.uint8)


@torch.no_grad()
def generate(stack, head, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The prompt and `steps` greedy tokens through one stack of all blocks and the client head."""
    tokens, caches, positions = ids, stack.new_caches(1, ids.shape[1] + steps), torch.arange(ids.shape[1])
    for _ in range(steps):
        length = int(positions[-1]) + 1
        hidden = stack(head.embed(tokens[:, -positions.numel():]), positions[None], caches, positions,
                       masks.causal_mask(positions, length))
        tokens = torch.cat([tokens, head.logits(hidden[:, -1]).argmax(-1)[:, None]], dim=1)
        positions = torch.tensor([length])
    return tokens


def save_gpt_oss_in_mxfp4(folder: Path, num_layers: int) -> None:
    model = make_tiny_model("gpt-oss", num_layers)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    for name in [name for name in state if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"] = mxfp4(state.pop(name))
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stored") / "gpt-oss-mxfp4"
    save_gpt_oss_in_mxfp4(folder, num_layers=2)
    return folder


def test_mxfp4_experts_load_as_transformers_dequantises_them_and_generate_its_tokens(mxfp4_folder):
    names = CheckpointReader(mxfp4_folder).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names and "model.layers.0.mlp.experts.gate_up_proj" \
        not in names
    reference = transformers.GptOssForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32).eval()
    stack, head = load_block_stack(mxfp4_folder, 0, 2), load_client_head(mxfp4_folder)
    for ours, theirs in zip(stack.blocks, reference.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(ours.mlp.experts, name), getattr(theirs.mlp.experts, name))
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    assert torch.equal(generate(stack, head, ids, 16),
                       reference.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False))


def test_a_missing_half_of_an_mxfp4_weight_is_named(mxfp4_folder, tmp_path):
    from safetensors.torch import load_file

    state = load_file(mxfp4_folder / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    folder = tmp_path / "broken"
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((mxfp4_folder / "config.json").read_text())
    with pytest.raises(ValueError, match="mxfp4 checkpoint lacks model.layers.1.mlp.experts.down_proj_scales"):
        load_block_stack(folder, 0, 2)


FP8_BLOCK = (16, 16)  # DeepSeek-V3's are 128 x 128; these tiny weights' widths (40, 48, ...) end in partial blocks
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] in float8 e4m3 with one float32 scale per FP8_BLOCK block (scale_inv: what multiplies the
    stored values back)."""
    rows, columns = weight.shape
    padded = torch.zeros(-(-rows // FP8_BLOCK[0]) * FP8_BLOCK[0], -(-columns // FP8_BLOCK[1]) * FP8_BLOCK[1])
    padded[:rows, :columns] = weight
    blocks = padded.unflatten(0, (-1, FP8_BLOCK[0])).unflatten(2, (-1, FP8_BLOCK[1]))  # [R, b0, C, b1]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    stored = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :columns].to(torch.float8_e4m3fn)
    return stored, scale


def by_blocks(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight an FP8 checkpoint means: each stored value times its block's scale."""
    rows, columns = stored.shape
    full = scale.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[:rows, :columns]
    return stored.float() * full


def test_block_scaled_float8_weights_load_dequantised_and_generate_the_dequantised_models_tokens(tmp_path):
    """A DeepSeek-V3 checkpoint in float8 (every projection, experts included, as the released one) loads the weights
    its blocks mean, and generates what transformers generates with those weights."""
    from safetensors.torch import load_file

    model = make_tiny_model("deepseek-v3", num_layers=3)
    model.save_pretrained(tmp_path / "full")
    state = load_file(tmp_path / "full" / "model.safetensors")
    stored_state, meant_state = dict(state), dict(state)
    for name in [name for name in state if name.endswith("_proj.weight") or name.endswith("_mqa.weight")]:
        stored, scale = fp8_blocks(state[name])
        stored_state[name], stored_state[name.removesuffix("weight") + "weight_scale_inv"] = stored, scale
        meant_state[name] = by_blocks(stored, scale)
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    for folder, tensors, extra in (("fp8", stored_state, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}}),
                                   ("meant", meant_state, {})):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, **extra}))
    assert CheckpointReader(tmp_path / "fp8").read(["model.layers.2.mlp.experts.5.up_proj.weight"])[
        "model.layers.2.mlp.experts.5.up_proj.weight"].dtype == torch.float8_e4m3fn
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "meant", dtype=torch.float32).eval()
    stack, head = load_block_stack(tmp_path / "fp8", 0, 3), load_client_head(tmp_path / "fp8")
    assert torch.equal(stack.blocks[2].mlp.experts[5].up_proj.weight,
                       meant_state["model.layers.2.mlp.experts.5.up_proj.weight"])
    assert torch.equal(stack.blocks[0].attn.kv_a_proj_with_mqa.weight,
                       meant_state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    assert not torch.equal(meant_state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"],
                           state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])  # really rounded
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    assert torch.equal(generate(stack, head, ids, 16),
                       reference.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False))
