"""`bloombee-dht`: start a bootstrap peer and print the multiaddrs others pass as --initial-peers."""

import argparse
import signal
import threading

from bloombee.cli.common import add_peer_flags, setup_logging
from bloombee.dht.peers import start_dht, visible_maddrs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bloombee-dht", description=__doc__)
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    dht = start_dht(args.initial_peers, args.host_maddrs, args.announce_maddrs, args.identity_path, args.nat_traversal)
    try:
        print("Bootstrap peer running. Join the swarm with:", flush=True)
        print("  --initial-peers " + " ".join(visible_maddrs(dht)), flush=True)
        stopped.wait()
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
