"""Prompt-tune bloombee-tiny through a local swarm to write docstrings in one fixed style.

Two servers on 127.0.0.1 hold the model's blocks, frozen; this script trains only deep prompts (16 tokens, one
prompt per block: `tuning_mode="deep_ptune"`) on the client, each step's loss backpropagated through the servers. The task:
after a function's signature, open the body with the house docstring `DOCSTRING`. Before and after, the model
completes signatures it never trained on; the loss curve is saved as a plot.

    python examples/prompt_tuning.py --plot prompt_tuning_loss.png
"""

import argparse
import random

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from bloombee.client import AutoDistributedModel
from bloombee.loading import dht_prefix, resolve_model
from bloombee.local_swarm import LocalSwarm

TRAIN_NAMES = ["add", "scale", "parse_row", "load_config", "mean", "flatten", "merge", "read_lines", "clip",
               "normalize", "split_words", "count_items", "to_json", "find_max", "save", "shuffle"]
HELD_OUT = ["sort_pairs", "total", "unique_values"]
ARGUMENTS = ["x", "a, b", "path", "values", "data, key", "items"]
DOCSTRING = '    """Compute the result."""\n'


def example(name: str, rng: random.Random) -> tuple[str, str]:
    """A signature and what the tuned model should write after it."""
    return f"def {name}({rng.choice(ARGUMENTS)}):\n", DOCSTRING


def batch(tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and labels scoring the docstring tokens only."""
    rows, masks, labels = [], [], []
    for signature, docstring in pairs:
        prompt, target = tokenizer(signature).input_ids, tokenizer(docstring, add_special_tokens=False).input_ids
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    for row, label in zip(rows, labels):
        pad = width - len(row)
        masks.append([1] * len(row) + [0] * pad)
        row.extend([tokenizer.pad_token_id] * pad)
        label.extend([-100] * pad)
    return {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks), "labels": torch.tensor(labels)}


def complete(model, tokenizer, names: list[str]) -> list[str]:
    """The model's greedy continuation (one line) of a signature of each name."""
    texts = []
    for name in names:
        ids = tokenizer(f"def {name}(x):\n", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=14, do_sample=False)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:]).split("\n")[0])
    return texts


def save_plot(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot(range(1, len(losses) + 1), losses)
    axis.set(xlabel="training step", ylabel="loss (docstring tokens)", yscale="log",
             title="deep prompt tuning of bloombee-tiny through 2 servers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="pre_seq_len: the prompt's length")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--plot", default="prompt_tuning_loss.png", help="where the loss curve goes")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    path = resolve_model("bloombee-tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LocalSwarm(str(path), 8, dht_prefix(path)) as swarm:
        swarm.add_server("--blocks", "0:4")
        swarm.add_server("--blocks", "4:8")
        with AutoDistributedModel.from_pretrained(str(path), initial_peers=swarm.initial_peers, dtype=torch.float32,
                                                  tuning_mode="deep_ptune", pre_seq_len=args.prompt_tokens) as model:
            before = complete(model, tokenizer, HELD_OUT)
            optimizer = torch.optim.Adam(model.prompt_tuning.parameters(), lr=args.lr)
            losses = []
            for _ in (bar := tqdm(range(args.steps), desc="prompt tuning", unit="step")):
                names = rng.sample(TRAIN_NAMES, args.batch_size)
                loss = model(**batch(tokenizer, [example(name, rng) for name in names])).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            after = complete(model, tokenizer, HELD_OUT)
    save_plot(losses, args.plot)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; curve in {args.plot}")
    for name, old, new in zip(HELD_OUT, before, after):
        print(f"def {name}(x):\n  before tuning: {old!r}\n  after tuning:  {new!r}")


if __name__ == "__main__":
    main()
