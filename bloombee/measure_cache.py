"""Figures a process measures about its machine once (per model, range, device, dtype or host), kept in a JSON file."""

import fcntl
import json
import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CACHE_DIR = Path(os.environ.get("BLOOMBEE_CACHE", Path.home() / ".cache" / "bloombee"))


def cached(cache_path: Path, key: str, measure: Callable[[], Any]) -> Any:
    """The value stored for `key` in `cache_path`, measuring and storing it the first time. Processes sharing a cache
    directory measure one at a time (each would see the other's load), and the second to want a figure takes the
    first one's."""
    with _exclusive(cache_path):
        cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
        if key in cache:
            logger.info("Using the figures cached for %s in %s", key, cache_path)
            return cache[key]
        return _write(cache_path, key, measure())


def store(cache_path: Path, key: str, value: Any) -> Any:
    """Keep `value` for `key` in `cache_path`."""
    with _exclusive(cache_path):
        return _write(cache_path, key, value)


@contextmanager
def _exclusive(cache_path: Path):
    """Hold the lock of the cache's directory while inside."""
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_path.parent / "measuring.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(cache_path: Path, key: str, value: Any) -> Any:
    """Add `value` for `key` (the file written whole to a temporary file, then moved into place)."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    cache[key] = value
    tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(cache_path)
    return value
