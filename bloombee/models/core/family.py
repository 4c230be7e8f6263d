"""Family: one generated model family, as the registry, the loader and the tests use it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bloombee.models.core.config import BlockConfig, read_block_config


def _patterns(renames: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """Checkpoint-name prefixes with optional ``{expert}`` placeholders -> regexes matching at the start."""
    expert = r"(?P<expert>\d+)"
    return [(re.compile(re.escape(src).replace(r"\{expert\}", expert)), dst) for src, dst in renames.items()]


def _rename(name: str, patterns) -> str | None:
    for pattern, dst in patterns:
        m = pattern.match(name)
        if m:
            return dst.format(**m.groupdict()) + name[m.end():]
    return None


@dataclass
class Family:
    """What a spec says about a family, bound to its generated block class (``<family>/__init__.py``)."""

    name: str
    model_types: tuple[str, ...]
    config_class: str  # the transformers config class it reads
    reference_model_class: str  # the transformers model class the exactness tests compare against
    block_class: type  # a core.block.DecoderBlock subclass naming its norm, attention and MLP
    rotary: bool  # the stack computes rotary position embeddings
    config_fields: dict[str, str]  # block-config field -> transformers config attribute
    config_defaults: dict  # field -> value when the attribute is missing or None (a constant if unmapped)
    config_adapter: str  # a key of core.config.CONFIG_ADAPTERS
    block_prefix: str  # e.g. "model.layers.{index}."
    block_renames: dict[str, str]  # checkpoint prefix (within a block) -> module prefix
    head_renames: dict[str, str]  # checkpoint prefix -> head module prefix
    dht_prefix_rule: str  # e.g. "{name}"
    scaled_embeddings: bool = False  # the client scales token embeddings by sqrt(hidden_size)
    embedding_norm: bool = False  # the client normalises token embeddings (its head module embed_norm.)
    alibi: bool = False  # attention biased by ALiBi instead of rotary positions
    base_prefix: str = ""  # the base model's prefix: checkpoints saved from the base model lack it (bloom's)
    multimodal_prefix: str = ""  # where a multimodal model's checkpoint keeps this text model's tensors (gemma3)
    _block_patterns: list = field(init=False, repr=False)
    _head_patterns: list = field(init=False, repr=False)

    def __post_init__(self):
        self._block_patterns = _patterns(self.block_renames)
        self._head_patterns = _patterns(self.head_renames)

    def block_config(self, hf_config, layer_index: int) -> BlockConfig:
        """The BlockConfig of block ``layer_index``."""
        cfg = read_block_config(hf_config, layer_index, self.name, self.config_fields, self.config_defaults,
                                self.config_adapter)
        cfg.alibi = self.alibi
        return cfg

    def _spellings(self, checkpoint_name: str) -> tuple[str, ...]:
        """The name as saved; with the base model's prefix where a base-model checkpoint leaves it out; without the
        multimodal prefix where a multimodal checkpoint adds it."""
        if self.multimodal_prefix and checkpoint_name.startswith(self.multimodal_prefix):
            return (checkpoint_name.removeprefix(self.multimodal_prefix),)
        if not self.base_prefix or checkpoint_name.startswith(self.base_prefix):
            return (checkpoint_name,)
        return checkpoint_name, self.base_prefix + checkpoint_name

    def block_tensor_name(self, checkpoint_name: str, index: int) -> str | None:
        """Module name inside block ``index`` for a checkpoint tensor, or None if it is not that block's."""
        prefix = self.block_prefix.format(index=index)
        for name in self._spellings(checkpoint_name):
            if name.startswith(prefix):
                return _rename(name[len(prefix):], self._block_patterns)
        return None

    def head_tensor_name(self, checkpoint_name: str) -> str | None:
        """Client-head module name for a checkpoint tensor, or None if it is not a head tensor."""
        for name in self._spellings(checkpoint_name):
            local = _rename(name, self._head_patterns)
            if local is not None:
                return local
        return None
