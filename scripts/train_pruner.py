#!/usr/bin/env python
"""Train bloombee-tiny's tree pruner (``bloombee/speculative/pruning.py``) on the CPU.

For every layer k = 1..L-1 it trains

1. a proxy LM head: a zero-initialised residual adapter ``Linear(D, D)`` followed by the model's
   own (frozen) final norm and LM head, minimising KL(full model || proxy) at every position of
   the training windows, from the hidden state after k blocks;
2. a keep classifier (MLP 3 -> 16 -> 1, features [max p-hat, p-hat[candidate], entropy(p-hat)]
   of the layer-k proxy at position t): the candidates at t are the draft model's top-4 next
   tokens, labelled 1 iff the candidate is the full model's argmax next token at t. BCE with
   pos_weight = #negatives / #positives.

Data: random windows from the TRAINING split of ``collect_corpus`` (scripts/train_tiny.py), the
same split the models were trained on. Evaluation: windows of the VALIDATION split; per layer and
tau, the fraction of candidates with score >= tau and the fraction of label-1 candidates kept
(each candidate on its own, i.e. a one-level tree), the proxy's top-1 agreement with the full
model and the classifier's ROC AUC. The figures are printed and stored in the file's metadata.

Seeded (``torch.manual_seed``, seeded window sampler), one torch thread. The shipped file:

    python scripts/train_pruner.py             # -> bloombee/assets/bloombee-tiny/pruner.safetensors (~4-7 min)
    python scripts/train_pruner.py --out /tmp/p.safetensors --train-windows 16 --val-windows 8   # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_tiny import collect_corpus, encode_stream  # noqa: E402

from bloombee.loading import load_client_head, resolve_model  # noqa: E402
from bloombee.speculative.pruning import (  # noqa: E402
    FEATURES, METADATA_KEY, PRUNER_FILE, KeepClassifier, ProxyHead, candidate_features,
)

TAUS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bloombee-tiny")
    p.add_argument("--draft", default="bloombee-tiny-draft")
    p.add_argument("--out", default=None, help=f"default: <model folder>/{PRUNER_FILE}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-percent", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--train-windows", type=int, default=256)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4, help="draft candidates per position")
    p.add_argument("--epochs", type=int, default=2, help="proxy-head epochs over the training positions")
    p.add_argument("--batch", type=int, default=512, help="positions per proxy-head step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--clf-steps", type=int, default=400)
    p.add_argument("--clf-lr", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def sample_windows(stream: torch.Tensor, n: int, seq_len: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len, (n,), generator=gen)
    return stream[starts[:, None] + torch.arange(seq_len)[None, :]]


@torch.no_grad()
def run_models(target, draft, windows: torch.Tensor, top_k: int, batch: int = 8) -> dict:
    """Hidden states after blocks 1..L-1, the full model's final normed hidden, its argmax and the draft's top-k."""
    hidden, final, top = [], [], []
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        out = target(input_ids=w, output_hidden_states=True)
        hs = out.hidden_states
        hidden.append(torch.stack(hs[1:-1]).flatten(1, 2))  # [L-1, B*T, D]
        final.append(hs[-1].flatten(0, 1))
        top.append(draft(input_ids=w).logits.flatten(0, 1).topk(top_k, dim=-1).indices)
    hidden, final = torch.cat(hidden, 1), torch.cat(final)
    argmax = torch.cat([target.lm_head(f).argmax(-1) for f in final.split(4096)])
    return dict(hidden=hidden, final=final, argmax=argmax, top=torch.cat(top))


def full_logprobs(head, final: torch.Tensor) -> torch.Tensor:
    """The full model's next-token log-probs from its final (already normed) hidden state."""
    return torch.log_softmax(head.lm_head(final).float(), -1)


def train_proxy(proxy: ProxyHead, head, hidden: torch.Tensor, final: torch.Tensor, args, gen) -> float:
    opt = torch.optim.Adam(proxy.adapter.parameters(), lr=args.lr)
    n = len(hidden)
    total_steps = args.epochs * ((n + args.batch - 1) // args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(1, total_steps))
    loss_ema = None
    for _ in range(args.epochs):
        for idx in torch.randperm(n, generator=gen).split(args.batch):
            with torch.no_grad():
                target_logp = full_logprobs(head, final[idx])
            logq = torch.log_softmax(proxy.logits(hidden[idx]), -1)
            loss = F.kl_div(logq, target_logp, log_target=True, reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
    return loss_ema


@torch.no_grad()
def features_and_labels(proxy: ProxyHead, hidden, top, argmax) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features [P*K, 3], labels [P*K] and the proxy's argmax [P]."""
    feats, proxy_top = [], []
    for h, t in zip(hidden.split(4096), top.split(4096)):
        logits = proxy.logits(h)
        proxy_top.append(logits.argmax(-1))
        k = t.shape[1]
        feats.append(candidate_features(logits.repeat_interleave(k, 0), t.reshape(-1)))
    labels = (top == argmax[:, None]).reshape(-1).float()
    return torch.cat(feats), labels, torch.cat(proxy_top)


def train_classifier(features: torch.Tensor, labels: torch.Tensor, args) -> KeepClassifier:
    clf = KeepClassifier()
    clf.set_normalisation(features)
    pos = labels.sum().clamp_min(1.0)
    pos_weight = (len(labels) - pos) / pos
    opt = torch.optim.Adam(clf.net.parameters(), lr=args.clf_lr)
    for _ in range(args.clf_steps):
        loss = F.binary_cross_entropy_with_logits(clf.logit(features), labels, pos_weight=pos_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return clf.eval().requires_grad_(False)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability a random positive outscores a random negative (ties count half)."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    allv = torch.cat([pos, neg]).double()
    order = allv.argsort()
    ranks = torch.empty_like(allv)
    ranks[order] = torch.arange(1, len(allv) + 1, dtype=torch.float64)
    for v in allv.unique()[allv.unique(return_counts=True)[1] > 1]:  # average ranks of ties
        ranks[allv == v] = ranks[allv == v].mean()
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def evaluate(proxy, clf, data) -> dict:
    feats, labels, proxy_top = features_and_labels(proxy, data["hidden_k"], data["top"], data["argmax"])
    with torch.no_grad():
        scores = clf(feats)
    pos = labels > 0.5
    rows = {f"{tau:g}": {"kept": float((scores >= tau).float().mean()),
                         "accepted_kept": float((scores[pos] >= tau).float().mean())} for tau in TAUS}
    return dict(top1_agreement=float((proxy_top == data["argmax"]).float().mean()),
                auc=roc_auc(scores, labels), positive_rate=float(labels.mean()), candidates=len(labels),
                taus=rows)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.time()
    model_dir, draft_dir = resolve_model(args.model), resolve_model(args.draft)
    out = Path(args.out) if args.out else model_dir / PRUNER_FILE
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    head = load_client_head(model_dir, dtype=torch.float32)
    cfg = target.config
    n_layers = cfg.num_hidden_layers

    train, val = collect_corpus(args.val_percent)
    train_stream = encode_stream(tok, [t for _, t in train])
    val_stream = encode_stream(tok, [t for _, t in val])
    train_w = sample_windows(train_stream, args.train_windows, args.seq_len, args.seed + 1)
    val_w = sample_windows(val_stream, args.val_windows, args.seq_len, args.seed + 2)
    print(f"corpus: train {len(train_stream):,} tokens, val {len(val_stream):,}; windows {len(train_w)} train, "
          f"{len(val_w)} val x {args.seq_len}", flush=True)

    t = time.time()
    tr, va = run_models(target, draft, train_w, args.top_k), run_models(target, draft, val_w, args.top_k)
    print(f"model passes: {time.time() - t:.1f}s", flush=True)

    gen = torch.Generator().manual_seed(args.seed + 3)
    state, report = {}, {}
    t_train = time.time()
    for k in range(1, n_layers):
        t = time.time()
        torch.manual_seed(args.seed + 100 + k)
        proxy = ProxyHead(cfg.hidden_size, head.norm, head.lm_head)
        kl = train_proxy(proxy, head, tr["hidden"][k - 1], tr["final"], args, gen)
        proxy.eval().requires_grad_(False)
        feats, labels, _ = features_and_labels(proxy, tr["hidden"][k - 1], tr["top"], tr["argmax"])
        clf = train_classifier(feats, labels, args)
        state[f"proxy.{k}.weight"] = proxy.adapter.weight.detach().clone().contiguous()
        state[f"proxy.{k}.bias"] = proxy.adapter.bias.detach().clone().contiguous()
        state.update({f"classifier.{k}.{n}": v.detach().clone().contiguous() for n, v in clf.state_dict().items()})
        identity = ProxyHead(cfg.hidden_size, head.norm, head.lm_head)
        res = evaluate(proxy, clf, dict(va, hidden_k=va["hidden"][k - 1]))
        res["top1_agreement_identity"] = evaluate(identity, clf, dict(va, hidden_k=va["hidden"][k - 1]))[
            "top1_agreement"]
        res["train_kl_ema"] = kl
        report[str(k)] = res
        print(f"layer {k}: train KL {kl:.3f}, val top-1 agreement {res['top1_agreement']:.3f} "
              f"(no adapter {res['top1_agreement_identity']:.3f}), AUC {res['auc']:.3f} [{time.time() - t:.1f}s]",
              flush=True)
    train_time = time.time() - t_train

    print("\nheld-out (validation) candidates kept / accepted candidates kept, per tau:")
    print("layer  top1  AUC   " + "  ".join(f"tau={tau:<9g}" for tau in TAUS))
    for k, res in report.items():
        cells = "  ".join(f"{r['kept']:.2f}/{r['accepted_kept']:.2f}  " for r in res["taus"].values())
        print(f"{k:>5}  {res['top1_agreement']:.3f} {res['auc']:.3f} {cells}")
    pos_rate = report["1"]["positive_rate"]
    print(f"(accepted rate of draft top-{args.top_k} candidates on validation: {pos_rate:.3f})")

    total = time.time() - t_start
    meta = dict(
        model=args.model, draft=args.draft, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        num_hidden_layers=n_layers, layers=list(range(1, n_layers)), features=list(FEATURES),
        proxy="h + Linear(D, D)(h) -> model final norm -> model LM head (norm and head not stored)",
        classifier="standardise(features) -> Linear(3, 16) -> GELU -> Linear(16, 1) -> sigmoid",
        command="python scripts/train_pruner.py" + ("" if argv is None and len(sys.argv) < 2
                                                    else " " + shlex.join(sys.argv[1:] if argv is None else argv)),
        seed=args.seed, args=vars(args), threads=args.threads, python=platform.python_version(),
        torch=torch.__version__, data=f"{args.train_windows} training-split windows of {args.seq_len} tokens; "
        f"eval on {args.val_windows} validation-split windows; candidates: draft top-{args.top_k}; "
        f"label: candidate == full model argmax",
        train_seconds=round(train_time, 1), total_seconds=round(total, 1), eval=report,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(state, str(out), metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
    print(f"\nwrote {out} ({out.stat().st_size:,} bytes); training {train_time:.1f}s, total {total:.1f}s", flush=True)


if __name__ == "__main__":
    main()
