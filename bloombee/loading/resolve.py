"""Resolving a model name (local folder, hub id or alias) to a local folder and its config."""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path

from bloombee.loading.aliases import ALIASES, PACKAGE_ASSET

logger = logging.getLogger(__name__)

METADATA_PATTERNS = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt"]
WEIGHT_PATTERNS = ["*.safetensors"]
BIN_PATTERNS = ["pytorch_model*.bin"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelNotFoundError(FileNotFoundError):
    """The name is not a local folder, not an alias, and the hub could not provide it."""


def assets_dir() -> Path:
    """Folder of package-data models (bloombee/assets)."""
    from importlib.resources import files

    return Path(str(files("bloombee"))) / "assets"


def canonical_name(name_or_path: str | os.PathLike) -> str:
    """Hub id or alias for an alias; the name itself otherwise."""
    name = str(name_or_path)
    return ALIASES.get(name, name)


def _package_asset(alias: str, target: str) -> Path:
    folder = assets_dir() / target[len(PACKAGE_ASSET):]
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model alias {alias!r} points at the package-data folder {folder}, which is missing "
                                 f"(or has no config.json); reinstall BloomBee with its assets, or pass a local "
                                 f"folder path instead.")
    return folder


def resolve_model(name_or_path: str | os.PathLike, weights: bool | list[str] = True) -> Path:
    """A local folder holding the model's config (and, with ``weights``, its weight files).

    ``name_or_path``: a local folder, an alias from ``bloombee.loading.aliases.ALIASES`` or a hub id.
    Hub ids are downloaded with huggingface_hub into its cache (respecting HF_HUB_OFFLINE); ``weights``
    is True (all weight files), False (config and tokenizer only) or a list of weight file names.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json; point at a model folder "
                                     f"saved with save_pretrained or downloaded from the hub.")
        return path
    name = str(name_or_path)
    target = ALIASES.get(name, name)
    if target.startswith(PACKAGE_ASSET):
        return _package_asset(name, target)
    close = difflib.get_close_matches(name, ALIASES, n=1, cutoff=0.75) if "/" not in name and name not in ALIASES else []
    if close:
        raise ModelNotFoundError(f"unknown model {name!r}: did you mean {close[0]}? (not a local folder and not an "
                                 f"alias; aliases: {', '.join(sorted(ALIASES))})")
    if not _HUB_ID.match(target) or target.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{name!r} is not a local folder, not a known alias "
                                 f"({', '.join(sorted(ALIASES))}) and not a hub id (owner/name).")
    return _download(target, weights)


def _download(repo_id: str, weights: bool | list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

    if weights is True:
        patterns = METADATA_PATTERNS + WEIGHT_PATTERNS
    elif weights is False:
        patterns = list(METADATA_PATTERNS)
    else:
        patterns = list(METADATA_PATTERNS) + list(weights)
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except GatedRepoError as e:
        raise ModelNotFoundError(f"model {repo_id!r} is gated on the hub: accept its license on the model page and "
                                 f"log in (`hf auth login`), or pass a local folder path holding a copy.") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else \
            f"the hub is unreachable or does not have it ({type(e).__name__})"
        raise ModelNotFoundError(f"cannot get model {repo_id!r}: {why}. Download it where the hub is reachable "
                                 f"(e.g. `hf download {repo_id} --local-dir DIR`) and pass the local folder path "
                                 f"DIR instead of the hub id.") from e
    if weights is True and not any(folder.glob("*.safetensors")):
        # no safetensors on the hub: fall back to PyTorch .bin shards
        folder = Path(snapshot_download(repo_id, allow_patterns=METADATA_PATTERNS + BIN_PATTERNS))
    return folder


def load_model_config(name_or_path: str | os.PathLike):
    """The transformers config of a model (folder, hub id or alias): of its text model where BloomBee serves only that
    (``bloombee.models.served_config``)."""
    from transformers import AutoConfig

    from bloombee.models import served_config

    return served_config(AutoConfig.from_pretrained(str(resolve_model(name_or_path, weights=False))))
