"""Pieces shared by the console scripts: options from flags, environment and YAML, logging, errors, peer flags.

Kept light: nothing here imports torch, transformers or hivemind, so that `--help` answers at once.
"""

import argparse
import gc
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from bloombee.dht.addresses import LOOPBACK_MADDRS, peer_address_problem
from bloombee.settings import ENV_PREFIX

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
NOT_FROM_CONFIG = ("help", "config", "command")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, saying a wrong flag in one line plus a pointer to --help instead of the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n  (see `{self.prog} --help`)\n")


class UsageError(Exception):
    """A mistake of the person running the command: printed as one line, without a traceback."""


def freeze_startup_heap() -> None:
    """Keep what start-up made (the imports and the model: ~400k objects) out of Python's full garbage collections,
    which otherwise scan all of it now and then: 0.15-0.25 s on a 2-core machine, every session of a long-running
    process waiting meanwhile (benchmarks/README.md). Frozen objects still go when nothing refers to them."""
    gc.freeze()


def setup_logging(level: str = "info") -> None:
    """One log format for every console script; hivemind and asyncio only say warnings (unless debugging)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_common_flags(parser: argparse.ArgumentParser, default_level: str = "info") -> None:
    """--log-level and --config, on every console script."""
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=default_level,
                        help="how much to log (default: %(default)s); debug also shows the traceback of an error")
    parser.add_argument("--config", metavar="YAML", type=Path,
                        help="read options from a YAML file whose keys are option names (model: ..., initial_peers: "
                             "[...], max_length: 4096); flags win over BLOOMBEE_<OPTION> environment variables, "
                             "which win over the file (default: none)")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags; every option not given as a flag comes from BLOOMBEE_<OPTION>, then the --config file, then
    its default."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config = config_path(argv)
    actions = option_actions(parser)
    from_file = read_config(config, actions, parser) if config else {}
    for owner, action in actions:
        env_name = ENV_PREFIX + action.dest.upper()
        if env_name in os.environ:
            value = convert(action, os.environ[env_name], owner, env_name)
        elif action.dest in from_file:
            value = convert(action, from_file[action.dest], owner, f"{config}: {action.dest}")
        else:
            continue
        action.default, action.required = value, False
    return parser.parse_args(argv)


def config_path(argv: list[str]) -> Path | None:
    """--config, read ahead of the other options."""
    ahead = argparse.ArgumentParser(add_help=False)
    ahead.add_argument("--config", type=Path)
    return ahead.parse_known_args(argv)[0].config


def option_actions(parser: argparse.ArgumentParser) -> list[tuple[argparse.ArgumentParser, argparse.Action]]:
    """(parser, option) for every option of the parser and its subcommands that a file or variable may set."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                found += option_actions(subparser)
        elif action.option_strings and action.dest not in NOT_FROM_CONFIG:
            found.append((parser, action))
    return found


def read_config(path: Path, actions: list[tuple[argparse.ArgumentParser, argparse.Action]],
                parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML mapping of option names (dashes or underscores) to values; unknown names are an error."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        parser.error(f"--config {path}: cannot read it as YAML ({error})")
    if not isinstance(raw, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    values = {str(key).replace("-", "_"): value for key, value in raw.items()}
    known = {action.dest for _, action in actions}
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"--config {path}: unknown option {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return values


def convert(action: argparse.Action, value: Any, parser: argparse.ArgumentParser, source: str) -> Any:
    """An option's value from an environment variable (text) or a YAML value, checked like the flag."""
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        text = str(value).lower()
        if text not in TRUE + FALSE:
            parser.error(f"{source}: expected true or false, got {value!r}")
        return text in TRUE
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else str(value).replace(",", " ").split()
        return [convert_one(action, item, parser, source) for item in items]
    return convert_one(action, value, parser, source)


def convert_one(action: argparse.Action, value: Any, parser: argparse.ArgumentParser, source: str) -> Any:
    try:
        converted = action.type(str(value)) if action.type is not None else value
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(f"{source}: {error}")
    if action.choices is not None and converted not in action.choices:
        parser.error(f"{source}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def run_main(prog: str, command: Callable[[], Any], log_level: str) -> int:
    """Run a console script's work: a person's mistake is one line on stderr (traceback only at --log-level debug),
    Ctrl-C is one line and exit status 130."""
    sys.unraisablehook = interrupts = _DroppedInterrupts(sys.unraisablehook)
    try:
        result = command()
        if interrupts.dropped:  # the work ran to its end, but the person asked to stop it
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        message = user_message(error)
        if message is None:
            raise
        if log_level == "debug":
            logger.exception("%s failed", prog)
        print(f"{prog}: {message}", file=sys.stderr)
        return 1
    return result or 0


class _DroppedInterrupts:
    """An unraisable-exception hook that keeps the Ctrl-Cs Python drops (a KeyboardInterrupt that lands in a finalizer
    or a weakref callback cannot be raised there) and passes every other report on to `hook`."""

    def __init__(self, hook: Callable[[Any], None]):
        self.hook, self.dropped = hook, False

    def __call__(self, report: Any) -> None:
        if isinstance(report.exc_value, KeyboardInterrupt):
            self.dropped = True
        else:
            self.hook(report)


def user_message(error: Exception) -> str | None:
    """The one-line explanation of an error a person can act on, or None for a bug (shown with its traceback)."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"invalid {'.'.join(map(str, first['loc'])) or 'setting'}: {first['msg']}"
    if isinstance(error, (UsageError, FileNotFoundError, TimeoutError, ConnectionError)):
        return str(error)
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError  # only after a failure: keeps --help fast

    from bloombee.client.routing import MissingBlocksError
    from bloombee.client.spans import RequestRejected
    from bloombee.server.memory import WeightsDoNotFit

    if isinstance(error, (MissingBlocksError, RequestRejected, WeightsDoNotFit)):
        return str(error)
    if isinstance(error, P2PDaemonError) and "bootstrap" in str(error):
        return ("none of the --initial-peers answered: check that bloombee-dht (or a server) is running at that "
                "address and that its port is reachable from here; copy the address exactly as it prints it")
    return None


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseModel]) -> None:
    """One `--field-name` flag per settings field; unset flags keep the env var or default."""
    group = parser.add_argument_group(f"{settings_cls.__name__} (each also settable as BLOOMBEE_<FIELD>)")
    for name, field in settings_cls.model_fields.items():
        annotation = field.annotation if field.annotation in (int, float, str) else str
        help_text = f"{field.description or name} (default {field.default})"
        nargs = "+" if field.annotation == tuple[str, ...] else None
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=annotation, default=None, help=help_text,
                           nargs=nargs)


def settings_overrides(args: argparse.Namespace, settings_cls: type[BaseModel]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in settings_cls.model_fields}


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="*", default=[], metavar="MULTIADDR",
                        help="addresses of peers already in the swarm, as bloombee-dht prints them: "
                             "/ip4/HOST/tcp/PORT/p2p/PEER_ID (default: none)")
    parser.add_argument("--host-maddrs", nargs="+", default=list(LOOPBACK_MADDRS), metavar="MULTIADDR",
                        help="multiaddrs to listen on (default: %(default)s, this machine only)")
    parser.add_argument("--announce-maddrs", nargs="*", default=[], metavar="MULTIADDR",
                        help="multiaddrs other peers should dial (default: the listen addresses)")
    parser.add_argument("--identity-path", default=None, help="RSA private key file (created if missing): keeps the peer id "
                        "stable across restarts and signs this peer's DHT records (default: a new key each start)")
    parser.add_argument("--nat-traversal", action=argparse.BooleanOptionalAction, default=None,
                        help="NAT port mapping, AutoNAT and relays (default: on, always off when binding only to loopback)")
    parser.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    add_common_flags(parser)


def log_level(args: argparse.Namespace) -> str:
    """--log-level, where -v means debug."""
    return "debug" if getattr(args, "verbose", False) else args.log_level


def check_initial_peers(peers: list[str]) -> None:
    """Refuse addresses that are not peer multiaddrs before any DHT starts."""
    for peer in peers:
        problem = peer_address_problem(peer)
        if problem:
            raise UsageError(f"--initial-peers {peer!r} {problem}; a valid address looks like "
                             "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... (bloombee-dht prints it)")
