"""LoRA adapters served with the blocks, in peft's format and computed by peft's layers; one chosen per session.

`--adapters NAME ...` (a folder or hub id each, as `PeftModel.from_pretrained` takes) loads every adapter's LoRA
weights for the hosted blocks into the stack with peft's `inject_adapter_in_model`, checkpoint names mapped to the
stack's modules as the base weights are. A session, or a stateless forward, names its adapter (or none); a forward
computes steps of one adapter, which `active` switches every LoRA layer to for the forward (a lock keeps a forward
on the event loop and one in the compute thread from switching under each other).
"""

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

import torch

from bloombee.models.core.stack import BlockStack
from bloombee.protocol import InvalidStep

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the base model's tensor names


class AdapterError(ValueError):
    """An adapter that cannot be served with these blocks: not LoRA, or not of this model."""


class Adapters:
    """The adapters loaded into one stack, by the name the server was given; the one its LoRA layers compute."""

    def __init__(self, stack: BlockStack, names: list[str]):
        self.stack = stack
        self._internal = {name: f"adapter{index}" for index, name in enumerate(names)}  # peft needs names without dots
        for name in names:
            self._load(name)
        self._current: str | None = None  # loading leaves every adapter enabled: switched before each forward
        self._lock = threading.Lock()
        if names:
            self._use(None, force=True)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._internal)

    def check(self, name: str | None) -> None:
        """InvalidStep unless this server holds adapter `name` (None: the base model)."""
        if name is not None and name not in self._internal:
            held = ", ".join(self._internal) or "none"
            raise InvalidStep(f"this server does not hold adapter {name!r} (it holds: {held})")

    @contextlib.contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """While inside, the blocks compute adapter `name` (None: the base model)."""
        self.check(name)
        if not self._internal:
            yield
            return
        with self._lock:
            self._use(name)
            yield

    def _use(self, name: str | None, force: bool = False) -> None:
        """Make every LoRA layer compute adapter `name` (None: none, the base model)."""
        from peft.tuners.lora import LoraLayer  # peft loads bitsandbytes: only on servers given adapters

        if name == self._current and not force:
            return
        for module in self.stack.modules():
            if isinstance(module, LoraLayer):
                module.enable_adapters(name is not None)
                if name is not None:
                    module.set_adapter(self._internal[name])
        self._current = name

    def _load(self, name: str) -> None:
        from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
        from peft.utils import load_peft_weights

        config = PeftConfig.from_pretrained(name)
        if config.peft_type != "LORA":
            raise AdapterError(f"adapter {name!r} is {config.peft_type}; servers serve LoRA adapters")
        state = self._block_state(name, load_peft_weights(name, device=str(self.stack.device)))
        if not state:
            logger.warning("Adapter %s has no weights for blocks [%d, %d)", name, self.stack.start, self.stack.end)
            return
        targets = sorted({key.rsplit(".lora_", 1)[0] for key in state})
        config.target_modules, config.inference_mode = targets, True
        with warnings.catch_warnings():  # peft warns that a second adapter joins the first: that is the intent
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            inject_adapter_in_model(config, self.stack, adapter_name=self._internal[name])
        loaded = set_peft_model_state_dict(self.stack, state, adapter_name=self._internal[name])
        missing = [key for key in loaded.missing_keys if self._internal[name] in key]
        if loaded.unexpected_keys or missing:
            raise AdapterError(f"adapter {name!r} does not fit these blocks: {(loaded.unexpected_keys or missing)[:4]}")
        self.stack.to(self.stack.device).requires_grad_(False)
        logger.info("Loaded adapter %s (LoRA r=%d on %d layers of blocks [%d, %d))", name, config.r, len(targets),
                    self.stack.start, self.stack.end)

    def _block_state(self, name: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter's tensors of the hosted blocks, by the stack's module names (lora_A.weight, lora_B.weight)."""
        family, state = self.stack.family, {}
        for key, tensor in weights.items():
            checkpoint_name = key.removeprefix(PEFT_PREFIX)
            for index in range(self.stack.start, self.stack.end):
                local = family.block_tensor_name(checkpoint_name, index)
                if local is not None:
                    state[f"blocks.{index - self.stack.start}.{local}"] = tensor.to(self.stack.dtype)
        return state
