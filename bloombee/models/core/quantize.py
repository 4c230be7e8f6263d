"""Quantised blocks: a block's linear layers replaced by bitsandbytes' int8 (LLM.int8) or NF4 (QLoRA) layers.

bitsandbytes quantises a weight when it is moved to its device (CPU or CUDA) and computes in the dtype of its
input, so a quantised block takes the server's --dtype activations unchanged. The MoE router stays in the dtype:
it is tiny and a flipped expert choice costs more quality than its bytes save.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from bloombee.weight_formats import (DEQUANTISED_ON_LOAD, NF4_BLOCK_SIZE, QuantType, linear_weight_bytes, nf4_columns,
                                     parse_quant_type, quantization_settings)


class _CastNotice(logging.Filter):
    """Drops bitsandbytes' warning, logged on every int8 matmul, that a float32 or bfloat16 input is quantised through
    float16: that is how LLM.int8 works (docs/quantisation.md says so), not news at every step."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_CastNotice())


QUANTISED_DEVICES = ("cpu", "cuda")  # where bitsandbytes (>= 0.48) runs both formats
# bitsandbytes' packed nf4 kernel for AVX512-BF16 CPUs takes weights of a multiple of 32 rows; for others it fails
# rather than falling back (0.50), so they keep the dequantising matmul
PACKED_NF4_ROWS = 32
KEPT_IN_DTYPE = ("router",)  # linear layers never quantised, by module name
# state-dict entries bitsandbytes makes for saving (the layout tag, the packed quantisation metadata), not on the device
SERIALISATION_ONLY = ("weight_format", "quant_state.bitsandbytes__nf4")
# a linear layer's checkpoint entries that say it was saved quantised (int8's row scales, nf4's block scales)
QUANTISED_MARKERS = ("SCB", "weight.absmax")
# those entries beside the weight itself, which a full-precision block's state has no name for
QUANTISATION_ENTRIES = ("SCB", "weight_format", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
                        "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4")


class QuantizationUnsupported(ValueError):
    """These weights cannot be loaded here (device, library, checkpoint format); the message says what can."""


def resolve_quant_type(setting: str, device: torch.device, checkpoint: QuantType = "none") -> QuantType:
    """The precision a server loads: a checkpoint saved quantised (``checkpoint``) in its own; else ``auto`` -> nf4 on
    CUDA (what Petals loads by default: ~4x the blocks per GPU, so fewer hops), none elsewhere (a CPU then computes
    exactly what transformers does); otherwise the setting, checked."""
    if checkpoint != "none":
        if setting not in ("auto", checkpoint):
            raise QuantizationUnsupported(f"this checkpoint holds {checkpoint} weights; serve it with --quant-type "
                                          f"{checkpoint} (or auto), or serve a full-precision checkpoint as {setting}")
        return checkpoint
    if setting == "auto":
        return "nf4" if torch.device(device).type == "cuda" else "none"
    return parse_quant_type(setting)


def checkpoint_quant_type(config) -> QuantType:
    """The precision a checkpoint was saved in: none (also for MXFP4 and block-scaled float8, read dequantised), or
    bitsandbytes' int8 or nf4, which load as saved; QuantizationUnsupported for any other quantisation (GPTQ, AWQ,
    bitsandbytes fp4, ...)."""
    settings = quantization_settings(config)
    if settings is None:
        return "none"
    method = settings.get("quant_method", "unknown")
    if method in DEQUANTISED_ON_LOAD:
        return "none"
    if method == "bitsandbytes" and settings.get("load_in_8bit"):
        return "int8"
    if method == "bitsandbytes" and settings.get("load_in_4bit") and settings.get("bnb_4bit_quant_type") == "nf4":
        return "nf4"
    kind = f"bitsandbytes {settings.get('bnb_4bit_quant_type', '')}" if method == "bitsandbytes" else method
    raise QuantizationUnsupported(
        f"this checkpoint is quantised as {kind}, which bloombee cannot load; it loads full-precision checkpoints "
        f"(quantising them itself with --quant-type int8 or nf4), bitsandbytes int8 or nf4 checkpoints, and MXFP4 or "
        f"block-scaled float8 ones (read dequantised)")


def check_supported(quant: QuantType, device: torch.device) -> None:
    """QuantizationUnsupported unless ``quant`` weights can be computed with on ``device``."""
    if quant == "none":
        return
    device = torch.device(device)
    if device.type not in QUANTISED_DEVICES:
        raise QuantizationUnsupported(f"{quant} weights run on {' or '.join(QUANTISED_DEVICES)} (bitsandbytes), not on "
                                      f"{device.type}; use --quant-type none on this device")
    _bitsandbytes()


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:
        raise QuantizationUnsupported(f"int8 and nf4 weights need bitsandbytes ({error}); install it with "
                                      "`pip install bitsandbytes` or use --quant-type none") from None
    return bitsandbytes


def quantized_linear(linear: nn.Linear, quant: QuantType, device: torch.device) -> nn.Module:
    """A bitsandbytes layer holding ``linear``'s weight (read from wherever it is) quantised on ``device``."""
    bnb = _bitsandbytes()
    weight, bias = linear.weight.detach().to("cpu"), linear.bias
    columns = linear.in_features
    if quant == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias is not None,
                                    has_fp16_weights=False, threshold=0.0, device="meta")
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        columns = nf4_columns(linear.in_features)
        layer = _nf4_layer(bnb, columns, linear.out_features, bias is not None, weight.dtype, compress_statistics=True)
        if columns != linear.in_features:
            weight = nn.functional.pad(weight, (0, columns - linear.in_features))
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to("cpu"), requires_grad=False)
    layer = layer.to(device)
    return layer if columns == linear.in_features else PaddedInput(layer, linear.in_features)


class PaddedInput(nn.Module):
    """An NF4 layer whose weight rows were zero-padded to whole blocks, fed its input padded alike. bitsandbytes'
    AVX-512 CPU kernel dequantises blocks row by row, so a block spanning two rows comes out wrong (0.50: 0.25
    relative error where NF4's own is 0.09); whole-block rows are right on every device."""

    def __init__(self, layer: nn.Module, in_features: int):
        super().__init__()
        self.layer, self.in_features = layer, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(nn.functional.pad(x, (0, self.layer.in_features - self.in_features)))


def _nf4_layer(bnb, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, **options) -> nn.Module:
    """An empty NF4 layer of that shape computing in ``dtype``."""
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=dtype, quant_type="nf4",
                              device="meta", **options)
    if out_features % PACKED_NF4_ROWS:
        layer.support_avx512bf16_for_cpu = False
    return layer


def prequantized_linear(linear: nn.Linear, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                        device: torch.device) -> nn.Module:
    """A bitsandbytes layer of ``linear``'s shape holding weights saved already quantised (``tensors``: the layer's
    checkpoint entries by their names inside it: int8's ``weight`` and ``SCB``, nf4's ``weight`` and ``weight.*``
    statistics). int8 layers compute without LLM.int8's outlier threshold, as the server's own int8 layers do."""
    bnb = _bitsandbytes()
    bias = tensors.get("bias")
    shape = {"input_features": linear.in_features, "output_features": linear.out_features, "bias": bias is not None,
             "device": "meta"}
    if "SCB" in tensors:
        layer = bnb.nn.Linear8bitLt(**shape, has_fp16_weights=False, threshold=0.0)
        weight = tensors["weight"].to(device)  # already on its device: Int8Params.to would leave CB behind
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False, CB=weight,
                                         SCB=tensors["SCB"].to(device))
    else:
        if linear.in_features % NF4_BLOCK_SIZE and torch.device(device).type == "cpu":
            raise QuantizationUnsupported(
                f"this nf4 checkpoint has {linear.in_features}-value rows, not whole {NF4_BLOCK_SIZE}-value blocks, "
                "which bitsandbytes computes wrongly on AVX-512 CPUs; serve the full-precision checkpoint with "
                "--quant-type nf4 (bloombee pads such rows)")
        layer = _nf4_layer(bnb, linear.in_features, linear.out_features, bias is not None, dtype)
        stats = {name.removeprefix("weight."): t for name, t in tensors.items() if name.startswith("weight.")}
        layer.weight = bnb.nn.Params4bit.from_prequantized(tensors["weight"], stats, device=device, module=layer)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer.to(device)


def load_prequantized(block: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    """Fill ``block`` (built on the meta device) from a checkpoint saved quantised: each linear layer whose entries
    carry quantisation statistics becomes its bitsandbytes layer, the rest loads in ``dtype``."""
    replaced = []
    for name, linear in list(block.named_modules()):
        if not isinstance(linear, nn.Linear) or not any(f"{name}.{stat}" in tensors for stat in QUANTISED_MARKERS):
            continue
        own = {key.removeprefix(f"{name}."): tensors.pop(key) for key in list(tensors) if key.startswith(f"{name}.")}
        parent, _, attribute = name.rpartition(".")
        setattr(block.get_submodule(parent), attribute, prequantized_linear(linear, own, dtype, device))
        replaced.append(f"{name}.")
    plain = {key: t.to(dtype) if t.is_floating_point() else t for key, t in tensors.items()}
    missing, unexpected = block.load_state_dict(plain, strict=False, assign=True)
    missing = [key for key in missing if not key.startswith(tuple(replaced))]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the block: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return block.to(device)


def quantize_linears(module: nn.Module, quant: QuantType, device: torch.device) -> nn.Module:
    """Replace every linear layer of ``module`` (but the routers) by its quantised twin on ``device``, in place."""
    if quant == "none":
        return module.to(device)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name not in KEPT_IN_DTYPE:
            setattr(module, name, quantized_linear(child, quant, device))
        else:
            quantize_linears(child, quant, device)
    return module.to(device)


def quant_type_of(module: nn.Module) -> QuantType:
    """The precision of ``module``'s linear weights, read off its layers' classes."""
    layers = {type(m).__name__ for m in module.modules()}
    return "nf4" if "Linear4bit" in layers else "int8" if "Linear8bitLt" in layers else "none"


def planned_weight_bytes(module: nn.Module, quant: QuantType, dtype_bytes: int) -> int:
    """Bytes ``module``'s weights will take once quantised to ``quant`` (it may be on the meta device)."""
    total = 0
    for name, child in module.named_modules():
        own = list(child.parameters(recurse=False))
        if isinstance(child, nn.Linear) and name.rsplit(".", 1)[-1] not in KEPT_IN_DTYPE:
            weight, rows = child.weight, child.weight.shape[0]
            values = rows * nf4_columns(weight.shape[1]) if quant == "nf4" else weight.numel()
            total += linear_weight_bytes(values, rows, quant, dtype_bytes)
            own = [p for p in own if p is not weight]
        total += sum(p.numel() for p in own) * dtype_bytes
    return total


def module_weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights as stored, quantisation scales and code books included."""
    return sum(t.numel() * t.element_size() for key, t in module.state_dict().items()
               if not key.endswith(SERIALISATION_ONLY))

