"""Prompt tuning: trainable prompts on the client while the swarm's blocks stay frozen (Petals' `tuning_mode`).

`ptune` prepends `pre_seq_len` trainable embeddings to every row's input embeddings. `deep_ptune` adds, for every
block, a trainable prompt to the hidden states of those prefix positions before the block: the prompts of a span's
blocks travel with the span's inputs, and the servers send their gradients back with the inputs' gradients.
"""

import torch
from torch import nn

TUNING_MODES = ("ptune", "deep_ptune")


class PromptTuning(nn.Module):
    """The trainable prompts of one model: `shallow` [prefix, H] and, in deep mode, `deep` [blocks, prefix, H]."""

    def __init__(self, mode: str, pre_seq_len: int, num_blocks: int, hidden_size: int, init_std: float,
                 dtype: torch.dtype):
        super().__init__()
        if mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode must be one of {TUNING_MODES}, got {mode!r}")
        if pre_seq_len < 1:
            raise ValueError(f"prompt tuning needs pre_seq_len >= 1 prompt tokens, got {pre_seq_len}")
        self.mode, self.pre_seq_len = mode, pre_seq_len
        self.shallow = nn.Parameter(torch.randn(pre_seq_len, hidden_size, dtype=dtype) * init_std)
        self.deep = nn.Parameter(torch.zeros(num_blocks, pre_seq_len, hidden_size, dtype=dtype)) \
            if mode == "deep_ptune" else None

    def prepend(self, embeds: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's embeddings [batch, tokens, H] after the prompt, and its attention mask with the prompt's ones."""
        batch = embeds.shape[0]
        prompt = self.shallow.to(embeds.dtype).expand(batch, -1, -1)
        if attention_mask is not None:
            ones = attention_mask.new_ones(batch, self.pre_seq_len)
            attention_mask = torch.cat([ones, attention_mask], dim=1)
        return torch.cat([prompt, embeds], dim=1), attention_mask

    def deep_prompts(self, batch: int) -> torch.Tensor | None:
        """The blocks' prompts for `batch` rows, [blocks, batch, prefix, H] (None in shallow mode)."""
        return self.deep[:, None].expand(-1, batch, -1, -1) if self.deep is not None else None
