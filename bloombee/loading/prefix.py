"""A model's DHT key prefix: the same for a local folder, its hub id and its alias."""

from __future__ import annotations

import os
from pathlib import Path

from bloombee.loading.aliases import ALIASES, PACKAGE_ASSET
from bloombee.loading.resolve import assets_dir, load_model_config
from bloombee.models import family_for_config


def _hub_cache_repo(path: Path) -> str | None:
    """'owner/name' for a folder inside the huggingface_hub cache (models--owner--name/snapshots/<rev>)."""
    for part in path.resolve().parts:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


def dht_prefix(name_or_path: str | os.PathLike) -> str:
    """The DHT key prefix of a model: the same for a local folder, its hub id and its alias.

    The base name is the hub repository name (the last part of the id; for a local folder, its
    folder name, or the repo name when the folder is in the hub cache), with '.' replaced by '-';
    the family's spec rule (``dht_prefix``) is then applied. A config may pin it with ``dht_prefix``.
    """
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        assets = assets_dir().resolve()
        if path.resolve().parent == assets:
            base = path.resolve().name
        else:
            base = (_hub_cache_repo(path) or path.resolve().name).split("/")[-1]
    else:
        target = ALIASES.get(name, name)
        base = target[len(PACKAGE_ASSET):] if target.startswith(PACKAGE_ASSET) else target.split("/")[-1]
    config = load_model_config(name_or_path)
    pinned = getattr(config, "dht_prefix", None)
    if pinned:
        return str(pinned).replace(".", "-")
    return family_for_config(config).dht_prefix_rule.format(name=base.replace(".", "-"))
