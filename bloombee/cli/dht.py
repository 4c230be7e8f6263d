"""`bloombee-dht`: start a bootstrap peer and print the multiaddrs others pass as --initial-peers."""

import argparse
import signal
import sys
import threading

from bloombee.cli.common import (
    ArgumentParser,
    add_peer_flags,
    check_initial_peers,
    log_level,
    parse_args,
    run_main,
    setup_logging,
)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="bloombee-dht", description=__doc__)
    add_peer_flags(parser)
    args = parse_args(parser, argv)
    setup_logging(log_level(args))
    sys.exit(run_main("bloombee-dht", lambda: run(args), log_level(args)))


def run(args: argparse.Namespace) -> None:
    from bloombee.dht.peers import start_dht, visible_maddrs

    check_initial_peers(args.initial_peers)
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
