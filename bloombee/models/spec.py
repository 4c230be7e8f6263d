"""The model-family spec schema (``specs/<family>.yaml`` at the repository root), validated before any code is
generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from bloombee.models.core.attention import ATTENTIONS
from bloombee.models.core.config import BLOCK_CONFIG_FIELDS, CONFIG_ADAPTERS
from bloombee.models.core.mlp import MIXTURES, MLPS
from bloombee.models.core.norms import NORMS

BLOCK_MODULES = ("attn.", "attn_norm.", "mlp.", "mlp_norm.", "post_attn_norm.", "post_mlp_norm.")
HEAD_MODULES = ("embed_tokens.", "embed_norm.", "norm.", "lm_head.")
# classes.<field> -> (the core classes it may name, what the error calls them)
CLASS_CHOICES = {"attention": (ATTENTIONS, "attention class"), "mlp": (MLPS, "MLP class"),
                 "norm": (NORMS, "norm class")}
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_heads", "norm_eps")
# block-config fields a spec may not read from the config: its config adapter or its features set them
DERIVED_FIELDS = ("separate_mlp_norm", "rope_layer_type", "alibi", "attn_scale")


class SpecError(ValueError):
    """A spec file is invalid; the message names the file, the field and what is allowed."""


def _allowed(value: str, allowed, what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not allowed; allowed: {', '.join(sorted(allowed))}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Classes(_Strict):
    attention: str
    mlp: str
    norm: str

    @field_validator("attention", "mlp", "norm")
    @classmethod
    def _known(cls, v, info):
        registry, what = CLASS_CHOICES[info.field_name]
        return _allowed(v, registry, what)


class Features(_Strict):
    rotary: bool  # the stack computes rotary embeddings
    qk_norm: bool  # the block's attention is core.attention.QKNormAttention
    mixture_of_experts: bool  # must agree with classes.mlp (MoEMLP, PackedMoEMLP)
    parallel_attention: bool  # the block is core.block.ParallelDecoderBlock
    sliding_window: bool  # must agree with config_fields (sliding_window)
    scaled_embeddings: bool = False  # the client scales token embeddings by sqrt(hidden_size) (gemma)
    sandwich_norms: bool = False  # the block is core.block.SandwichDecoderBlock (gemma2)
    alibi: bool = False  # attention scores take ALiBi biases (bloom); needs rotary false
    embedding_norm: bool = False  # the client normalises token embeddings: its head maps embed_norm. (bloom)


class Weights(_Strict):
    block_prefix: str
    block: dict[str, str]
    head: dict[str, str]
    base_prefix: str = ""  # the names' prefix a checkpoint saved from the base model leaves out (bloom's)
    multimodal_prefix: str = ""  # where a multimodal model's checkpoint keeps the text model's tensors (gemma3)

    @field_validator("block_prefix")
    @classmethod
    def _prefix(cls, v):
        if "{index}" not in v or not v.endswith("."):
            raise ValueError(f"block_prefix {v!r} must contain '{{index}}' and end with '.', "
                             f"e.g. 'model.layers.{{index}}.'")
        return v

    @field_validator("block")
    @classmethod
    def _block(cls, v):
        for src, dst in v.items():
            if not dst.startswith(BLOCK_MODULES) or not dst.endswith(".") or not src.endswith("."):
                raise ValueError(f"mapping {src!r} -> {dst!r}: both must end with '.', and the target must start "
                                 f"with one of the block modules {', '.join(BLOCK_MODULES)}")
        return v

    @field_validator("head")
    @classmethod
    def _head(cls, v):
        for src, dst in v.items():
            _allowed(dst, HEAD_MODULES, f"head mapping target for {src!r}:")
        missing = {"embed_tokens.", "norm."} - set(v.values())
        if missing:
            raise ValueError(f"head mapping lacks {', '.join(sorted(missing))} (lm_head. may be omitted when tied)")
        return v


class FamilySpec(_Strict):
    family: str
    model_types: list[str]
    config_class: str
    reference_model_class: str
    classes: Classes
    config_adapter: str
    features: Features
    config_fields: dict[str, str]
    config_defaults: dict[str, bool | int | float | str | None] = {}
    weights: Weights
    dht_prefix: str

    @field_validator("family")
    @classmethod
    def _family(cls, v):
        if not v.isidentifier() or v != v.lower():
            raise ValueError(f"family {v!r} must be a lowercase Python identifier (it names a package)")
        return v

    @field_validator("config_class", "reference_model_class")
    @classmethod
    def _transformers_class(cls, v):
        import transformers

        if not v.isidentifier() or not hasattr(transformers, v):
            raise ValueError(f"{v!r} is not a class exported by transformers {transformers.__version__}")
        return v

    @field_validator("config_adapter")
    @classmethod
    def _adapter(cls, v):
        return _allowed(v, CONFIG_ADAPTERS, "config adapter")

    @field_validator("config_fields", "config_defaults")
    @classmethod
    def _fields(cls, v):
        allowed = [f for f in BLOCK_CONFIG_FIELDS if f not in DERIVED_FIELDS]
        for key in v:
            _allowed(key, allowed, "block config field")
        return v

    @field_validator("config_fields")
    @classmethod
    def _attr_names(cls, v):
        for key, attr in v.items():
            if not attr.isidentifier():
                raise ValueError(f"config attribute {attr!r} for {key!r} is not an attribute name")
        return v

    @field_validator("dht_prefix")
    @classmethod
    def _dht(cls, v):
        if "{name}" not in v or "." in v:
            raise ValueError(f"dht_prefix {v!r} must contain '{{name}}' and no '.'")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        f, fields = self.features, self.config_fields
        for name in REQUIRED_CONFIG_FIELDS:
            if name not in fields:
                raise ValueError(f"config_fields must map {name!r}")
        if f.mixture_of_experts != (self.classes.mlp in MIXTURES):
            raise ValueError(f"features.mixture_of_experts must be true exactly when classes.mlp is one of "
                             f"{', '.join(MIXTURES)}")
        if f.mixture_of_experts and not {"num_experts", "num_experts_per_tok"} <= set(fields):
            raise ValueError("mixture_of_experts needs config_fields num_experts and num_experts_per_tok")
        if f.qk_norm and self.classes.attention != "Attention":
            raise ValueError("features.qk_norm needs classes.attention Attention")
        _allowed(self.config_defaults.get("qk_norm_class", "RMSNorm"), NORMS, "qk_norm_class")
        if f.alibi and f.rotary:
            raise ValueError("features.alibi and features.rotary exclude each other")
        if f.embedding_norm != ("embed_norm." in self.weights.head.values()):
            raise ValueError("features.embedding_norm must be true exactly when weights.head maps embed_norm.")
        if f.sliding_window != ("sliding_window" in fields):
            raise ValueError("features.sliding_window must be true exactly when config_fields maps sliding_window")
        if f.parallel_attention != ("parallel_attention" in fields):
            raise ValueError("features.parallel_attention must be true exactly when config_fields maps "
                             "parallel_attention")
        return self


def _format_error(path: Path, err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown field '{loc}'; allowed fields here: {_allowed_fields(err['loc'])}"
    if err["type"] == "missing":
        return f"{path}: missing required field '{loc}'"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{path}: field '{loc}': {msg}"


def _allowed_fields(loc) -> str:
    model: Any = FamilySpec
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    return ", ".join(model.model_fields)


def load_spec(path: str | Path) -> FamilySpec:
    """Read and validate one spec file; raise SpecError naming the file, the field and what is allowed."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec must be a mapping of fields, got {type(data).__name__}")
    try:
        spec = FamilySpec.model_validate(data)
    except ValidationError as e:
        raise SpecError("\n".join(_format_error(path, err) for err in e.errors())) from None
    if spec.family != path.stem:
        raise SpecError(f"{path}: field 'family': {spec.family!r} must equal the file name {path.stem!r}")
    return spec
