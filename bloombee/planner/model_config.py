"""The planner's model section from a transformers config (``bloombee-plan --model``).

The config is resolved by ``bloombee.loading.load_model_config`` (alias, hub id or local folder).
From it: L = num_hidden_layers, H = hidden_size, the parameters of one block from its actual
parameter shapes, and the KV elements per token per block = 2 x num_kv_heads x head_dim. The
byte figures follow from the workload's dtype.

Parameter shapes per block, for the llama-style families (llama, mistral, mixtral, qwen2, qwen3):

- attention: q  H x (n_heads x head_dim), k and v  H x (n_kv_heads x head_dim) each (GQA), o
  (n_heads x head_dim) x H; biases where the family has them (``attention_bias``; qwen2: q, k, v);
  qwen3's per-head q/k RMSNorms (2 x head_dim);
- MLP: gated, gate and up  H x I and down  I x H (+ biases with ``mlp_bias``); a mixture of experts
  has ``num_local_experts`` such MLPs plus the router  H x E;
- norms: two RMSNorms of H.

The nn.Linear layers among them (q, k, v, o, gate, up, down, each expert's and the router) are what
int8 / nf4 quantisation shrinks: their weights and output rows give ``linear_params_per_block`` and
``linear_rows_per_block`` (biases and norms stay in the dtype).

Any other family is sized by building one block of it on PyTorch's meta device (no memory, no
weights) and counting its parameters and its nn.Linear layers' weights and rows.
"""

from __future__ import annotations

from typing import Any

LLAMA_STYLE = {"llama", "mistral", "mixtral", "qwen2", "qwen3"}


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
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = _kv_heads(config, heads)
    intermediate = _first(config, "intermediate_size", "ffn_hidden_size", "n_inner") or 4 * hidden
    model_type = getattr(config, "model_type", "") or ""
    if model_type in LLAMA_STYLE:
        params, (linear, rows) = llama_style_block_params(config), llama_style_block_linears(config)
    else:
        params, linear, rows = meta_block_counts(config)
    return {
        "name": name or getattr(config, "_name_or_path", None) or model_type or "model",
        "num_blocks": int(layers),
        "hidden_size": int(hidden),
        "params_per_block": int(params),
        "linear_params_per_block": int(linear),
        "linear_rows_per_block": int(rows),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "intermediate_size": int(intermediate),
    }


def load_model_section(name_or_path: str) -> dict[str, Any]:
    return model_section_from_config(load_config(name_or_path), name=name_or_path)


def llama_style_block_params(config: Any) -> int:
    """Parameters of one block of a llama-style model, from the config's shapes."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = _kv_heads(config, heads)
    model_type = config.model_type
    q_out, kv_out = heads * head_dim, kv_heads * head_dim

    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if model_type == "qwen2":
        attention += q_out + 2 * kv_out  # q, k, v biases
    elif getattr(config, "attention_bias", False):
        attention += q_out + 2 * kv_out + hidden
    if model_type == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm

    intermediate = config.intermediate_size
    mlp_one = 3 * hidden * intermediate
    if getattr(config, "mlp_bias", False):
        mlp_one += 2 * intermediate + hidden
    experts = getattr(config, "num_local_experts", None) or 0
    mlp = experts * mlp_one + hidden * experts if experts else mlp_one

    norms = 2 * hidden
    return attention + mlp + norms


def llama_style_block_linears(config: Any) -> tuple[int, int]:
    """(weights, output rows) of one llama-style block's nn.Linear layers, from the config's shapes."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_out, kv_out = heads * head_dim, _kv_heads(config, heads) * head_dim
    weights = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    rows = q_out + 2 * kv_out + hidden
    intermediate = config.intermediate_size
    experts = getattr(config, "num_local_experts", None) or 0
    copies = max(experts, 1)
    weights += copies * 3 * hidden * intermediate + hidden * experts  # gate, up, down (per expert), the router
    rows += copies * (2 * intermediate + hidden) + experts
    return weights, rows


def meta_block_params(config: Any) -> int:
    """Parameters of one block, counted on a 2-block copy of the model built on the meta device."""
    return meta_block_counts(config)[0]


def meta_block_counts(config: Any) -> tuple[int, int, int]:
    """(parameters, nn.Linear weights, their output rows) of one block, counted on a 2-block copy of the model built
    on the meta device."""
    try:
        import copy  # noqa: PLC0415

        import torch  # noqa: PLC0415
        from transformers import AutoModelForCausalLM  # noqa: PLC0415

        small = copy.deepcopy(config)
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if hasattr(small, key):
                setattr(small, key, 2)
        if getattr(small, "layer_types", None) is not None:
            small.layer_types = list(small.layer_types[:2])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(small)
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) == 2:
                count = sum(p.numel() for p in module[0].parameters())
                if count > 0:
                    linears = [m for m in module[0].modules() if isinstance(m, torch.nn.Linear)]
                    return (int(count), sum(m.weight.numel() for m in linears),
                            sum(m.out_features for m in linears))
    except Exception as exc:  # noqa: BLE001
        raise ModelConfigError(
            f"cannot size one block of model type '{getattr(config, 'model_type', '?')}': {exc}; "
            "give params_per_block in the input file's model section"
        ) from None
    raise ModelConfigError(
        f"cannot find the blocks of model type '{getattr(config, 'model_type', '?')}'; "
        "give params_per_block in the input file's model section"
    )


def _kv_heads(config: Any, heads: int) -> int:
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1  # falcon-7b style multi-query attention: one K and one V head
    kv = _first(config, "num_key_value_heads", "num_kv_heads")
    return int(kv or heads)


def _first(config: Any, *names: str):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None
