"""`AutoDistributedModelForCausalLM`: local embeddings and LM head, remote blocks, transformers' generate()."""

import contextlib
import logging
from typing import Iterator, Sequence

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from bloombee.client.remote import RemoteSequential
from bloombee.client.session import InferenceSession
from bloombee.dht.peers import start_dht
from bloombee.loading import dht_prefix, load_client_head, load_model_config, resolve_model
from bloombee.settings import ClientSettings, load_settings

logger = logging.getLogger(__name__)


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose blocks run in the swarm; `generate()` takes transformers' usual arguments.

    Inside `with model.inference_session(max_length=...)`, successive `generate()` calls continue
    the same sequence: each call's inputs are appended after what the session already holds.
    """

    config_class = PretrainedConfig
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: PretrainedConfig, head: torch.nn.Module, remote: RemoteSequential):
        super().__init__(config)
        self.head, self.remote = head, remote
        self._session: InferenceSession | None = None
        self._session_base = 0  # session position where the current generate() call's input_ids start
        self._pending_ids: torch.Tensor | None = None  # last generated tokens, not yet run through the blocks

    @classmethod
    def from_pretrained(cls, model: str, initial_peers: Sequence[str] = (), *, dht=None, dtype="auto", device="cpu",
                        allowed_servers: list[str] | None = None, blocked_servers: list[str] | None = None,
                        **settings) -> "DistributedModelForCausalLM":
        """Load the client's part of `model` (folder, hub id or alias) and join the swarm at `initial_peers`."""
        path = resolve_model(model)
        config = load_model_config(path)
        config.name_or_path = str(path)  # so that AutoTokenizer.from_pretrained(model.name_or_path) finds the files
        head = load_client_head(path, dtype, device)
        if dht is None:
            dht = start_dht(initial_peers, client_mode=True)
        client_settings = load_settings(ClientSettings, settings)
        remote = RemoteSequential(dht, dht_prefix(model), config, client_settings, str(model), allowed_servers,
                                  blocked_servers)
        instance = cls(config, head, remote)
        if (path / "generation_config.json").exists():
            instance.generation_config = GenerationConfig.from_pretrained(path)
        return instance.eval()

    @contextlib.contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1) -> Iterator[InferenceSession]:
        """Keep one session (and the servers' KV caches) across several generate() calls."""
        if self._session is not None:
            raise RuntimeError("an inference session is already active on this model")
        with self.remote.inference_session(max_length, batch_size) as session:
            self._session, self._pending_ids = session, None
            try:
                yield session
            finally:
                self._session, self._pending_ids = None, None

    @torch.inference_mode()
    def generate(self, inputs: torch.Tensor | None = None, *args, **kwargs):
        """transformers' generate(), run through a session (the active one, or one opened for this call)."""
        input_ids = inputs if inputs is not None else kwargs.pop("input_ids")
        kwargs["use_cache"] = False
        if self._session is None:
            new_tokens = kwargs.get("max_new_tokens") or (self.generation_config.max_new_tokens or 0)
            max_length = input_ids.shape[1] + new_tokens if new_tokens else kwargs.get("max_length", self.generation_config.max_length)
            with self.inference_session(max_length=max_length, batch_size=input_ids.shape[0]):
                return self._generate_in_session(input_ids, *args, **kwargs)
        return self._generate_in_session(input_ids, *args, **kwargs)

    def _generate_in_session(self, input_ids: torch.Tensor, *args, **kwargs):
        if self._pending_ids is not None:
            input_ids = torch.cat([self._pending_ids, input_ids], dim=1)
            if kwargs.get("attention_mask") is not None:
                ones = torch.ones_like(self._pending_ids, dtype=kwargs["attention_mask"].dtype)
                kwargs["attention_mask"] = torch.cat([ones, kwargs["attention_mask"]], dim=1)
        self._session_base = self._session.position
        output = super().generate(input_ids, *args, **kwargs)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        self._pending_ids = sequences[:, -1:]
        return output

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """The full ids each step: forward() sends only the tokens the session has not seen."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        if self._session is None:
            hidden = self.remote.forward(self.head.embed(input_ids), attention_mask)
            return CausalLMOutputWithPast(logits=self.head.logits(hidden))
        seen = self._session.position - self._session_base
        new_ids = input_ids[:, seen:]
        token_mask = attention_mask[:, seen:] if attention_mask is not None else None
        hidden = self._session.step(self.head.embed(new_ids), token_mask)
        return CausalLMOutputWithPast(logits=self.head.logits(hidden.to(self.head_dtype)))

    @property
    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype


AutoDistributedModelForCausalLM = DistributedModelForCausalLM
AutoDistributedModel = DistributedModelForCausalLM
