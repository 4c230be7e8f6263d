"""The planner's model section from a transformers config (``bloombee-plan --model``).

The config is resolved by ``bloombee.loading.load_model_config`` (alias, hub id or local folder).
From it: L = num_hidden_layers, H = hidden_size, the KV elements per token per block = 2 x num_kv_heads x
head_dim as a block caches them (latent attention's one latent and one rope key: one KV head of their mean width),
and the parameters of one block: the last block as BloomBee serves it, built by its family on PyTorch's meta
device (no memory, no weights), its parameters counted, and its nn.Linear layers' weights and output rows (what
int8 / nf4 quantisation shrinks: ``linear_params_per_block``, ``linear_rows_per_block``; biases and norms stay in
the dtype). The byte figures follow from the workload's dtype.
"""

from __future__ import annotations

from typing import Any


class ModelConfigError(ValueError):
    """The model's config could not be loaded or understood."""


def load_config(name_or_path: str):
    """The transformers config of a model: alias, hub id or local folder."""
    from bloombee.loading import load_model_config

    try:
        return load_model_config(name_or_path)
    except Exception as exc:  # noqa: BLE001 (any loader failure becomes one clear message)
        raise ModelConfigError(
            f"cannot load the config of model '{name_or_path}': {type(exc).__name__}: {exc}. "
            "Without network access give a local model folder, or put the model's shapes in the input "
            "file's `model:` section (num_blocks, hidden_size, params_per_block, num_key_value_heads, head_dim)."
        ) from None


def model_section_from_config(config: Any, name: str | None = None) -> dict[str, Any]:
    """The ``model:`` section of a planner input (a dict for ``ModelSpec``) derived from a config."""
    text = getattr(config, "get_text_config", None)
    if callable(text):
        config = text()
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head")
    if layers is None or hidden is None or heads is None:
        raise ModelConfigError(
            f"config of '{name}' lacks num_hidden_layers / hidden_size / num_attention_heads; "
            "give the model explicitly in the input file"
        )
    intermediate = _first(config, "intermediate_size", "ffn_hidden_size", "n_inner") or 4 * hidden
    block, block_config = _served_block(config)
    params, linear, rows = _counts(block)
    kv_heads, key_dim, value_dim = block_config.cache_layout
    return {
        "name": name or getattr(config, "_name_or_path", None) or getattr(config, "model_type", None) or "model",
        "num_blocks": int(layers),
        "hidden_size": int(hidden),
        "params_per_block": int(params),
        "linear_params_per_block": int(linear),
        "linear_rows_per_block": int(rows),
        "num_key_value_heads": int(kv_heads),
        "head_dim": -(-(key_dim + value_dim) // 2),
        "intermediate_size": int(intermediate),
    }


def load_model_section(name_or_path: str) -> dict[str, Any]:
    return model_section_from_config(load_config(name_or_path), name=name_or_path)


def _served_block(config: Any):
    """The model's last block as its family builds it, on the meta device, and its BlockConfig: the planner's block
    (where blocks differ, as DeepSeek-V3's first dense ones from its mixtures, the last is of the many)."""
    import torch  # noqa: PLC0415

    from bloombee.models import family_for_config  # noqa: PLC0415
    from bloombee.models.core.stack import BlockStack  # noqa: PLC0415

    try:
        family = family_for_config(config)
    except ValueError as error:
        raise ModelConfigError(f"{error} Give params_per_block in the input file's model section.") from None
    with torch.device("meta"):
        last = config.num_hidden_layers
        stack = BlockStack(family, config, last - 1, last)
    return stack.blocks[0], stack.block_configs[0]


def block_counts(config: Any) -> tuple[int, int, int]:
    """(parameters, nn.Linear weights, their output rows) of the planner's block (`_served_block`)."""
    return _counts(_served_block(config)[0])


def _counts(block) -> tuple[int, int, int]:
    import torch  # noqa: PLC0415

    linears = [module for module in block.modules() if isinstance(module, torch.nn.Linear)]
    return (sum(p.numel() for p in block.parameters()), sum(m.weight.numel() for m in linears),
            sum(m.out_features for m in linears))


def _first(config: Any, *names: str):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None
