"""`bloombee-client`: generate text through the swarm, see who serves a model, or run a local demo swarm."""

import argparse
import json
import sys
import time

from bloombee.cli.common import (
    ArgumentParser,
    UsageError,
    add_common_flags,
    add_peer_flags,
    add_settings_flags,
    check_initial_peers,
    log_level,
    parse_args,
    positive_int,
    run_main,
    settings_overrides,
    setup_logging,
)
from bloombee.settings import ClientSettings, load_settings


class PrintStreamer:
    """Prints each new token as it arrives: text when a tokenizer exists, ids otherwise."""

    def __init__(self, tokenizer, prompt_length: int):
        self.tokenizer, self.prompt_left, self.ids, self.printed = tokenizer, prompt_length, [], 0

    def put(self, value) -> None:
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


def load_tokenizer(path):
    """The model folder's tokenizer, or None when the folder has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def require_peers(args: argparse.Namespace) -> None:
    if not args.initial_peers:
        raise UsageError("pass --initial-peers of a running swarm (bloombee-dht prints them)")
    check_initial_peers(args.initial_peers)


def prompt_ids(args: argparse.Namespace, tokenizer):
    import torch

    if args.input_ids:
        try:
            return torch.tensor([[int(token) for token in args.input_ids.split(",")]])
        except ValueError:
            raise UsageError(f"--input-ids takes comma-separated token ids, e.g. 1,2,3; got {args.input_ids!r}") from None
    if tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer files; pass --input-ids 1,2,3 instead of --prompt")
    return tokenizer(args.prompt, return_tensors="pt").input_ids


def session_length(args: argparse.Namespace, config, prompt_length: int) -> int:
    """The session's max_length: --max-length or prompt + new tokens, checked against the model's context length."""
    needed = prompt_length + args.max_new_tokens
    context = getattr(config, "max_position_embeddings", None)
    if context and needed > context:
        raise UsageError(f"the prompt ({prompt_length} tokens) plus --max-new-tokens {args.max_new_tokens} is {needed} "
                         f"tokens, beyond {args.model}'s context length of {context}; shorten the prompt or lower "
                         "--max-new-tokens")
    if args.max_length is not None and args.max_length < needed:
        raise UsageError(f"--max-length {args.max_length} is shorter than the prompt ({prompt_length} tokens) plus "
                         f"--max-new-tokens {args.max_new_tokens}; raise it to at least {needed}")
    return args.max_length or needed


def generate(args: argparse.Namespace) -> None:
    settings = load_settings(ClientSettings, settings_overrides(args, ClientSettings))  # a typo is refused at once
    require_peers(args)

    import torch

    from bloombee.client import AutoDistributedModel
    from bloombee.loading import load_model_config, resolve_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    input_ids = prompt_ids(args, tokenizer)
    max_length = session_length(args, load_model_config(path), input_ids.shape[1])
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoDistributedModel.from_pretrained(args.model, initial_peers=args.initial_peers, dtype=dtype,
                                                 **settings.model_dump())
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) if args.temperature > 0 else dict(do_sample=False)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    beams = args.num_beams > 1  # transformers streams no beam search, and speculative rounds follow one hypothesis
    draft = model.settings_draft() if args.max_length is None and not beams else None  # else plainly, in a session below
    stream = args.stream and not beams
    streamer = PrintStreamer(tokenizer, input_ids.shape[1]) if stream else None
    if stream and tokenizer is not None:  # everything is loaded: the prompt shows just before generating
        print(args.prompt if args.prompt else "", end="", flush=True)
    began = time.perf_counter()
    kwargs = dict(max_new_tokens=args.max_new_tokens, streamer=streamer, pad_token_id=getattr(tokenizer, "pad_token_id", None),
                  num_beams=args.num_beams, **sampling)
    if draft is not None:  # speculative generation opens its own session, as long as its trees need
        output = model.generate(input_ids, draft_model=draft, **kwargs)
        stats = model.last_speculation
        spans, chain = stats.chain, speculation_text(stats, output.shape[1] - input_ids.shape[1])
    else:
        with model.inference_session(max_length=max_length, batch_size=args.num_beams) as session:
            output = model.generate(input_ids, **kwargs)
            spans, chain = [(span.record.public_name or span.peer_id[-8:], span.start, span.end)
                            for span in session.spans], ""
    servers = " -> ".join(f"{name}[{start}:{end}]" for name, start, end in spans)
    seconds = time.perf_counter() - began
    new_ids = output[0, input_ids.shape[1]:]
    if not stream:
        print(tokenizer.decode(output[0], skip_special_tokens=True) if tokenizer else " ".join(map(str, output[0].tolist())))
    print(f"[{len(new_ids)} tokens in {seconds:.2f} s, {len(new_ids) / seconds:.1f} tokens/s, servers: {servers}{chain}]",
          file=sys.stderr)


def speculation_text(stats, new_tokens: int) -> str:
    """What speculative decoding did, in a user's words: tokens per step through the servers, on average."""
    steps = stats.tree_rounds + stats.plain_rounds
    if not steps:
        return ""
    return (f", speculative decoding: {new_tokens / steps:.1f} tokens per step on average "
            f"({steps} steps through the servers)")


def read_statuses(args: argparse.Namespace) -> list:
    """The swarm's status for --model, or for every model its servers list in the DHT."""
    from bloombee.client.swarm_status import model_status
    from bloombee.dht.peers import start_dht
    from bloombee.dht.records import fetch_models
    from bloombee.loading import dht_prefix, load_model_config

    require_peers(args)
    num_blocks = load_model_config(args.model).num_hidden_layers if args.model else None  # a bad name fails before joining
    dht = start_dht(args.initial_peers, client_mode=True)
    try:
        if args.model:
            return [model_status(dht, args.model, dht_prefix(args.model), num_blocks)]
        return [model_status(dht, entry.model, prefix, entry.num_blocks) for prefix, entry in sorted(fetch_models(dht).items())]
    finally:
        dht.shutdown()


def info(args: argparse.Namespace) -> int:
    """Who serves what; exit status 1 when some block has no server."""
    [status] = read_statuses(args)
    print(f"{status.prefix}: {status.num_blocks} blocks, {len(status.servers)} servers")
    for server in status.servers:
        print(f"  {server.public_name or '-':12} {server.peer_id}  blocks {server.start_block}:{server.end_block}  "
              f"{server.state:8}  {server.throughput:8.1f} block-steps/s  {server.dtype} on {server.device}, weights {server.weights_text}  "
              f"cache {server.cache_tokens_left} tokens")
    if status.uncovered:
        print(f"  coverage gap: blocks {status.uncovered_text} are served by nobody; start a server for them "
              f"(bloombee-server --model {args.model} --blocks {status.uncovered[0]}:{status.uncovered[-1] + 1} ...)")
        return 1
    return 0


def status(args: argparse.Namespace) -> int:
    """Per model: each server, the blocks nobody serves, whether a full chain exists; exit 1 where one lacks it."""
    from bloombee.client.swarm_status import status_lines

    models = read_statuses(args)
    if not models:
        print("no server of any model is announced in this swarm")
        return 1
    if args.json:
        print(json.dumps({"models": [model.model_dump(mode="json") for model in models]}, indent=2))
    else:
        print("\n\n".join("\n".join(status_lines(model)) for model in models))
    return 0 if all(model.full_chain for model in models) else 1


def demo(args: argparse.Namespace) -> None:
    """Start a bootstrap peer and servers on 127.0.0.1, generate through them, shut everything down."""
    from bloombee.loading import dht_prefix, load_model_config
    from bloombee.local_swarm import LocalSwarm

    num_blocks = load_model_config(args.model).num_hidden_layers
    if args.servers > num_blocks:
        raise UsageError(f"--servers {args.servers} is more than the {num_blocks} blocks of {args.model}; each server "
                         "needs at least one block")
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
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens the session reserves on each server, prompt included (default: prompt + "
                             "--max-new-tokens); a server refuses a session longer than its own --max-length. Given, "
                             "the generation decodes plainly in that session (speculation sizes its own)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample only from the most likely tokens whose probabilities add up to this (default: "
                             "%(default)s = all)")
    parser.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens; 0 = all (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: none)")
    parser.add_argument("--num-beams", type=positive_int, default=1,
                        help="beam search over this many hypotheses, as transformers' generate(num_beams=...); above 1 "
                             "it decodes plainly and prints the text once done (default: %(default)s)")
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                        help="print tokens as they arrive (default: on, unless --num-beams is above 1)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="dtype of the client's embeddings and LM head (default: %(default)s, the checkpoint's)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bloombee-client", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text through the swarm, streamed to the terminal")
    gen.add_argument("--model", required=True, help="model folder, hub id or alias, e.g. bloombee-tiny (required)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--input-ids", help="comma-separated token ids (for models without a tokenizer)")
    add_generation_flags(gen)
    add_peer_flags(gen)
    add_settings_flags(gen, ClientSettings)
    gen.set_defaults(run=generate)
    show = commands.add_parser("info", help="list the servers of a model and flag blocks nobody serves")
    show.add_argument("--model", required=True, help="model folder, hub id or alias (required)")
    add_peer_flags(show)
    show.set_defaults(run=info)
    look = commands.add_parser("status", help="the swarm's health per model: servers, gaps, whether a full chain exists")
    look.add_argument("--model", help="model folder, hub id or alias (default: every model the swarm's servers list)")
    look.add_argument("--json", action="store_true", help="print the status as JSON (default: a table)")
    add_peer_flags(look)
    look.set_defaults(run=status)
    local = commands.add_parser("demo", help="start a local swarm on 127.0.0.1, generate through it, shut it down")
    local.add_argument("--model", default="bloombee-tiny", help="model folder, hub id or alias (default: %(default)s)")
    local.add_argument("--servers", type=positive_int, default=2,
                       help="server processes, each with a part of the blocks (default: %(default)s)")
    local.add_argument("--prompt", default="def fibonacci(n):", help="text to continue (default: %(default)r)")
    add_generation_flags(local)
    local.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    add_common_flags(local, default_level="warning")
    add_settings_flags(local, ClientSettings)
    local.set_defaults(run=demo)
    for command in (gen, show, look):
        command.set_defaults(log_level="warning")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    setup_logging(log_level(args))
    sys.exit(run_main("bloombee-client", lambda: args.run(args), log_level(args)))


if __name__ == "__main__":
    main()
