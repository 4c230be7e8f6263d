"""`model.generate(..., draft_model=...)`: transformers-style arguments for speculative generation."""

from __future__ import annotations

import os

import torch

from bloombee.speculative.draft import DraftModel
from bloombee.speculative.generation import Sampling, SpeculativeGenerator
from bloombee.speculative.switch import SpeculationSwitch

ACCEPTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
            "pad_token_id", "attention_mask", "generator", "streamer", "speculation", "draft_widths", "prune_tau",
            "num_beams", "use_cache", "on_tokens"}


def load_draft(draft, model) -> DraftModel:
    """A DraftModel from what was passed: one already, a name, folder or hub id, or a transformers model."""
    if isinstance(draft, DraftModel):
        return draft
    if isinstance(draft, (str, os.PathLike)):
        return DraftModel(str(draft), dtype="auto", device=model.head.device)
    name = getattr(draft, "name_or_path", None)
    if name:
        return DraftModel(name, dtype="auto", device=model.head.device)
    raise TypeError(f"draft_model must be a DraftModel, a model name or folder, or a transformers model with "
                    f"name_or_path, got {type(draft).__name__}")


def speculative_generate(model, input_ids: torch.Tensor, draft, **kwargs) -> torch.Tensor:
    """Generate with `draft` proposing token trees; the sequences, as transformers' generate() returns them."""
    unknown = sorted(set(kwargs) - ACCEPTED)
    if unknown:
        raise TypeError(f"speculative generation does not take {unknown}; it takes {sorted(ACCEPTED)}")
    config = model.generation_config
    if (kwargs.get("num_beams") or 1) > 1:
        raise ValueError("speculative generation is greedy or sampled, not beam search: num_beams must be 1")
    settings = model.remote.settings
    new_tokens = kwargs.get("max_new_tokens") or (
        kwargs["max_length"] - input_ids.shape[1] if kwargs.get("max_length") else config.max_new_tokens)
    if not new_tokens or new_tokens < 1:
        raise ValueError("speculative generation needs max_new_tokens (or a max_length past the prompt)")
    do_sample = kwargs.get("do_sample", config.do_sample)
    sampling = Sampling(bool(do_sample), kwargs.get("temperature") or 1.0, kwargs.get("top_k") or 0,
                        kwargs.get("top_p") or 1.0, kwargs.get("generator"))
    widths = kwargs.get("draft_widths") or settings.widths
    tau = kwargs.get("prune_tau", settings.prune_tau)
    switch = SpeculationSwitch(kwargs.get("speculation") or settings.speculation)
    generator = SpeculativeGenerator(model, load_draft(draft, model), tuple(widths), tau or None, switch,
                                     kwargs.get("streamer"), kwargs.get("on_tokens"))
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    output = generator.generate(input_ids, kwargs.get("attention_mask"), int(new_tokens), sampling,
                                eos[0] if isinstance(eos, list) else eos, kwargs.get("pad_token_id", config.pad_token_id))
    model.last_speculation = generator.stats
    return output
