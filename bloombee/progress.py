"""Progress bars (tqdm) for long operations, shown only when stderr is a terminal."""

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def _quiet() -> bool:
    return not sys.stderr.isatty()


def progress(items: Iterable[T], description: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """`items`, with a progress bar on a terminal and silently otherwise (logs, pipes, tests)."""
    return tqdm(items, desc=description, total=total, unit=unit, leave=False, disable=_quiet())


def progress_bar(total: int, description: str, unit: str = "it", show: bool = True) -> tqdm:
    """A bar to `update()` by hand (use it as a context manager); silent when stderr is not a terminal or not `show`."""
    return tqdm(total=total, desc=description, unit=unit, leave=False, disable=_quiet() or not show)
