"""Checkpoints storing some weights compactly, read dequantised to the server's dtype: gpt-oss's MXFP4 experts
(``<name>_blocks`` and ``<name>_scales``) and DeepSeek-V3's float8 weights (``<name>`` in e4m3 and
``<name>_scale_inv``, one float32 scale per block of 128 x 128 weights)."""

from __future__ import annotations

import torch

from bloombee.weight_formats import DEQUANTISED_ON_LOAD, quantization_settings

MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
FP8_SCALES = "_scale_inv"


def stored_format(config) -> tuple[str | None, dict]:
    """The checkpoint's quant_method where it is one read dequantised (mxfp4, fp8), else None; and its settings."""
    settings = quantization_settings(config) or {}
    method = settings.get("quant_method")
    return (method, settings) if method in DEQUANTISED_ON_LOAD else (None, settings)


def dequantised_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [*, rows, groups, 16] (two e2m1 values a byte) and scales [*, rows, groups] (e8m0) -> float32
    [*, groups * 32, rows]: transposed, as gpt-oss's experts hold their weights ([experts, in, out])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def dequantised_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A float8 weight [out, in] times its scales [ceil(out / b0), ceil(in / b1)], each over its block: float32."""
    rows, columns = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return weight.float() * scales


class DequantisingReader:
    """A CheckpointReader (bloombee.loading.weights) whose compactly stored weights read as one dequantised tensor
    under the name the model's parameter has; every other tensor reads as stored."""

    def __init__(self, reader, method: str, settings: dict):
        self.reader, self.method = reader, method
        self.block = tuple(settings.get("weight_block_size") or (128, 128))
        names = set(reader.keys())
        self.parts: dict[str, tuple[str, ...]] = {}
        for name in names:
            if method == "mxfp4" and name.endswith(MXFP4_BLOCKS):
                base = name.removesuffix(MXFP4_BLOCKS)
                self.parts[base] = (name, self._partner(base + MXFP4_SCALES, names))
            elif method == "fp8" and name.endswith(FP8_SCALES):
                base = name.removesuffix(FP8_SCALES)
                self.parts[base] = (self._partner(base, names), name)
        stored = {part for parts in self.parts.values() for part in parts}
        self.parts.update({name: (name,) for name in names - stored})

    def _partner(self, name: str, names: set[str]) -> str:
        if name not in names:
            raise ValueError(f"{self.reader.folder}: the {self.method} checkpoint lacks {name}, the other half of a "
                             f"dequantised weight.")
        return name

    def keys(self) -> list[str]:
        return list(self.parts)

    def read(self, names, dtype: torch.dtype | None = None, show_progress: bool = True) -> dict[str, torch.Tensor]:
        stored = self.reader.read([part for name in names for part in self.parts[name]], None, show_progress)
        out = {}
        for name in names:
            parts = [stored[part] for part in self.parts[name]]
            tensor = parts[0] if len(parts) == 1 else self._dequantised(*parts)
            out[name] = tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
        return out

    def _dequantised(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        if self.method == "mxfp4":
            return dequantised_mxfp4(first, second)
        return dequantised_fp8(first, second, self.block)


def dequantising(reader, config):
    """``reader``, read through a DequantisingReader where the config says the checkpoint stores weights so."""
    method, settings = stored_format(config)
    return reader if method is None else DequantisingReader(reader, method, settings)
