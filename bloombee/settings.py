"""One settings object per process: defaults here, overridable by environment variable and by flag."""

import os
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENV_PREFIX = "BLOOMBEE_"

SettingsT = TypeVar("SettingsT", bound=BaseModel)


class ServerSettings(BaseModel):
    """Limits and periods of one block server; each field is also `--flag` and `BLOOMBEE_FIELD`."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(32, ge=1, description="largest batch one inference session may open")
    max_length: int = Field(4096, ge=1, description="longest sequence (prompt + generated) one session may open")
    cache_tokens: int = Field(65536, ge=1, description="KV-cache budget of the server in batch x length tokens")
    session_timeout: float = Field(300.0, gt=0, description="seconds a session may stay idle before its cache is freed")
    push_buffer_bytes: int = Field(32 << 20, ge=1, description="bytes a session may queue for the next server "
                                   "before its pipeline waits (back-pressure)")
    announce_period: float = Field(5.0, gt=0, description="seconds between DHT announcements")
    rebalance_period: float = Field(60.0, gt=0, description="seconds between checks whether other blocks need us more")
    balance_quality: float = Field(1.25, ge=1.0, description="move to other blocks only if swarm throughput grows by this factor")
    compression: Literal["auto", "on", "off"] = "auto"


class ClientSettings(BaseModel):
    """Timeouts and routing preferences of one client process."""

    model_config = ConfigDict(extra="forbid")

    request_timeout: float = Field(60.0, gt=0, description="seconds to wait for one step through the whole chain")
    update_period: float = Field(15.0, gt=0, description="seconds between refreshes of the swarm view")
    ban_base_seconds: float = Field(5.0, gt=0, description="first ban of a failing server; doubles on each new failure")
    ban_max_seconds: float = Field(300.0, gt=0)
    max_retries: int = Field(5, ge=0, description="times one step is re-routed after server failures")
    hop_penalty_seconds: float = Field(0.02, ge=0, description="extra cost per hop, to prefer shorter chains")
    link_bandwidth_mbps: float = Field(100.0, gt=0, description="this machine's link speed, Mbit/s")
    compression: Literal["auto", "on", "off"] = "auto"
    micro_batches: Literal["auto"] | int = Field("auto", description="micro-batches per step: auto (the planner's "
                                                 "model of the chain decides) or a count; 1 = off")

    @field_validator("micro_batches")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value < 1:
            raise ValueError("micro_batches must be auto or a count of at least 1")
        return value


def load_settings(cls: type[SettingsT], overrides: dict[str, Any] | None = None) -> SettingsT:
    """Build settings from defaults, then `BLOOMBEE_<FIELD>` environment variables, then explicit overrides."""
    values: dict[str, Any] = {}
    for name in cls.model_fields:
        env_value = os.environ.get(ENV_PREFIX + name.upper())
        if env_value is not None:
            values[name] = env_value
    values.update({key: value for key, value in (overrides or {}).items() if value is not None})
    return cls(**values)
