"""`AutoDistributedModelForCausalLM`: local embeddings and LM head, remote blocks, transformers' generate()."""

import contextlib
import contextvars
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from bloombee.client.lifetime import release
from bloombee.client.prompt_tuning import PromptTuning
from bloombee.client.remote import RemoteSequential
from bloombee.client.session import InferenceSession
from bloombee.dht.peers import start_dht
from bloombee.loading import dht_prefix, load_client_head, load_model_config, resolve_model
from bloombee.models.core.invariance import make_batch_invariant, row_range
from bloombee.settings import ClientSettings, load_settings
from bloombee.speculative.api import ACCEPTED, load_draft, speculative_generate
from bloombee.speculative.draft import DraftModel

logger = logging.getLogger(__name__)


@dataclass
class _ActiveSession:
    """The session one thread (or asyncio task) generates through, and where its current generate() call began."""

    session: InferenceSession
    base: int = 0  # session position where the current generate() call's input_ids start
    pending_ids: torch.Tensor | None = None  # last generated tokens, not yet run through the blocks
    rows: torch.Tensor | None = None  # the ids of the current generate() call's last step, row by row


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose blocks run in the swarm; `generate()` takes transformers' usual arguments.

    Inside `with model.inference_session(max_length=...)`, successive `generate()` calls continue
    the same sequence: each call's inputs are appended after what the session already holds.
    The active session belongs to the calling thread (or asyncio task): several threads can generate
    through one model object at once, each in its own session.
    """

    config_class = PretrainedConfig
    main_input_name = "input_ids"
    _supports_cache_class = False
    _release: weakref.finalize | None = None  # frees the DHT peer from_pretrained started: on close() or when dropped

    def __init__(self, config: PretrainedConfig, head: torch.nn.Module, remote: RemoteSequential,
                 prompt_tuning: PromptTuning | None = None):
        super().__init__(config)
        self.head, self.remote, self.prompt_tuning = head, remote, prompt_tuning
        self._drafts = threading.local()  # default draft models by name, one copy per thread
        self._active: contextvars.ContextVar[_ActiveSession | None] = contextvars.ContextVar(f"bloombee_session_{id(self)}",
                                                                                          default=None)

    @classmethod
    def from_pretrained(cls, model: str, initial_peers: Sequence[str] = (), *, dht=None, dtype="auto", device="cpu",
                        allowed_servers: list[str] | None = None, blocked_servers: list[str] | None = None,
                        tuning_mode: str | None = None, pre_seq_len: int = 0,
                        **settings) -> "DistributedModelForCausalLM":
        """Load the client's part of `model` (folder, hub id or alias) and join the swarm at `initial_peers`; with
        `tuning_mode` ("ptune" or "deep_ptune", bloombee.client.prompt_tuning), `pre_seq_len` trainable prompt
        tokens."""
        path = resolve_model(model)
        config = load_model_config(path)
        config.name_or_path = str(path)  # so that AutoTokenizer.from_pretrained(model.name_or_path) finds the files
        head = load_client_head(path, dtype, device)
        client_settings = load_settings(ClientSettings, settings)
        if client_settings.batch_invariant == "on":
            make_batch_invariant(head, head.dtype, head.device, row_range(head, head.dtype, head.device))
        owned = dht is None
        if owned:
            dht = start_dht(initial_peers, client_mode=True, connect_timeout=client_settings.connect_timeout)
        try:
            remote = RemoteSequential(dht, dht_prefix(model), config, client_settings, str(model), allowed_servers,
                                      blocked_servers)
        except BaseException:
            if owned:
                dht.shutdown()
            raise
        tuning = None
        if tuning_mode is not None:
            tuning = PromptTuning(tuning_mode, pre_seq_len, config.num_hidden_layers, config.hidden_size,
                                  float(head.embed_tokens.weight.float().std()), head.dtype).to(head.device)
        instance = cls(config, head, remote, tuning)
        if owned:
            instance._release = weakref.finalize(instance, release, dht, remote.p2p)
        if (path / "generation_config.json").exists():
            instance.generation_config = GenerationConfig.from_pretrained(path)
        return instance.eval()

    def close(self) -> None:
        """Free the DHT peer and p2p daemon from_pretrained started for this model (a `dht` passed in stays up)."""
        if self._release is not None:
            self._release()

    def __enter__(self) -> "DistributedModelForCausalLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def _session(self) -> InferenceSession | None:
        """The calling thread's (or task's) active session."""
        active = self._active.get()
        return active.session if active is not None else None

    @contextlib.contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1) -> Iterator[InferenceSession]:
        """Keep one session (and the servers' KV caches) across several generate() calls of this thread."""
        if self._active.get() is not None:
            raise RuntimeError("an inference session is already active on this model in this thread")
        tuning = self.prompt_tuning
        prefix = tuning.pre_seq_len if tuning is not None else 0
        deep = tuning.deep.detach() if tuning is not None and tuning.deep is not None else None
        with self.remote.inference_session(max_length + prefix, batch_size, deep) as session:
            token = self._active.set(_ActiveSession(session))
            try:
                yield session
            finally:
                self._active.reset(token)

    @torch.inference_mode()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' generate(), run through a session (the active one, or one opened for this call); with
        `draft_model=` (or `assistant_model=`, or the draft_model setting) speculative, in a session of its own
        (bloombee.speculative); `draft_model="none"` decodes plainly."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids")
        draft = kwargs.pop("draft_model", None) or kwargs.pop("assistant_model", None)
        if self.prompt_tuning is not None:
            return self._generate_tuned(input_ids, draft, *args, **kwargs)
        if draft is None:
            draft = self._default_draft(args, kwargs)
        elif isinstance(draft, str) and draft == "none":
            draft = None
        elif args or self._active.get() is not None:
            raise ValueError("speculative generation takes keyword arguments only and opens its own session: "
                             "call it outside `with model.inference_session(...)`")
        if draft is not None:
            return speculative_generate(self, input_ids, draft, **kwargs)
        return self._generate_plain(input_ids, *args, **kwargs)

    def _generate_plain(self, input_ids: torch.Tensor, *args, **kwargs):
        """transformers' generate() in the active session, or in one opened for this call."""
        kwargs["use_cache"] = False
        if self._active.get() is None:
            new_tokens = kwargs.get("max_new_tokens") or (self.generation_config.max_new_tokens or 0)
            max_length = input_ids.shape[1] + new_tokens if new_tokens else kwargs.get("max_length", self.generation_config.max_length)
            with self.inference_session(max_length=max_length, batch_size=input_ids.shape[0] * self._rows_per_input(kwargs)):
                return self._generate_in_session(input_ids, *args, **kwargs)
        return self._generate_in_session(input_ids, *args, **kwargs)

    def _generate_tuned(self, input_ids: torch.Tensor, draft, *args, **kwargs):
        """generate() after the tuned prompts, decoding plainly (a draft model knows no prompts)."""
        if draft is not None and draft != "none":
            raise ValueError("speculative generation does not know a prompt-tuned model's prompts: pass "
                             "draft_model='none' or no draft_model")
        return self._generate_plain(input_ids, *args, **kwargs)

    def settings_draft(self) -> DraftModel | None:
        """The draft model the draft_model setting names (auto: the one the model's generation config names, if
        any); this thread's copy, loaded once."""
        name = self.remote.settings.draft_model
        if name == "auto":
            name = getattr(self.generation_config, "bloombee_draft_model", None)
        if not name or name == "none":
            return None
        drafts = self._drafts.__dict__
        if name not in drafts:
            drafts[name] = load_draft(name, self)
        return drafts[name]

    def _default_draft(self, args: tuple, kwargs: dict) -> DraftModel | None:
        """The settings' draft, for a call speculation can run: no active session, only arguments it takes."""
        if args or self._active.get() is not None or set(kwargs) - ACCEPTED or (kwargs.get("num_beams") or 1) > 1:
            return None
        return self.settings_draft()

    def _rows_per_input(self, kwargs: dict) -> int:
        """Rows generate() runs per input row: its beams, else its sampled return sequences."""
        beams = kwargs.get("num_beams") or self.generation_config.num_beams or 1
        return beams if beams > 1 else kwargs.get("num_return_sequences") or self.generation_config.num_return_sequences or 1

    def _generate_in_session(self, input_ids: torch.Tensor, *args, **kwargs):
        active = self._active.get()
        active.rows = None
        if active.pending_ids is not None:
            input_ids = torch.cat([active.pending_ids, input_ids], dim=1)
            if kwargs.get("attention_mask") is not None:
                ones = torch.ones_like(active.pending_ids, dtype=kwargs["attention_mask"].dtype)
                kwargs["attention_mask"] = torch.cat([ones, kwargs["attention_mask"]], dim=1)
        active.base = active.session.position
        output = super().generate(input_ids, *args, **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        active.pending_ids = sequences[:, -1:]
        return output

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                                      logits_to_keep: int = 0, **kwargs):
        """The full ids each step: forward() sends only the tokens the session has not seen."""
        return {"input_ids": input_ids, "attention_mask": attention_mask, "logits_to_keep": logits_to_keep}

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """Logits of `input_ids` (in the active session: of the ids it has not seen), and with `labels` the causal LM
        loss over them, as transformers computes it; differentiable through the swarm outside a session. With
        `logits_to_keep` k > 0, of the last k positions only (transformers' generate() asks for 1: a long prompt's
        other positions would cost the client their share of the LM head for nothing)."""
        active = self._active.get()
        if active is None:
            logits = self._stateless_logits(input_ids, attention_mask, logits_to_keep)
            loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                                  vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if labels is not None:
            raise ValueError("labels are for training, outside an inference session")
        seen = active.session.position - active.base
        if active.rows is not None and seen:
            hypotheses = continued_rows(active.rows, input_ids)
            if hypotheses is not None:
                active.session.reorder(hypotheses)
        active.rows = input_ids
        new_ids = input_ids[:, seen:]
        token_mask = attention_mask[:, seen:] if attention_mask is not None else None
        embeds, prefix = self.head.embed(new_ids), 0
        if self.prompt_tuning is not None and active.session.position == 0:
            embeds, token_mask = self.prompt_tuning.prepend(embeds, token_mask)
            prefix = self.prompt_tuning.pre_seq_len
        hidden = active.session.step(embeds, token_mask)[:, prefix:]
        active.base += prefix
        hidden = _last_positions(hidden, logits_to_keep)
        return CausalLMOutputWithPast(logits=self.head.logits(hidden.to(self.head_dtype)))

    def _stateless_logits(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None,
                          logits_to_keep: int = 0) -> torch.Tensor:
        """Logits of whole sequences (of their last `logits_to_keep` positions where that is above 0) through the
        swarm without a session, after the tuned prompts if any."""
        embeds = self.head.embed(input_ids)
        if self.prompt_tuning is None:
            return self.head.logits(_last_positions(self.remote.forward(embeds, attention_mask), logits_to_keep))
        embeds, attention_mask = self.prompt_tuning.prepend(embeds, attention_mask)
        hidden = self.remote.forward(embeds, attention_mask, self.prompt_tuning.deep_prompts(len(input_ids)))
        return self.head.logits(_last_positions(hidden[:, self.prompt_tuning.pre_seq_len:], logits_to_keep))

    @property
    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype


def _last_positions(hidden: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Positions [batch, T, ...] of `hidden` the logits are asked for: the last `logits_to_keep`, or all for 0 (as
    transformers reads it)."""
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden


def continued_rows(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor | None:
    """For each row of `current` (generate()'s ids now), the row of `previous` (its ids at the last step) it
    continues, itself where it can; None when every row continues itself. Beam search reorders rows this way."""
    prefix = current[:, :previous.shape[1]]
    same = (prefix[:, None, :] == previous[None, :, :]).all(-1)  # [row now, row before]
    if not bool(same.any(1).all()):
        raise ValueError("generate()'s input_ids no longer continue the rows this session computed")
    own = torch.arange(len(prefix))
    rows = torch.where(same[own, own], own, same.to(torch.int8).argmax(1))
    return None if torch.equal(rows, own) else rows


AutoDistributedModelForCausalLM = DistributedModelForCausalLM
AutoDistributedModel = DistributedModelForCausalLM
