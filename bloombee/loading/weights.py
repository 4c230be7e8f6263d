"""Reading only the tensors a server or client needs: blocks [start, end) or the client head."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from bloombee.loading.resolve import ModelNotFoundError, load_model_config, resolve_model
from bloombee.loading.stored import dequantising
from bloombee.models.core.quantize import (
    QUANTISATION_ENTRIES,
    QuantizationUnsupported,
    check_supported,
    checkpoint_quant_type,
    load_prequantized,
    quant_type_of,
    quantize_linears,
)
from bloombee.models.core.stack import BlockStack, ClientHead
from bloombee.progress import progress_bar
from bloombee.weight_formats import QuantType

logger = logging.getLogger(__name__)

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


class CheckpointReader:
    """Tensor names of a checkpoint folder and reads of chosen tensors, one at a time.

    safetensors (single file or sharded with an index) are read per tensor with ``safe_open``;
    PyTorch ``.bin`` files (single or sharded) are used only when no safetensors exist, memory-mapped.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if (self.folder / SAFE_INDEX).is_file():
            self.format, self.weight_map = "safetensors", self._index(SAFE_INDEX)
        elif (self.folder / SAFE_SINGLE).is_file():
            self.format = "safetensors"
            with safe_open(self.folder / SAFE_SINGLE, framework="pt") as f:
                self.weight_map = {name: SAFE_SINGLE for name in f.keys()}
        elif (self.folder / BIN_INDEX).is_file():
            self.format, self.weight_map = "bin", self._index(BIN_INDEX)
        elif (self.folder / BIN_SINGLE).is_file():
            self.format = "bin"
            self.weight_map = {name: BIN_SINGLE for name in self._load_bin(BIN_SINGLE)}
        else:
            raise ModelNotFoundError(f"{self.folder} has no weights ({SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or "
                                     f"{BIN_INDEX}).")

    def _index(self, name: str) -> dict[str, str]:
        return json.loads((self.folder / name).read_text())["weight_map"]

    def _load_bin(self, file: str) -> dict[str, torch.Tensor]:
        return torch.load(self.folder / file, map_location="cpu", mmap=True, weights_only=True)

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def files_for(self, names) -> set[str]:
        return {self.weight_map[n] for n in names}

    def read(self, names, dtype: torch.dtype | None = None, show_progress: bool = True) -> dict[str, torch.Tensor]:
        """The named tensors (cast to ``dtype`` if given); other tensors are not read."""
        by_file = defaultdict(list)
        for name in names:
            by_file[self.weight_map[name]].append(name)
        out = {}
        with progress_bar(sum(map(len, by_file.values())), "loading weights", "tensor", show_progress) as bar:
            for file, file_names in by_file.items():
                if self.format == "safetensors":
                    with safe_open(self.folder / file, framework="pt") as f:
                        for name in file_names:
                            out[name] = _cast(f.get_tensor(name), dtype)
                            bar.update()
                else:
                    shard = self._load_bin(file)
                    for name in file_names:
                        out[name] = _cast(shard[name], dtype)
                        bar.update()
                    del shard
        return out


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def resolve_dtype(dtype, config) -> torch.dtype:
    """``"auto"`` -> the config's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}.")
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    if not isinstance(found, torch.dtype):
        logger.info("config names no dtype; loading in float32")
        return torch.float32
    return found


def _checkpoint_folder(name_or_path, wanted) -> tuple[Path, CheckpointReader]:
    """Folder + reader; a hub model gets only the shards that hold the wanted tensors downloaded."""
    folder = resolve_model(name_or_path, weights=False)
    if (folder / SAFE_INDEX).is_file():
        index = json.loads((folder / SAFE_INDEX).read_text())["weight_map"]
        files = sorted({file for name, file in index.items() if wanted(name)})
        if not all((folder / file).is_file() for file in files):
            folder = resolve_model(name_or_path, weights=files)
    elif (folder / BIN_INDEX).is_file() and not (folder / SAFE_SINGLE).is_file():
        folder = resolve_model(name_or_path, weights=[SAFE_SINGLE])  # prefer safetensors if the hub has them
        if not (folder / SAFE_SINGLE).is_file():
            index = json.loads((folder / BIN_INDEX).read_text())["weight_map"]
            files = sorted({file for name, file in index.items() if wanted(name)})
            if not all((folder / file).is_file() for file in files):
                folder = resolve_model(name_or_path, weights=files)
    elif not any((folder / f).is_file() for f in (SAFE_SINGLE, BIN_SINGLE)):
        folder = resolve_model(name_or_path, weights=True)
    return folder, CheckpointReader(folder)


def _is_quantisation_entry(name: str) -> bool:
    """Whether a block's tensor name is one a checkpoint saved quantised has beside the weight (scales, code books)."""
    return name.endswith(tuple(f".{entry}" for entry in QUANTISATION_ENTRIES))


def _state_for(module_names: set[str], renamed: dict[str, str], where: str) -> None:
    missing = module_names - set(renamed.values())
    unexpected = set(renamed.values()) - module_names
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {where}: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}.")


def _kept_in_float32(block) -> tuple[str, ...]:
    """Prefixes of a block's tensors whose modules keep float32 whatever the server's dtype (``keeps_float32``)."""
    return tuple(f"{name}." for name, module in block.named_modules() if getattr(module, "keeps_float32", False))


def load_block_stack(name_or_path, start: int, end: int, dtype=torch.float32, device="cpu",
                     quant_type: QuantType = "none"):
    """Blocks [start, end) of a model, reading only those blocks' tensors, one block at a time: with ``quant_type``
    int8 or nf4 each block's linear weights are quantised on ``device`` before the next block is read, so at most one
    block is ever held in full precision. A checkpoint saved quantised (bitsandbytes int8 or nf4) loads as saved.
    Never builds the whole model."""
    from bloombee.models import family_for_config

    config = load_model_config(name_or_path)
    saved_as = checkpoint_quant_type(config)
    if saved_as != "none" and quant_type not in ("none", saved_as):
        raise QuantizationUnsupported(f"this checkpoint holds {saved_as} weights and cannot be loaded as {quant_type}")
    check_supported(saved_as if saved_as != "none" else quant_type, device)
    family = family_for_config(config)
    dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        stack = BlockStack(family, config, start, end)

    def module_name(checkpoint_name: str) -> str | None:
        for i in range(start, end):
            local = family.block_tensor_name(checkpoint_name, i)
            if local is not None:
                return f"blocks.{i - start}.{local}"
        return None

    _, reader = _checkpoint_folder(name_or_path, lambda n: module_name(n) is not None)
    reader = dequantising(reader, config)
    renamed = {name: module_name(name) for name in reader.keys()}
    renamed = {k: v for k, v in renamed.items() if v is not None}
    _state_for({k for k in stack.state_dict()}, {k: v for k, v in renamed.items() if not _is_quantisation_entry(v)},
               f"{family.name} blocks [{start}, {end})")
    with progress_bar(end - start, "loading blocks", "block") as bar:
        for index, block in enumerate(stack.blocks):
            prefix = f"blocks.{index}."
            names = {name: local.removeprefix(prefix) for name, local in renamed.items() if local.startswith(prefix)}
            if saved_as == "none":
                kept = _kept_in_float32(block)
                tensors = reader.read([n for n in names if not names[n].startswith(kept)], dtype, show_progress=False)
                tensors.update(reader.read([n for n in names if names[n].startswith(kept)], torch.float32,
                                           show_progress=False))
                block.load_state_dict({names[k]: t for k, t in tensors.items()}, strict=True, assign=True)
                quantize_linears(block, quant_type, device)
            else:
                tensors = reader.read(names, show_progress=False)
                load_prequantized(block, {names[k]: t for k, t in tensors.items()}, dtype, device)
            bar.update()
    stack.reset_buffers(device)
    stack.eval().requires_grad_(False)
    logger.info("loaded %s blocks [%d, %d) from %s in %s, weights %s", family.name, start, end, name_or_path, dtype,
                quant_type_of(stack))
    return stack


def load_client_head(name_or_path, dtype=torch.float32, device="cpu"):
    """Embeddings, final norm and LM head (tied to the embeddings when the config says so or it is absent)."""
    from bloombee.models import family_for_config

    config = load_model_config(name_or_path)
    family = family_for_config(config)
    dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        head = ClientHead(family, config)
    _, reader = _checkpoint_folder(name_or_path, lambda n: family.head_tensor_name(n) is not None)
    reader = dequantising(reader, config)
    renamed = {k: family.head_tensor_name(k) for k in reader.keys()}
    renamed = {k: v for k, v in renamed.items() if v is not None}
    tie = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in renamed.values()
    if tie:
        renamed = {k: v for k, v in renamed.items() if not v.startswith("lm_head.")}
    expected = {k for k in head.state_dict() if not (tie and k.startswith("lm_head."))}
    _state_for(expected, renamed, f"{family.name} client head")
    state = {renamed[k]: t.to(device) for k, t in reader.read(renamed, dtype).items()}
    if tie:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    head.load_state_dict(state, strict=True, assign=True)
    if tie:
        head.lm_head.weight = head.embed_tokens.weight
    head.eval().requires_grad_(False)
    return head
