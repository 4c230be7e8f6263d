"""Model families: the registry mapping a transformers ``model_type`` to a generated family package.

Families are the subpackages generated from ``specs/<family>.yaml`` (at the repository root) by ``bloombee-codegen``;
each exposes ``FAMILY`` (a ``bloombee.models.core.Family``). Adding one needs no edit here.
"""

from __future__ import annotations

import importlib
import pkgutil

from bloombee.models.core.family import Family

_NOT_FAMILIES = {"core"}  # an installed wheel's specs/ and templates/ hold no __init__.py, so are never listed
_registry: dict[str, Family] | None = None


def families() -> dict[str, Family]:
    """Family name -> Family, for every generated family package."""
    global _registry
    if _registry is None:
        found = {}
        for info in pkgutil.iter_modules(__path__):
            if info.ispkg and info.name not in _NOT_FAMILIES:
                module = importlib.import_module(f"{__name__}.{info.name}")
                family = getattr(module, "FAMILY", None)
                if isinstance(family, Family):
                    found[family.name] = family
        _registry = found
    return _registry


def family_for_model_type(model_type: str) -> Family:
    """The family serving a transformers ``config.model_type``."""
    for family in families().values():
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in families().values() for t in f.model_types)
    raise ValueError(f"model type {model_type!r} is not supported; supported model types: {', '.join(supported)}.")


def family_for_config(config) -> Family:
    return family_for_model_type(config.model_type)


def served_config(config):
    """``config``, or its text model's config where BloomBee serves that and not the whole model (gemma-3-4b and up:
    multimodal, their text model's tensors under the family's ``weights.multimodal_prefix``)."""
    types = {model_type for family in families().values() for model_type in family.model_types}
    text = config.get_text_config()
    return text if config.model_type not in types and text is not config and text.model_type in types else config


__all__ = ["Family", "families", "family_for_config", "family_for_model_type", "served_config"]
