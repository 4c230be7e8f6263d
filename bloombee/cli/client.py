"""`bloombee-client`: the swarm client."""

from bloombee.cli.not_built import exit_not_built


def main() -> None:
    exit_not_built("bloombee-client", "the swarm client")
