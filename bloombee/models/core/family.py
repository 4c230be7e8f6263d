"""Family: what the loader and the registry need to know about one generated model family."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


def _pattern(prefix: str) -> re.Pattern:
    """A checkpoint-name prefix with optional ``{expert}`` placeholders -> regex matching at the start."""
    return re.compile(re.escape(prefix).replace(r"\{expert\}", r"(?P<expert>\d+)"))


@dataclass
class Family:
    name: str
    spec: str
    model_types: tuple[str, ...]
    config_class: str
    reference_model_class: str
    block_class: type
    stack_class: type
    head_class: type
    block_config: Callable  # (hf_config, layer_index) -> BlockConfig
    block_prefix: str  # e.g. "model.layers.{index}."
    block_renames: tuple[tuple[str, str], ...]  # checkpoint prefix (within a block) -> module prefix
    head_renames: tuple[tuple[str, str], ...]  # checkpoint prefix -> head module prefix
    dht_prefix_rule: str  # e.g. "{name}"
    rotary: bool = True
    norm: str = "RMSNorm"
    _compiled: dict = field(default_factory=dict, repr=False)

    def _renamer(self, renames):
        key = id(renames)
        if key not in self._compiled:
            self._compiled[key] = [(_pattern(src), dst) for src, dst in renames]
        return self._compiled[key]

    @staticmethod
    def _rename(name: str, compiled) -> str | None:
        for pattern, dst in compiled:
            m = pattern.match(name)
            if m:
                return dst.format(**m.groupdict()) + name[m.end():]
        return None

    def block_tensor_name(self, checkpoint_name: str, index: int) -> str | None:
        """Module name inside block ``index`` for a checkpoint tensor, or None if it is not that block's."""
        prefix = self.block_prefix.format(index=index)
        if not checkpoint_name.startswith(prefix):
            return None
        return self._rename(checkpoint_name[len(prefix):], self._renamer(self.block_renames))

    def head_tensor_name(self, checkpoint_name: str) -> str | None:
        """Client-head module name for a checkpoint tensor, or None if it is not a head tensor."""
        return self._rename(checkpoint_name, self._renamer(self.head_renames))
