"""Weight precisions a server may keep its blocks in, and the bytes each takes (no torch: the planner uses it).

``none`` keeps the server's ``--dtype``; ``int8`` is LLM.int8's per-row (output channel) int8 with one float32
scale per row; ``nf4`` is QLoRA's 4-bit NormalFloat in blocks of 64 weights with double-quantised scales
(one int8 scale per block, one float32 scale per 256 blocks), each row a whole number of blocks (zero-padded).
"""

from __future__ import annotations

from typing import Literal, get_args

QuantType = Literal["none", "int8", "nf4"]
QUANT_TYPES: tuple[QuantType, ...] = get_args(QuantType)
# checkpoints' quant_method values whose weights a server reads dequantised to its dtype (bloombee.loading.stored):
# gpt-oss's MXFP4 experts, DeepSeek-V3's float8 weights with block scales
DEQUANTISED_ON_LOAD = ("mxfp4", "fp8")
NF4_BLOCK_SIZE = 64  # weights per absmax scale (QLoRA's default, bitsandbytes' on CPU and CUDA)
NF4_NESTED_BLOCK_SIZE = 256  # first-level scales per float32 second-level scale (double quantisation)
NF4_QUANT_MAP_BYTES = (16 + 256) * 4  # the float32 code books: 16 NF4 values, 256 values of the scales' 8-bit code


def quantization_settings(config) -> dict | None:
    """A transformers config's ``quantization_config`` as a dict; None where it has none."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    return found if isinstance(found, dict) else found.to_dict()


def parse_quant_type(text: str) -> QuantType:
    """``'nf4'`` -> ``'nf4'``; anything else is a ValueError that names the choices."""
    if text not in QUANT_TYPES:
        raise ValueError(f"quant type must be one of {', '.join(QUANT_TYPES)}, got {text!r}")
    return text


def parse_quant_types(text: str | tuple[str, ...] | list[str]) -> tuple[QuantType, ...]:
    """``'none,nf4'`` (or a sequence) -> ``('none', 'nf4')``, each checked, without repeats, never empty."""
    items = [part.strip() for part in text.split(",")] if isinstance(text, str) else list(text)
    chosen = tuple(dict.fromkeys(parse_quant_type(item) for item in items if item))
    if not chosen:
        raise ValueError(f"name at least one quant type of {', '.join(QUANT_TYPES)}")
    return chosen


def nf4_columns(columns: int) -> int:
    """A layer's input width as its NF4 weight stores it: rows zero-padded to whole blocks, so no block spans two."""
    return -(-columns // NF4_BLOCK_SIZE) * NF4_BLOCK_SIZE


def linear_weight_bytes(weights: int, rows: int, quant: QuantType, dtype_bytes: int) -> int:
    """Bytes on the device of a linear layer's ``weights`` values in ``rows`` output rows, scales included."""
    if quant == "none":
        return weights * dtype_bytes
    if quant == "int8":
        return weights + 4 * rows
    blocks = -(-weights // NF4_BLOCK_SIZE)
    nested = -(-blocks // NF4_NESTED_BLOCK_SIZE)
    return -(-weights // 2) + blocks + 4 * nested + NF4_QUANT_MAP_BYTES
