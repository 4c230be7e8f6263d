"""Exit helper for console scripts whose capability has not been built yet."""

import sys


def exit_not_built(script: str, capability: str) -> None:
    """Tell the user honestly that this script does nothing yet, and exit non-zero."""
    print(f"{script}: {capability} is not built yet in this version of BloomBee.", file=sys.stderr)
    sys.exit(2)
