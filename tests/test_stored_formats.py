"""Checkpoints storing weights compactly load dequantised: gpt-oss's MXFP4 experts, written here in that format,
give the servers' blocks and the client's head the weights transformers loads from the same folder, and its tokens."""

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
    with torch.no_grad():
        tokens, caches = ids, stack.new_caches(1, 24)
        positions = torch.arange(8)
        for _ in range(16):
            length = int(positions[-1]) + 1
            hidden = stack(head.embed(tokens[:, -positions.numel():]), positions[None], caches, positions,
                           masks.causal_mask(positions, length))
            tokens = torch.cat([tokens, head.logits(hidden[:, -1]).argmax(-1)[:, None]], dim=1)
            positions = torch.tensor([length])
        expected = reference.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(tokens, expected)


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
