"""Quantised blocks without a swarm: their bytes, how they load, how a row's result depends on its batch, the reference
model, and the refusals."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from conftest import make_tiny_model
from transformers import AutoConfig

from bloombee.loading import load_block_stack, load_model_config, resolve_model
from bloombee.loading.local_model import LocalModel
from bloombee.models import family_for_config
from bloombee.models.core.quantize import (
    QuantizationUnsupported,
    check_supported,
    checkpoint_quant_type,
    module_weight_bytes,
    planned_weight_bytes,
    quantized_linear,
    quant_type_of,
    resolve_quant_type,
)
from bloombee.server.memory import WeightsDoNotFit, blocks_that_fit
from bloombee.weight_formats import parse_quant_type, parse_quant_types

TINY = "bloombee-tiny"
FLOORS = {"int8": 0.30, "nf4": 0.16}  # of the float32 bytes of the same blocks, scales included (issue 30)


def meta_block(config):
    family = family_for_config(config)
    with torch.device("meta"):
        return family.block_class(family.block_config(config, 0), 0)


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantised_blocks_take_a_fraction_of_the_float32_bytes(quant):
    full = module_weight_bytes(load_block_stack(TINY, 0, 8))
    stack = load_block_stack(TINY, 0, 8, quant_type=quant)
    assert quant_type_of(stack) == quant and stack.dtype == torch.float32
    assert module_weight_bytes(stack) <= FLOORS[quant] * full
    assert module_weight_bytes(stack) == 8 * planned_weight_bytes(meta_block(load_model_config(TINY)), quant, 4)


@pytest.mark.parametrize("variant", ["llama-gqa", "mixtral"])
@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_planned_bytes_are_the_loaded_bytes_and_routers_stay_in_the_dtype(tiny_checkpoint, variant, quant):
    folder, _ = tiny_checkpoint(variant, num_layers=2)
    stack = load_block_stack(folder, 0, 2, quant_type=quant)
    assert module_weight_bytes(stack) == 2 * planned_weight_bytes(meta_block(load_model_config(folder)), quant, 4)
    routers = [module for name, module in stack.named_modules() if name.endswith(".router")]
    assert all(type(router) is nn.Linear and router.weight.dtype == torch.float32 for router in routers)
    assert bool(routers) == (variant == "mixtral")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_a_rows_result_barely_depends_on_its_batch(dtype, quant):
    """One row alone against the same row in a batch of 8, through 8 blocks. bitsandbytes' CPU kernels are not
    batch-invariant, and neither are float32 matmuls: measured, the difference stays near the dtype's rounding
    (float32 up to 2e-5 relative, with nf4 on some CPUs; bfloat16 one or two units of its last place)."""
    stack = load_block_stack(TINY, 0, 8, dtype=dtype, quant_type=quant)
    hidden = torch.randn(8, 5, stack.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    positions = torch.arange(5)
    mask = torch.ones(8, 5, 5, dtype=torch.bool).tril()
    with torch.inference_mode():
        batch = stack(hidden, positions.expand(8, -1), None, positions, mask).float()
        alone = stack(hidden[:1], positions.expand(1, -1), None, positions, mask[:1]).float()
    relative = ((alone - batch[:1]).abs().max() / batch[:1].abs().max()).item()
    bound = {torch.float32: 1e-4 if quant == "nf4" else 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert relative <= bound, relative


@pytest.mark.parametrize("in_features", [256, 688, 100])
def test_nf4_rows_of_any_width_keep_nf4s_error(in_features):
    """Rows that are not whole 64-value blocks (bloombee-tiny's down_proj reads 688 values) are as close as whole ones:
    bitsandbytes' AVX-512 CPU kernel dequantised such blocks wrongly (0.25 relative error) before they were padded."""
    linear = nn.Linear(in_features, 96, bias=True)
    inputs = torch.randn(4, 3, in_features, generator=torch.Generator().manual_seed(1))
    layer = quantized_linear(linear, "nf4", torch.device("cpu")).eval()
    with torch.inference_mode():
        expected, got = linear(inputs), layer(inputs)
    assert got.shape == expected.shape and quant_type_of(layer) == "nf4"
    assert ((got - expected).norm() / expected.norm()).item() < 0.12


def test_the_local_reference_is_transformers_in_full_precision_and_close_quantised(tiny_checkpoint):
    folder, model = tiny_checkpoint("llama-gqa", num_layers=4)
    ids = torch.tensor([[3, 17, 5, 99, 42, 7, 1, 64]])
    expected = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(LocalModel(folder).greedy(ids, 10), expected)
    full = LocalModel(folder).logits(ids)
    for quant in ("int8", "nf4"):
        logits = LocalModel(folder, quant_type=quant).logits(ids)
        assert not torch.equal(logits, full)
        assert (logits.argmax(-1) == full.argmax(-1)).float().mean() >= 0.75


def test_loading_holds_at_most_one_block_in_full_precision(tmp_path):
    """Eight 48 MB blocks loaded as nf4: the process's peak memory grows by the nf4 weights and about one block in
    float32, far less than the 380 MB of all eight."""
    from conftest import make_tiny_model

    make_tiny_model("llama-gqa", num_layers=8, hidden_size=1024, intermediate_size=2560,
                    num_attention_heads=8, num_key_value_heads=8).save_pretrained(tmp_path)
    code = textwrap.dedent(f"""
        import json, resource, torch
        import bitsandbytes  # its import (on AVX-512-BF16 CPUs, of a kernel hub client too) is not loading's memory
        from bloombee.loading import load_block_stack
        from bloombee.models.core.quantize import module_weight_bytes, planned_weight_bytes
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        stack = load_block_stack({str(tmp_path)!r}, 0, 8, quant_type="nf4")
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        block = planned_weight_bytes(load_block_stack({str(tmp_path)!r}, 0, 1).blocks[0], "none", 4)
        print(json.dumps({{"rise": after - before, "nf4": module_weight_bytes(stack), "block": block}}))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["block"] > 45e6 and figures["nf4"] < 8 * figures["block"] * FLOORS["nf4"]
    assert figures["rise"] < figures["nf4"] + 2 * figures["block"], figures


def test_quant_types_are_checked_and_auto_follows_the_device():
    assert resolve_quant_type("auto", torch.device("cpu")) == "none"
    assert resolve_quant_type("auto", torch.device("cuda")) == "nf4"
    assert parse_quant_types("nf4, none,nf4") == ("nf4", "none")
    with pytest.raises(ValueError, match="quant type must be one of none, int8, nf4, got 'fp3'"):
        parse_quant_type("fp3")
    with pytest.raises(ValueError, match="name at least one quant type"):
        parse_quant_types(" , ")
    with pytest.raises(QuantizationUnsupported, match="nf4 weights run on cpu or cuda .* not on mps; use --quant-type none"):
        check_supported("nf4", torch.device("mps"))
    check_supported("none", torch.device("mps"))


def save_with_bitsandbytes(source, folder, quant: str):
    """``source`` saved by transformers with bitsandbytes' int8 or nf4, as such checkpoints on the hub are."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.float32))
    AutoModelForCausalLM.from_pretrained(source, quantization_config=config, device_map="cpu",
                                         dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_quantised(tmp_path_factory):
    """A tiny Llama whose layers' rows are whole nf4 blocks (64 and 128 values), in float32 and as int8 and nf4."""
    full = tmp_path_factory.mktemp("full")
    make_tiny_model("llama", num_layers=2, intermediate_size=128).save_pretrained(full)
    return full, {quant: save_with_bitsandbytes(full, tmp_path_factory.mktemp(quant), quant) for quant in ("int8", "nf4")}


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_a_bitsandbytes_checkpoint_loads_as_saved(saved_quantised, quant):
    """The same weights as bloombee's own quantisation of the float32 checkpoint, so the same tokens."""
    full, folders = saved_quantised
    folder = folders[quant]
    assert checkpoint_quant_type(load_model_config(folder)) == quant
    loaded = LocalModel(folder, torch.float32)
    assert quant_type_of(loaded.stack) == quant
    prompt = torch.tensor([[1, 5, 9, 23, 7, 100]])
    assert torch.equal(loaded.greedy(prompt, 12), LocalModel(full, torch.float32, quant).greedy(prompt, 12))
    other = "nf4" if quant == "int8" else "int8"
    with pytest.raises(QuantizationUnsupported, match=f"this checkpoint holds {quant} weights and cannot be loaded as "
                                                      f"{other}"):
        load_block_stack(folder, 0, 1, quant_type=other)
    with pytest.raises(QuantizationUnsupported, match=f"serve it with --quant-type {quant} \\(or auto\\)"):
        resolve_quant_type(other, torch.device("cpu"), quant)
    assert resolve_quant_type("auto", torch.device("cpu"), quant) == quant


def test_an_nf4_checkpoint_of_part_blocks_is_refused_on_a_cpu(tmp_path):
    """bloombee-tiny's down_proj rows are 688 values, which bitsandbytes' nf4 split into blocks across rows."""
    folder = save_with_bitsandbytes(resolve_model(TINY), tmp_path, "nf4")
    with pytest.raises(QuantizationUnsupported, match="688-value rows, not whole 64-value blocks, which bitsandbytes "
                                                      "computes wrongly on AVX-512 CPUs; serve the full-precision"):
        load_block_stack(folder, 0, 1)


def test_other_quantised_checkpoints_are_refused_naming_what_loads():
    for settings, kind in (({"quant_method": "gptq", "bits": 4}, "gptq"),
                           ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
                            "bitsandbytes fp4")):
        with pytest.raises(QuantizationUnsupported, match=f"quantised as {kind}, which bloombee cannot load; it loads "
                                                          "full-precision checkpoints"):
            checkpoint_quant_type(AutoConfig.for_model("llama", quantization_config=settings))
    assert checkpoint_quant_type(AutoConfig.for_model("llama")) == "none"


def test_blocks_that_fit_count_quantised_bytes():
    config = load_model_config(TINY)
    room = 8 << 20
    counts = {quant: blocks_that_fit(config, torch.float32, quant, room, 1024) for quant in ("none", "int8", "nf4")}
    assert counts["none"] < counts["int8"] < counts["nf4"] == 8, counts
    with pytest.raises(WeightsDoNotFit, match="one block with the KV cache of --cache-tokens 1024 takes 3.14 MiB in "
                                              "none weights"):
        blocks_that_fit(config, torch.float32, "none", 1 << 20, 1024)
