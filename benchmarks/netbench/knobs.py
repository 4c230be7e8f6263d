"""Optimisation switches and the configurations a sweep compares.

Each optimisation that exists in the product is one line of ``OPTIMISATIONS``: the server flags
and client settings that switch it on and off. A configuration is a set of them switched on,
all others off:

- ``baseline``: everything off;
- ``all`` (alias ``best``): everything on;
- ``compression`` (or ``a+b`` for several): just those on;
- ``name:VALUE`` sets a valued optimisation's setting (``micro_batching:8``, ``micro_batching:auto``,
  ``offload:0.5``, ``quant:int8``); a configuration with an ``auto`` value of an optimisation that reads the link
  speed depends on the links (its nodes advertise their speed): ``offload:auto`` and ``quant:auto`` do not (the
  server's memory budget and its device decide them);
- ``auto``: no flags at all, the product's own defaults (compression ``auto``: the break-even
  rule; micro-batches ``auto``: the planner's model of the chain; both from the link speed each
  node advertises).

A ``passive`` optimisation passes no flag where a configuration does not name it (the product's
default): ``offload`` auto only acts under a ``--device-memory`` budget, which sweeps do not set, so
the product's default offloads nothing there and ``offload`` named alone keeps half of the KV heads in
host memory. ``quant`` not named passes no ``--quant-type`` either (the product's default, auto: nf4 on CUDA,
none on a CPU); named alone it keeps the servers' blocks in nf4, ``quant:int8`` / ``quant:none`` fix the
precision. Every optimisation changes what a sweep runs: its servers' flags, its client's settings,
or (``speculative``) the client's path, ``model.generate`` instead of the step loop
(``worker.speculates``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bloombee.weight_formats import QUANT_TYPES


@dataclass(frozen=True)
class Optimisation:
    name: str
    doc: str
    server_on: tuple[str, ...]
    server_off: tuple[str, ...]
    client_on: Mapping[str, Any] = field(default_factory=dict)
    client_off: Mapping[str, Any] = field(default_factory=dict)
    value_setting: str | None = None  # the client setting that `name:VALUE` sets (valued optimisations)
    value_flag: str | None = None  # the server flag that `name:VALUE` sets instead of server_on
    value_type: type = int
    passive: bool = False  # not named: no flag at all (the product's default) rather than server_off
    choices: tuple[str, ...] = ()  # the values `name:VALUE` may take besides auto (any of value_type where empty)
    link_sensitive: bool = True  # whether its auto value reads the link speed the nodes advertise


OPTIMISATIONS: dict[str, Optimisation] = {opt.name: opt for opt in (
    Optimisation("compression", "lossless byte-split zstd codec on every hop (the client's session mode reaches every server)",
                 (), (), {"compression": "on"}, {"compression": "off"}),
    Optimisation("micro_batching", "steps split into micro-batches that pipeline along the chain",
                 (), (), {"micro_batches": 4}, {"micro_batches": 1}, value_setting="micro_batches"),
    Optimisation("speculative", "draft-tree speculative decoding with the model's draft (bloombee-tiny-draft for "
                 "bloombee-tiny), pruned at the first server; auto = only while faster than plain decoding (S > S*); "
                 "runs through model.generate, the path that speculates, instead of the step loop",
                 (), (), {"speculation": "on"}, {"speculation": "off"}, value_setting="speculation", value_type=str),
    Optimisation("offload", "a share of each block's KV heads in host memory, attended where they lie: half by default; "
                 "offload:F sets the fraction, offload:auto the planner's smallest alpha that fits --cache-tokens in "
                 "--device-memory (0 without that budget)", ("--offload", "0.5"), ("--offload", "0"),
                 value_flag="--offload", value_type=float, passive=True, link_sensitive=False),
    Optimisation("quant", "the servers' blocks kept in int8 or nf4 (bitsandbytes; compute in --dtype), so that a "
                 "--device-memory budget holds more blocks per server: fewer servers and hops; nf4 by default, quant:none|"
                 "int8|nf4 fixes it, quant:auto the product's rule (nf4 on CUDA, none on a CPU)",
                 ("--quant-type", "nf4"), ("--quant-type", "none"), value_flag="--quant-type", value_type=str,
                 passive=True, choices=QUANT_TYPES, link_sensitive=False),
)}


@dataclass(frozen=True)
class Configuration:
    name: str
    enabled: frozenset[str] = frozenset()
    auto: bool = False  # the product's defaults: no switches passed at all
    values: tuple[tuple[str, Any], ...] = ()  # (optimisation, value) given as name:VALUE

    @property
    def bandwidth_sensitive(self) -> bool:
        """Whether the servers' advertised link speed changes behaviour (then servers restart per environment)."""
        return self.auto or any(value == "auto" and OPTIMISATIONS[name].link_sensitive for name, value in self.values)

    def server_args(self) -> list[str]:
        if self.auto:
            return []
        args: list[str] = []
        values = dict(self.values)
        for name, opt in OPTIMISATIONS.items():
            if name in values and opt.value_flag:
                args.extend((opt.value_flag, str(values[name])))
            elif name in self.enabled:
                args.extend(opt.server_on)
            elif not opt.passive:
                args.extend(opt.server_off)
        return args

    def client_settings(self) -> dict[str, Any]:
        if self.auto:
            return {}
        settings: dict[str, Any] = {}
        for name, opt in OPTIMISATIONS.items():
            settings.update(opt.client_on if name in self.enabled else opt.client_off)
        for name, value in self.values:
            if OPTIMISATIONS[name].value_setting:
                settings[OPTIMISATIONS[name].value_setting] = value
        return settings

    def to_dict(self) -> dict:
        return {"name": self.name, "enabled": sorted(self.enabled), "auto": self.auto,
                "server_args": self.server_args(), "client_settings": self.client_settings()}


def parse_configuration(text: str) -> Configuration:
    text = text.strip()
    lower = text.lower()
    if lower == "baseline":
        return Configuration("baseline")
    if lower in ("all", "best"):
        return Configuration(lower, frozenset(OPTIMISATIONS))
    if lower == "auto":
        return Configuration("auto", auto=True)
    parts = [part.strip() for part in text.split("+") if part.strip()]
    names = [part.split(":", 1)[0] for part in parts]
    unknown = [name for name in names if name not in OPTIMISATIONS]
    if not names or unknown:
        raise ValueError(f"unknown configuration {text!r}: use baseline, all, auto, or optimisations joined by '+' "
                         f"from: {', '.join(OPTIMISATIONS)}")
    values = tuple((name, _value(name, part.split(":", 1)[1])) for name, part in zip(names, parts) if ":" in part)
    return Configuration("+".join(parts), frozenset(names), values=values)


def _value(name: str, text: str) -> Any:
    opt = OPTIMISATIONS[name]
    if opt.value_setting is None and opt.value_flag is None:
        raise ValueError(f"optimisation {name!r} takes no value (got {name}:{text})")
    if text == "auto":
        return text
    if opt.choices and text not in opt.choices:
        raise ValueError(f"{name}:{text}: the value must be auto or one of {', '.join(opt.choices)}")
    try:
        return opt.value_type(text)
    except ValueError:
        kind = "a whole number" if opt.value_type is int else "a number"
        raise ValueError(f"{name}:{text}: the value must be auto or {kind}") from None


def parse_configurations(text: str) -> list[Configuration]:
    result = [parse_configuration(part) for part in text.split(",") if part.strip()]
    if not result:
        raise ValueError("no configuration given")
    names = [config.name for config in result]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration listed twice: {names}")
    return result
