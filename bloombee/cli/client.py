"""`bloombee-client`: generate text through the swarm, or list who serves a model."""

import argparse
import logging
import sys
import time

import torch
from transformers import AutoTokenizer

from bloombee.cli.common import add_peer_flags, add_settings_flags, settings_overrides, setup_logging
from bloombee.client import AutoDistributedModel
from bloombee.dht.records import fetch_records
from bloombee.loading import resolve_model
from bloombee.settings import ClientSettings


class PrintStreamer:
    """Prints each new token as it arrives: text when a tokenizer exists, ids otherwise."""

    def __init__(self, tokenizer, prompt_length: int):
        self.tokenizer, self.prompt_left, self.ids, self.printed = tokenizer, prompt_length, [], 0

    def put(self, value: torch.Tensor) -> None:
        values = value.flatten().tolist()
        if self.prompt_left:  # the first call carries the prompt
            self.prompt_left = 0
            return
        self.ids.extend(values)
        if self.tokenizer is None:
            print(" ".join(map(str, values)), end=" ", flush=True)
            return
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)

    def end(self) -> None:
        print(flush=True)


def load_tokenizer(model: str):
    try:
        return AutoTokenizer.from_pretrained(resolve_model(model))
    except (OSError, ValueError):
        return None


def require_peers(args: argparse.Namespace) -> None:
    if not args.initial_peers:
        raise SystemExit("bloombee-client: pass --initial-peers of a running swarm (printed by bloombee-dht)")


def generate(args: argparse.Namespace) -> None:
    require_peers(args)
    tokenizer = load_tokenizer(args.model)
    if args.input_ids:
        input_ids = torch.tensor([[int(token) for token in args.input_ids.split(",")]])
    elif tokenizer is None:
        raise SystemExit(f"bloombee-client: {args.model} has no tokenizer files; pass --input-ids 1,2,3 instead of --prompt")
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    model = AutoDistributedModel.from_pretrained(args.model, initial_peers=args.initial_peers, dtype=args.dtype,
                                                 **settings_overrides(args, ClientSettings))
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) if args.temperature > 0 else dict(do_sample=False)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    streamer = PrintStreamer(tokenizer, input_ids.shape[1]) if args.stream else None
    if args.stream and tokenizer is not None:
        print(args.prompt if args.prompt else "", end="", flush=True)
    began = time.perf_counter()
    with model.inference_session(max_length=input_ids.shape[1] + args.max_new_tokens) as session:
        output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, streamer=streamer,
                                pad_token_id=getattr(tokenizer, "pad_token_id", None), **sampling)
        chain = " -> ".join(f"{span.record.public_name or span.peer_id[-8:]}[{span.start}:{span.end}]" for span in session.spans)
    seconds = time.perf_counter() - began
    new_ids = output[0, input_ids.shape[1]:]
    if not args.stream:
        print(tokenizer.decode(output[0], skip_special_tokens=True) if tokenizer else " ".join(map(str, output[0].tolist())))
    print(f"[{len(new_ids)} tokens in {seconds:.2f} s, {len(new_ids) / seconds:.1f} tokens/s, servers: {chain}]", file=sys.stderr)


def info(args: argparse.Namespace) -> None:
    from bloombee.dht.peers import start_dht
    from bloombee.loading import dht_prefix, load_model_config

    require_peers(args)
    config = load_model_config(args.model)
    prefix = dht_prefix(args.model)
    dht = start_dht(args.initial_peers, client_mode=True)
    servers = {}
    for records in fetch_records(dht, prefix, config.num_hidden_layers):
        servers.update(records)
    print(f"{prefix}: {config.num_hidden_layers} blocks, {len(servers)} servers")
    for peer_id, record in sorted(servers.items(), key=lambda item: item[1].start_block):
        print(f"  {record.public_name or '-':12} {peer_id}  blocks {record.start_block}:{record.end_block}  {record.state.value:8}"
              f"  {record.throughput:8.1f} block-steps/s  {record.dtype} on {record.device}  cache {record.cache_tokens_left} tokens")
    dht.shutdown()


def demo(args: argparse.Namespace) -> None:
    """Start a bootstrap peer and servers on 127.0.0.1, generate through them, shut everything down."""
    from bloombee.loading import dht_prefix, load_model_config
    from bloombee.local_swarm import LocalSwarm

    num_blocks = load_model_config(args.model).num_hidden_layers
    bounds = [round(index * num_blocks / args.servers) for index in range(args.servers + 1)]
    with LocalSwarm(args.model, num_blocks, dht_prefix(args.model)) as swarm:
        print(f"Bootstrap peer: {swarm.initial_peers[0]}  (logs in {swarm.log_dir})", flush=True)
        names = []
        for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
            names.append(f"server{index}")
            swarm.add_server("--blocks", f"{start}:{end}", name=names[-1], wait=False)
            print(f"Starting {names[-1]} with blocks {start}:{end} of {num_blocks}", flush=True)
        swarm.wait_online(names)
        print("All servers online. Generating:\n", flush=True)
        args.initial_peers, args.input_ids = swarm.initial_peers, None
        generate(args)
        print("\nShutting the swarm down.", flush=True)


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="print tokens as they arrive")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bloombee-client", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text through the swarm, streamed to the terminal")
    gen.add_argument("--model", required=True, help="model folder, hub id or alias")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--input-ids", help="comma-separated token ids (for models without a tokenizer)")
    add_generation_flags(gen)
    add_peer_flags(gen)
    add_settings_flags(gen, ClientSettings)
    gen.set_defaults(run=generate)
    show = commands.add_parser("info", help="list the servers of a model")
    show.add_argument("--model", required=True)
    add_peer_flags(show)
    show.set_defaults(run=info)
    local = commands.add_parser("demo", help="start a local swarm on 127.0.0.1, generate through it, shut it down")
    local.add_argument("--model", default="bloombee-tiny")
    local.add_argument("--servers", type=int, default=2, help="server processes, each with a part of the blocks")
    local.add_argument("--prompt", default="def fibonacci(n):")
    add_generation_flags(local)
    local.add_argument("-v", "--verbose", action="store_true")
    add_settings_flags(local, ClientSettings)
    local.set_defaults(run=demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose, quiet_level=logging.WARNING)
    if getattr(args, "dtype", "auto") != "auto":
        args.dtype = getattr(torch, args.dtype)
    args.run(args)


if __name__ == "__main__":
    main()
