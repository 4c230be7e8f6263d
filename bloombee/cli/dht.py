"""`bloombee-dht`: the DHT bootstrap peer."""

from bloombee.cli.not_built import exit_not_built


def main() -> None:
    exit_not_built("bloombee-dht", "the DHT bootstrap peer")
