"""`bloombee-server`: serve a range of a model's blocks to the swarm."""

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from bloombee.cli.common import (
    ArgumentParser,
    UsageError,
    add_peer_flags,
    add_settings_flags,
    check_initial_peers,
    freeze_startup_heap,
    log_level,
    parse_args,
    positive_int,
    run_main,
    settings_overrides,
    setup_logging,
)
from bloombee.settings import ServerSettings, load_settings


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes START:END, e.g. 0:4; got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"{text}: START must be at least 0 and below END (END is exclusive), "
                                         f"e.g. {min(start, end)}:{max(start, end)}")
    return start, end


_startup_signals: list[int] = []  # stop signals received while starting


def stop_starting(signum: int, frame) -> None:
    _startup_signals.append(signum)
    raise KeyboardInterrupt(f"signal {signum} while starting")


def stop_if_signalled() -> None:
    """Stop if a signal came while starting: its KeyboardInterrupt is lost when it lands in a finalizer (`__del__`
    run by the garbage collector), and the server would then go on to serve."""
    if _startup_signals:
        raise KeyboardInterrupt(f"signal {_startup_signals[0]} while starting")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bloombee-server", description=__doc__)
    parser.add_argument("--model", required=True, help="model folder, hub id or alias (e.g. bloombee-tiny, llama-30b)")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument("--blocks", type=parse_blocks, help="serve blocks START:END (END exclusive, e.g. 0:4; default: choose where the swarm is weakest)")
    blocks.add_argument("--num-blocks", type=positive_int, help="serve this many blocks where the swarm is weakest "
                        "(default: all of the model's blocks)")
    blocks.add_argument("--plan", help="serve the blocks a `bloombee-plan --json` output gives --node")
    parser.add_argument("--node", help="this server's node name in --plan")
    parser.add_argument("--profile", nargs="?", const="bloombee-profile.yaml", default=None, metavar="PATH",
                        help="also write this server's planner profile to PATH (default bloombee-profile.yaml)")
    parser.add_argument("--no-profile", action="store_true",
                        help="do not measure and announce the planner profile (per-block cost table, memory, codec) "
                             "that bloombee-plan and the clients' micro_batches=auto use; measured once, then cached")
    parser.add_argument("--new-swarm", action="store_true", help="start a new swarm instead of joining one")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="dtype of the blocks' weights and compute (default: %(default)s, the checkpoint's)")
    parser.add_argument("--public-name", default="", help="a name shown to other peers (default: none)")
    parser.add_argument("--link-bandwidth-mbps", type=float, default=100.0, help="this machine's link speed, Mbit/s (default: %(default)s)")
    add_peer_flags(parser)
    add_settings_flags(parser, ServerSettings)
    return parser


def main(argv: list[str] | None = None, server_class: type | None = None) -> None:
    """The console script; `server_class` (a subclass of bloombee.server.server.Server) replaces Server, for tests."""
    args = parse_args(build_parser(), argv)
    setup_logging(log_level(args))
    sys.exit(run_main("bloombee-server", lambda: run(args, server_class), log_level(args)))


def check_blocks(args: argparse.Namespace) -> None:
    """--blocks and --num-blocks against the model's block count, before joining the swarm."""
    from bloombee.loading import load_model_config

    total = load_model_config(args.model).num_hidden_layers
    if args.blocks and args.blocks[1] > total:
        raise UsageError(f"--blocks {args.blocks[0]}:{args.blocks[1]} goes past the last block: {args.model} has "
                         f"{total} blocks, so END is at most {total}")
    if args.num_blocks and args.num_blocks > total:
        raise UsageError(f"--num-blocks {args.num_blocks} is more than the {total} blocks {args.model} has; "
                         f"pass --num-blocks {total} or fewer")


def read_plan(args: argparse.Namespace) -> tuple[int, int, float, tuple[int, int], str] | None:
    """With --plan: --node's blocks [start, end), KV offload, the plan's (B, M) and the node's weight precision,
    checked before joining the swarm."""
    from bloombee.planner.placement import node_quant_type, node_range, plan_schedule

    if not args.plan:
        return None
    if not args.node:
        raise UsageError("--plan needs --node NAME (the node's name in the plan)")
    try:
        report = json.loads(Path(args.plan).read_text())
    except OSError as error:
        raise UsageError(f"--plan {args.plan}: cannot read it ({error.strerror}); pass the file "
                         "`bloombee-plan ... --json` wrote") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"--plan {args.plan} is not JSON ({error}); write it with `bloombee-plan ... --json > "
                         f"{args.plan}`") from None
    try:
        start, end, alpha = node_range(report, args.node)
        quant = node_quant_type(report, args.node)
    except ValueError as error:
        raise UsageError(f"--plan {args.plan}: {error}") from None
    return start, end, alpha, plan_schedule(report), quant


def check_quantization(args: argparse.Namespace, settings: ServerSettings, planned: tuple | None) -> str:
    """The weight precision this server will load (a quantised checkpoint's own, else the plan's, else --quant-type),
    checked against the checkpoint, the device and the library before joining the swarm."""
    import torch

    from bloombee.loading import load_model_config
    from bloombee.models.core.quantize import (
        QuantizationUnsupported,
        check_supported,
        checkpoint_quant_type,
        resolve_quant_type,
    )

    device = torch.device(args.device)
    try:
        saved_as = checkpoint_quant_type(load_model_config(args.model))
        quant = resolve_quant_type(planned[4] if planned is not None else settings.quant_type, device, saved_as)
        check_supported(quant, device)
    except QuantizationUnsupported as error:
        raise UsageError(str(error)) from None
    return quant


def run(args: argparse.Namespace, server_class: type | None = None) -> None:
    """Check the arguments (those that need no model first: a typo is refused at once), then serve."""
    planned = read_plan(args)
    if not args.new_swarm and not args.initial_peers:
        raise SystemExit("bloombee-server: pass --initial-peers of a running swarm, or --new-swarm to start one")
    settings = load_settings(ServerSettings, settings_overrides(args, ServerSettings))
    check_initial_peers(args.initial_peers)
    check_blocks(args)
    quant = check_quantization(args, settings, planned)

    import torch

    from bloombee.dht.peers import start_dht

    for sig in (signal.SIGINT, signal.SIGTERM):  # until the server's loop takes over: stop cleanly, DHT included
        signal.signal(sig, stop_starting)
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    dht = start_dht(args.initial_peers, args.host_maddrs, args.announce_maddrs, args.identity_path, args.nat_traversal,
                    connect_timeout=settings.connect_timeout)
    try:
        serve(args, settings, dht, planned, quant, server_class)
    finally:
        dht.shutdown()


def serve(args: argparse.Namespace, settings: ServerSettings, dht, planned: tuple | None, quant: str,
          server_class: type | None = None) -> None:
    """Load the blocks this server is told (`planned`: read_plan's answer) or chooses to serve, with weights in
    `quant`, and serve them until a signal."""
    from bloombee.dht.peers import visible_maddrs
    from bloombee.server.server import BlockChoice, Server

    if args.new_swarm:
        print("Started a new swarm. Join it with:", flush=True)
        print("  --initial-peers " + " ".join(visible_maddrs(dht)), flush=True)
    start, end = args.blocks or (None, None)
    alpha, schedule = None, None
    if planned is not None:
        start, end, alpha, schedule, _ = planned
    choice = BlockChoice(start=start, end=end, num_blocks=args.num_blocks)
    server = (server_class or Server)(args.model, dht, choice, settings, device=args.device, dtype=args.dtype,
                    public_name=args.public_name, link_bandwidth=args.link_bandwidth_mbps * 1e6 / 8,
                    profile=not args.no_profile, profile_path=args.profile, planned=schedule,
                    planned_offload=alpha, quant_type=quant)
    stop_if_signalled()
    freeze_startup_heap()
    asyncio.run(server.run())


if __name__ == "__main__":
    main()
