"""`bloombee-api`: an OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions, /status)
in front of the swarm.

    bloombee-api --model bloombee-tiny --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/PEER [--host 127.0.0.1 --port 8000]
"""

import argparse
import sys

from bloombee.cli.common import (
    ArgumentParser,
    add_peer_flags,
    add_settings_flags,
    check_initial_peers,
    freeze_startup_heap,
    log_level,
    parse_args,
    run_main,
    settings_overrides,
    setup_logging,
)
from bloombee.settings import ApiSettings, ClientSettings, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bloombee-api", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder, hub id or alias, e.g. bloombee-tiny; requests name "
                        "it in their `model` field (required)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="dtype of the client's embeddings and LM head (default: %(default)s, the checkpoint's)")
    add_peer_flags(parser)
    add_settings_flags(parser, ApiSettings)
    add_settings_flags(parser, ClientSettings)
    return parser


def serve(args: argparse.Namespace) -> None:
    settings = load_settings(ApiSettings, settings_overrides(args, ApiSettings))  # a typo is refused at once
    client_settings = load_settings(ClientSettings, settings_overrides(args, ClientSettings))
    check_initial_peers(args.initial_peers)

    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from bloombee.api import create_app
    from bloombee.api.engine import Engine
    from bloombee.client import AutoDistributedModel
    from bloombee.loading import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model, weights=False))
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoDistributedModel.from_pretrained(args.model, initial_peers=args.initial_peers, dtype=dtype,
                                                 **client_settings.model_dump())
    with model:  # its DHT peer and p2p daemon end with the server
        engine = Engine(model, tokenizer, args.model, settings)
        app = create_app(engine)
        if settings.metrics_port is not None:
            engine.metrics.serve(settings.metrics_host, settings.metrics_port)
            print(f"Metrics on http://{settings.metrics_host}:{settings.metrics_port}/metrics", flush=True)
        print(f"Serving {args.model} on http://{settings.host}:{settings.port}/v1 (swarm status: /status)", flush=True)
        freeze_startup_heap()
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level(args), access_log=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging(log_level(args))
    return run_main("bloombee-api", lambda: serve(args), log_level(args))


if __name__ == "__main__":
    sys.exit(main())
