"""Tree pruning on the first server: a proxy LM head per layer scores draft candidates, weak branches are cut.

After blocks [0, k) the first server holds the hidden state of every node of the draft tree. A
proxy head (residual linear adapter, then the model's own final norm and LM head) turns node i's
PARENT hidden state into p-hat, an estimate of the full model's next-token distribution; the
features [max p-hat, p-hat[token_i], entropy(p-hat)] feed a tiny MLP whose sigmoid output is the
keep score of node i. Nodes scoring below tau are dropped with all their descendants; the root
(node 0, parents == -1) is always kept. Weights live in ``<model folder>/pruner.safetensors``
(see ``scripts/train_pruner.py``); the norm and LM head come from the model itself.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from bloombee.speculative.dtypes import faster_dtype
from bloombee.speculative.tree import close_under_ancestors

logger = logging.getLogger(__name__)

PRUNER_FILE = "pruner.safetensors"
METADATA_KEY = "bloombee_pruner"
FEATURES = ("max_p", "p_token", "entropy")


class ProxyHead(nn.Module):
    """out = h + W h + b (W, b start at zero), then the model's frozen final norm and LM head."""

    def __init__(self, hidden_size: int, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.adapter = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.adapter.weight)
        nn.init.zeros_(self.adapter.bias)
        # Shared and frozen; kept out of this module's parameters/state so they are never stored or trained.
        object.__setattr__(self, "_head", (norm, lm_head))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; the adapter runs in float32, the norm and head in the head's own dtype."""
        norm, lm_head = self._head
        hidden = hidden.float()
        adapted = (hidden + self.adapter(hidden)).to(lm_head.weight.dtype)
        return lm_head(norm(adapted)).float()

    def move_to(self, device) -> "ProxyHead":
        """Move the adapter and the shared norm / LM head."""
        for module in (self, *self._head):
            module.to(device)
        return self

    forward = logits


class KeepClassifier(nn.Module):
    """MLP 3 -> 16 -> 1 on standardised features; ``forward`` gives the keep score in [0, 1]."""

    def __init__(self, n_features: int = len(FEATURES), width: int = 16):
        super().__init__()
        self.register_buffer("feature_mean", torch.zeros(n_features))
        self.register_buffer("feature_std", torch.ones(n_features))
        self.net = nn.Sequential(nn.Linear(n_features, width), nn.GELU(), nn.Linear(width, 1))

    def set_normalisation(self, features: torch.Tensor) -> None:
        """Store the mean/std of training features (std floored so constant features stay finite)."""
        self.feature_mean.copy_(features.mean(0))
        self.feature_std.copy_(features.std(0).clamp_min(1e-6))

    def logit(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features - self.feature_mean) / self.feature_std).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(features))


def candidate_features(parent_logits: torch.Tensor, tokens: torch.Tensor,
                       parent_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[max p, p[token], entropy] of each candidate, p = softmax of its parent's logits: row parent_rows[i] of
    `parent_logits` (default row i); float32, [N, 3]. Each parent's distribution is computed once."""
    logp = torch.log_softmax(parent_logits.float(), dim=-1)
    p = logp.exp()
    per_parent = torch.stack([p.max(-1).values, -(p * logp).sum(-1)], dim=-1)
    if parent_rows is None:
        parent_rows = torch.arange(len(tokens), device=p.device)
    p_token = p[parent_rows, tokens.long()]
    max_p, entropy = per_parent[parent_rows].unbind(-1)
    return torch.stack([max_p, p_token, entropy], dim=-1)


def read_metadata(path: str | os.PathLike) -> dict:
    """The JSON description stored in a pruner file's safetensors metadata."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return json.loads(meta.get(METADATA_KEY, "{}"))


def _layers_in(state: dict[str, torch.Tensor]) -> list[int]:
    proxy = {int(k.split(".")[1]) for k in state if k.startswith("proxy.")}
    clf = {int(k.split(".")[1]) for k in state if k.startswith("classifier.")}
    return sorted(proxy & clf)


class TreePruner:
    """Scores and prunes draft-tree candidates after a given number of blocks of one model."""

    def __init__(self, layer: int, proxy: ProxyHead, classifier: KeepClassifier, layers: list[int],
                 metadata: dict | None = None):
        self.layer, self.proxy, self.classifier = layer, proxy, classifier
        self.layers = layers
        self.metadata = metadata or {}

    @classmethod
    def load(cls, model_path, layer: int, dtype: torch.dtype | None = None, device="cpu") -> "TreePruner | None":
        """The pruner for hidden states after ``layer`` blocks, or None without a file or a head for it.

        Adapter, features and classifier run in float32; ``dtype`` is the norm / LM head's dtype, by default the
        faster of float32 and bfloat16 here (`faster_dtype`: the proxy head reads the whole LM head every step)."""
        from safetensors.torch import load_file

        from bloombee.loading import load_client_head

        path = Path(model_path) / PRUNER_FILE
        if not path.is_file():
            logger.info("no %s in %s: tree pruning disabled", PRUNER_FILE, model_path)
            return None
        state = load_file(str(path))
        layers = _layers_in(state)
        if layer not in layers:
            logger.info("%s holds layers %s, not %d: tree pruning disabled", path, layers, layer)
            return None
        head = load_client_head(model_path, dtype=dtype or torch.float32, device=device)
        if dtype is None:
            head.to(faster_dtype(head.lm_head.weight, rows=16))
            logger.info("proxy LM head in %s", next(head.parameters()).dtype)
        proxy = ProxyHead(head.config.hidden_size, head.norm, head.lm_head)  # embeddings are not kept
        proxy.adapter.load_state_dict({"weight": state[f"proxy.{layer}.weight"], "bias": state[f"proxy.{layer}.bias"]})
        classifier = KeepClassifier()
        prefix = f"classifier.{layer}."
        classifier.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        proxy.move_to(device).eval().requires_grad_(False)
        classifier.to(device).eval().requires_grad_(False)
        logger.info("loaded tree pruner for layer %d from %s", layer, path)
        return cls(layer, proxy, classifier, layers, read_metadata(path))

    @torch.no_grad()
    def score_candidates(self, parent_hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Keep score of each candidate token given its parent's hidden state ([M, D], [M] -> [M])."""
        return self.classifier(candidate_features(self._proxy_logits(parent_hidden), tokens.to(parent_hidden.device)))

    @torch.no_grad()
    def keep_scores(self, hidden: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Score of every node of the tree (float32, [N]); the root gets 1.0. The proxy head (an LM head: the
        costly part) runs once per node that has children."""
        parents = parents.to(hidden.device).long()
        scores = torch.ones(len(parents), dtype=torch.float32, device=hidden.device)
        if len(parents) > 1:
            internal, parent_rows = torch.unique(parents[1:], return_inverse=True)
            features = candidate_features(self._proxy_logits(hidden[internal]), tokens.to(hidden.device)[1:],
                                          parent_rows)
            scores[1:] = self.classifier(features)
        return scores

    @torch.no_grad()
    def prune(self, hidden: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, tau: float) -> torch.Tensor:
        """Bool mask (on the CPU) of nodes kept: score >= tau and every ancestor kept; tau <= 0 keeps all."""
        if tau <= 0:
            return torch.ones(len(parents), dtype=torch.bool)
        return close_under_ancestors(parents.cpu(), (self.keep_scores(hidden, tokens, parents) >= tau).cpu())

    def _proxy_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.classifier.feature_mean.device != hidden.device:
            self.proxy.move_to(hidden.device)
            self.classifier.to(hidden.device)
        return self.proxy.logits(hidden)
