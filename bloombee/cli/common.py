"""Pieces shared by the console scripts: logging, settings flags, DHT peer flags."""

import argparse
import logging
from typing import Any

from pydantic import BaseModel

from bloombee.dht.peers import LOOPBACK_MADDRS


def setup_logging(verbose: bool = False, quiet_level: int = logging.INFO) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else quiet_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseModel]) -> None:
    """One `--field-name` flag per settings field; unset flags keep the env var or default."""
    group = parser.add_argument_group(f"{settings_cls.__name__} (each also settable as BLOOMBEE_<FIELD>)")
    for name, field in settings_cls.model_fields.items():
        annotation = field.annotation if field.annotation in (int, float, str) else str
        help_text = f"{field.description or name} (default {field.default})"
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=annotation, default=None, help=help_text)


def settings_overrides(args: argparse.Namespace, settings_cls: type[BaseModel]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in settings_cls.model_fields}


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of peers already in the swarm")
    parser.add_argument("--host-maddrs", nargs="+", default=list(LOOPBACK_MADDRS), help="multiaddrs to listen on")
    parser.add_argument("--announce-maddrs", nargs="*", default=[], help="multiaddrs other peers should dial")
    parser.add_argument("--identity-path", default=None, help="private key file: keeps the peer id stable across restarts")
    parser.add_argument("--nat-traversal", action=argparse.BooleanOptionalAction, default=None,
                        help="NAT port mapping, AutoNAT and relays (default: on, always off when binding only to loopback)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
