"""On a CUDA GPU: quantised blocks on the device (nf4 and int8), the pinned host buffers of an offloaded KV cache, and
the weight bytes a server announces against `torch.cuda.memory_allocated`. Skipped without CUDA;
`scripts/gpu_check.sh` runs them."""

import pytest
import torch
from conftest import make_tiny_model

from bloombee.loading import load_block_stack, load_model_config
from bloombee.loading.local_model import LocalModel
from bloombee.models import family_for_config
from bloombee.models.core.masks import causal_mask
from bloombee.models.core.offload import OffloadedKVCache
from bloombee.models.core.quantize import SERIALISATION_ONLY, module_weight_bytes, planned_weight_bytes, quant_type_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")

MIB = 1 << 20
PROMPT = torch.tensor([[11, 22, 33, 44, 55, 66, 77, 88]])


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """4 blocks of ~25 MB in float16: large enough that the allocator's rounding is small beside them."""
    folder = tmp_path_factory.mktemp("wide-llama")
    make_tiny_model("llama-gqa", num_layers=4, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                    num_key_value_heads=8).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_the_announced_weight_bytes_are_what_the_device_holds(wide_llama, quant):
    config = load_model_config(wide_llama)
    family = family_for_config(config)
    with torch.device("meta"):
        block = family.block_class(family.block_config(config, 0), 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stack = load_block_stack(wide_llama, 0, 4, dtype=torch.float16, device="cuda", quant_type=quant)
    allocated = torch.cuda.memory_allocated() - before
    announced = module_weight_bytes(stack)
    held = [tensor for key, tensor in stack.state_dict().items() if not key.endswith(SERIALISATION_ONLY)]
    assert announced == 4 * planned_weight_bytes(block, quant, 2)
    assert all(tensor.device.type == "cuda" for tensor in held)
    # the caching allocator rounds a tensor up to 512 bytes, and leaves up to 1 MiB of a large one's segment unsplit
    rounding = sum(MIB if tensor.nbytes >= MIB else 512 for tensor in held)
    assert announced <= allocated <= announced + rounding, (allocated, announced, rounding)
    del stack
    torch.cuda.empty_cache()


def test_nf4_on_the_device_quantises_as_on_the_cpu_and_decodes_the_same_tokens(wide_llama):
    gpu = LocalModel(wide_llama, torch.float32, "nf4", device="cuda")
    cpu = LocalModel(wide_llama, torch.float32, "nf4")
    # .data: moving a bitsandbytes Params4bit itself moves its quantisation state, shared with the layer, in place
    assert torch.equal(gpu.stack.blocks[0].attn.q_proj.weight.data.cpu(), cpu.stack.blocks[0].attn.q_proj.weight.data)
    # the same packed weights; the GPU's and the CPU's float32 sums differ in their last bits (measured: 1.4e-3 at most)
    torch.testing.assert_close(gpu.logits(PROMPT).cpu(), cpu.logits(PROMPT), rtol=1e-2, atol=5e-3)
    assert torch.equal(gpu.greedy(PROMPT, 12).cpu(), cpu.greedy(PROMPT, 12))


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantised_half_precision_blocks_agree_with_full_precision_ones(wide_llama, quant):
    full = LocalModel(wide_llama, torch.float16, "none", device="cuda").logits(PROMPT)
    quantised = LocalModel(wide_llama, torch.float16, quant, device="cuda").logits(PROMPT)
    assert quantised.dtype == torch.float16 and not torch.equal(quantised, full)
    assert (quantised.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_a_bitsandbytes_checkpoint_loads_on_the_device_as_saved(wide_llama, tmp_path, quant):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float16)
    AutoModelForCausalLM.from_pretrained(wide_llama, quantization_config=config, device_map="cpu",
                                         dtype=torch.float16).save_pretrained(tmp_path)
    saved = LocalModel(tmp_path, torch.float16, device="cuda")
    assert quant_type_of(saved.stack) == quant
    full = LocalModel(wide_llama, torch.float16, "none", device="cuda").logits(PROMPT)
    assert (saved.logits(PROMPT).argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


def test_offloaded_kv_sits_in_pinned_host_memory_and_attends_as_on_the_device(wide_llama):
    stack = load_block_stack(wide_llama, 0, 4, dtype=torch.float16, device="cuda", quant_type="nf4")
    hidden = torch.randn(2, 8, 1024, device="cuda", dtype=torch.float16)
    positions = torch.arange(8, device="cuda")
    mask = causal_mask(positions, 8, batch_size=2)
    outputs = {}
    for offload in (0.0, 0.5, 1.0):
        caches = stack.new_caches(2, 16, offload=offload)
        if offload:
            assert all(isinstance(c, OffloadedKVCache) and c.in_host.k.is_pinned() and c.in_host.v.is_pinned()
                       for c in caches)
        with torch.inference_mode():
            outputs[offload] = stack(hidden, positions.expand(2, -1), caches, positions, mask)
    # the host's heads are attended by the CPU, whose float16 sums round differently from the GPU's
    torch.testing.assert_close(outputs[0.5], outputs[0.0], rtol=1e-2, atol=5e-3)
    torch.testing.assert_close(outputs[1.0], outputs[0.0], rtol=1e-2, atol=5e-3)
