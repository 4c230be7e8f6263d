"""Figures a server measures about itself once per model, range, device and dtype, kept in a JSON file."""

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("BLOOMBEE_CACHE", Path.home() / ".cache" / "bloombee"))


def cached(cache_path: Path, key: str, measure: Callable[[], Any]) -> Any:
    """The value stored for `key` in `cache_path`, measuring and storing it the first time."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    if key in cache:
        logger.info("Using the figures cached for %s in %s", key, cache_path)
        return cache[key]
    return store(cache_path, key, measure())


def store(cache_path: Path, key: str, value: Any) -> Any:
    """Keep `value` for `key` in `cache_path` (written whole to a temporary file, then moved into place)."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    cache[key] = value
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(cache_path)
    return value
