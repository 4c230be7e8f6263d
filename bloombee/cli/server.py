"""`bloombee-server`: the block server."""

from bloombee.cli.not_built import exit_not_built


def main() -> None:
    exit_not_built("bloombee-server", "the block server")
