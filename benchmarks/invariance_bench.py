"""Issue 31: greedy flips per 1,000 tokens in bfloat16 with the batch-invariant mode and without it, and its cost.

Flips: bloombee-tiny in bfloat16 on one local server, PROMPTS held-out prompts x NEW_TOKENS greedy tokens, each
compared with the same prompt decoded plainly and alone (one token per step, one session at a time):
speculative alone (the draft's trees of 15 nodes, speculation on), plain batched (all prompts as concurrent sessions,
whose steps share the server's forwards) and speculative batched; once with the server and the client in the mode
(`--batch-invariant on`, the default) and once out of it. A flip is the first token where a sequence departs from
its reference; tokens compared are those up to and including it (after it the two continue from different text).

Cost: one block's decode step (a forward of 1 and of 8 one-token rows), prompt step (3 rows of 16 tokens: 48 vectors,
which the mode computes as matmuls of 32 and 16) and tree step (one row, the default tree's 15 nodes) with the mode
on and off, in float32 and bfloat16, for bloombee-tiny and netbench's hidden-2048 pipeline model, in this process
(one torch thread).

    python -m benchmarks.invariance_bench
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.load_bench import in_threads
from benchmarks.netbench.models import resolve
from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, load_block_stack, resolve_model
from bloombee.local_swarm import LocalSwarm
from bloombee.models.core.invariance import make_batch_invariant, row_range
from bloombee.server.backend import BlockBackend
from bloombee.speculative.tree import PackedTrees, TokenTree

RESULTS = Path(__file__).parent / "results" / "invariance"
HELDOUT = Path(__file__).resolve().parent.parent / "bloombee" / "assets" / "eval" / "heldout_sample.txt"
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 24, 200
MODES = ("on", "off")


def prompts(tokenizer) -> list[torch.Tensor]:
    """PROMPTS prompts of PROMPT_TOKENS tokens from evenly spaced places of the held-out text."""
    ids = tokenizer(HELDOUT.read_text(), return_tensors="pt").input_ids[0]
    stride = (ids.numel() - PROMPT_TOKENS) // PROMPTS
    return [ids[i * stride:i * stride + PROMPT_TOKENS][None] for i in range(PROMPTS)]


def generate(model, prompt: torch.Tensor, speculative: bool) -> list[int]:
    options = {} if speculative else {"draft_model": "none"}
    out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **options)
    return out[0, prompt.shape[1]:].tolist()


def generate_all(model, inputs: list[torch.Tensor], speculative: bool, concurrent: bool) -> list[list[int]]:
    outputs: list[list[int] | None] = [None] * len(inputs)

    def run(index: int) -> None:
        outputs[index] = generate(model, inputs[index], speculative)

    in_threads([lambda index=index: run(index) for index in range(len(inputs))], concurrent)
    return outputs


def flips(outputs: list[list[int]], references: list[list[int]]) -> dict:
    """First departures from the references, per 1,000 tokens compared, and where they were."""
    departures, compared = [], 0
    for output, reference in zip(outputs, references):
        first = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), None)
        compared += len(reference) if first is None else first + 1
        if first is not None:
            departures.append(first)
    return {"flips": len(departures), "tokens_compared": compared, "flips_per_1000": 1000 * len(departures) / compared,
            "first_departures": departures}


def measure_flips(mode: str, logs: str | None) -> dict:
    path = resolve_model("bloombee-tiny")
    inputs = prompts(AutoTokenizer.from_pretrained(path))
    with LocalSwarm(str(path), 8, dht_prefix(path), log_dir=logs) as swarm:
        swarm.add_server("--blocks", "0:8", "--batch-invariant", mode)
        with AutoDistributedModel.from_pretrained("bloombee-tiny", initial_peers=swarm.initial_peers,
                                                  batch_invariant=mode, speculation="on") as model:
            reference = generate_all(model, inputs, speculative=False, concurrent=False)
            variants = {"speculative alone": (True, False), "plain batched": (False, True),
                        "speculative batched": (True, True)}
            result = {name: flips(generate_all(model, inputs, *how), reference) for name, how in variants.items()}
    for name, figures in result.items():
        print(json.dumps({"mode": mode, "variant": name, **figures}), flush=True)
    return result


@torch.inference_mode()
def step_ms(backend: BlockBackend, rows: int, repeats: int = 20) -> float:
    """Median milliseconds of a one-token decode step of `rows` rows through the backend's block."""
    session = backend.new_session("cost", backend.start, backend.end, rows, repeats + 2)
    hidden = torch.randn(rows, 1, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    backend.step(session, hidden, 0, 0, None, None)
    times = []
    for position in range(1, repeats + 1):
        began = time.perf_counter()
        backend.step(session, hidden, position, 0, None, None)
        times.append(1e3 * (time.perf_counter() - began))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def prompt_ms(backend: BlockBackend, rows: int = 3, tokens: int = 16, repeats: int = 10) -> float:
    """Median milliseconds of a first step of `rows` rows of `tokens` tokens each through the backend's block."""
    hidden = torch.randn(rows, tokens, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    times = []
    for _ in range(repeats):
        session = backend.new_session("cost", backend.start, backend.end, rows, tokens)
        began = time.perf_counter()
        backend.step(session, hidden, 0, 0, None, None)
        times.append(1e3 * (time.perf_counter() - began))
    return sorted(times)[len(times) // 2]


# the default draft tree (widths 2, 2, 1, 1): 2 children of the root, 2 of each, then one child of each leaf, twice
TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10])


@torch.inference_mode()
def tree_ms(backend: BlockBackend, repeats: int = 10) -> float:
    """Median milliseconds of a tree step of one row (the default tree's 15 nodes) after a 64-token prompt."""
    hidden = torch.randn(64, backend.hidden_size, generator=torch.Generator().manual_seed(0)).to(backend.dtype)
    trees = PackedTrees.of([TokenTree(torch.arange(TREE_PARENTS.numel()), TREE_PARENTS)])
    times = []
    for _ in range(repeats):
        session = backend.new_session("cost", backend.start, backend.end, 1, 64 + TREE_PARENTS.numel())
        backend.step(session, hidden[None], 0, 0, None, None)
        began = time.perf_counter()
        backend.tree_step(session, hidden[:TREE_PARENTS.numel()], 64, 0, trees, None)
        times.append(1e3 * (time.perf_counter() - began))
    return sorted(times)[len(times) // 2]


def measure_cost() -> list[dict]:
    rows = []
    for name in ("bloombee-tiny", "pipeline"):
        path = resolve(name)[0]
        for dtype in (torch.float32, torch.bfloat16):
            figures = {}
            for mode in MODES:
                stack = load_block_stack(path, 0, 1, dtype=dtype)
                chunks = None
                if mode == "on":
                    chunks = row_range(stack, dtype, torch.device("cpu"))
                    make_batch_invariant(stack, dtype, torch.device("cpu"), chunks)
                backend = BlockBackend(stack, "cpu", dtype)
                figures[mode] = {"chunk_rows": None if chunks is None else [chunks.floor, chunks.ceiling],
                                 **{f"rows_{n}_ms": step_ms(backend, n) for n in (1, 8)},
                                 "prompt_ms": prompt_ms(backend), "tree_ms": tree_ms(backend)}
            row = {"model": name, "dtype": str(dtype).removeprefix("torch."), **{
                f"{mode}_{key}": value for mode, values in figures.items() for key, value in values.items()}}
            row.update({f"cost_{key}": row[f"on_{key}_ms"] / row[f"off_{key}_ms"]
                        for key in ("rows_1", "rows_8", "prompt", "tree")})
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(RESULTS / "invariance.json"))
    parser.add_argument("--logs", default=None, help="folder for the server's logs (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"model": "bloombee-tiny", "dtype": "bfloat16", "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
               "new_tokens": NEW_TOKENS, "flips": {mode: measure_flips(mode, args.logs) for mode in MODES},
               "cost": measure_cost()}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
