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
    max_chunk_tokens: int = Field(2048, ge=1, description="most tokens (rows x positions) one step of consecutive "
                                  "tokens may carry: clients send longer prompts as chunks of this size, and other "
                                  "sessions' steps take turns with them")
    max_batch_rows: int = Field(256, ge=1, description="most rows (sequences, tree rows) of all sessions' steps one "
                                "forward computes together (1: each step alone, no batching across sessions)")
    max_batch_tokens: int = Field(4096, ge=1, description="most tokens (rows x positions) of all sessions' steps one "
                                  "forward computes together; a larger step still runs, alone")
    batch_wait_ms: float = Field(0.0, ge=0, description="milliseconds a forward may wait for a step of each "
                                 "session of the last two forwards that no other server computes and of each session "
                                 "just opened, so that they share it (0: a forward takes the steps ready when the "
                                 "device is free)")
    batch_invariant: Literal["auto", "on", "off"] = Field("auto", description="make a session's outputs independent "
                                                          "of what shares its forwards: on (matmuls in row counts "
                                                          "this device rounds alike, measured at start, and a "
                                                          "speculative tree's nodes attended one at a time, so that "
                                                          "they equal plain decoding), off, or auto (the matmul part "
                                                          "only, where it slows neither a batch-1 decode step "
                                                          "nor a 128-token prompt by over 10%%, measured at "
                                                          "start)")
    cache_tokens: int = Field(16384, ge=1, description="batch x length tokens of sessions the server expects at once: "
                              "--offload auto keeps this much KV cache in device memory if it can")
    device_memory: str = Field("auto", description="device memory for weights, KV cache and workspace, e.g. 20GiB, "
                               "512MiB, 24GB (auto: 90%% of a GPU; on a CPU the host budget)")
    host_memory: str = Field("auto", description="host memory for offloaded KV cache and session history, e.g. 64GiB "
                             "(auto: 80%% of the memory available at start-up)")
    offload: Literal["auto"] | float = Field("auto", description="fraction of each block's KV cache kept in host "
                                             "memory, 0..1 (auto: the smallest that fits the blocks and --cache-tokens "
                                             "in --device-memory)")
    alloc_timeout: float = Field(5.0, ge=0, description="seconds a new session may wait in line for memory before "
                                 "it is refused")
    session_timeout: float = Field(300.0, gt=0, description="seconds a session may stay idle before its cache is freed")
    push_buffer_bytes: int = Field(32 << 20, ge=1, description="bytes a session may queue for the next server "
                                   "before its pipeline waits (back-pressure)")
    adapters: tuple[str, ...] = Field((), description="LoRA adapters to serve with the blocks: peft folders or hub "
                                      "ids (comma-separated in BLOOMBEE_ADAPTERS); a client picks one by the same name "
                                      "with active_adapter")
    kept_forward_bytes: int = Field(256 << 20, ge=1, description="bytes of training clients' span inputs the "
                                    "server keeps at once for their backward")
    kept_forward_timeout: float = Field(120.0, gt=0, description="seconds a forward kept for a backward waits for it "
                                        "before it is forgotten")
    announce_period: float = Field(5.0, gt=0, description="seconds between checks of the DHT record: announced when "
                                   "what clients route on moved, and every 2 periods regardless")
    rebalance_period: float = Field(60.0, gt=0, description="seconds between checks whether other blocks need us more")
    balance_quality: float = Field(1.25, ge=1.0, description="move to other blocks only if swarm throughput grows by this factor")
    compression: Literal["auto", "on", "off"] = Field("auto", description="compress activations on each hop: auto (when "
                                                      "it saves time on that link), on or off")
    quant_type: str = Field("auto", description="precision of the blocks' linear weights: none (--dtype), int8 "
                            "(LLM.int8, ~0.25x float32's bytes) or nf4 (QLoRA 4-bit, ~0.13x); computed in --dtype. "
                            "auto: nf4 on CUDA, as Petals loads by default (about 4x the blocks of float16 per GPU, so "
                            "fewer servers and hops in a chain); none on a CPU, which then computes exactly what "
                            "transformers does (int8 and nf4 are faster there only with AVX-512)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus metrics on this TCP port "
                                     "(/metrics; unset: not served)")
    metrics_host: str = Field("127.0.0.1", description="address the metrics port listens on")
    num_threads: int = Field(0, ge=0, description="torch threads for compute; 0 = one per core (bloombee's local swarms "
                             "and tests pass 1 per server so that several servers on one machine do not oversubscribe it)")
    connect_timeout: float = Field(30.0, gt=0, description="seconds to start the DHT peer and join the swarm")
    announce_timeout: float = Field(5.0, gt=0, description="seconds one DHT announcement may take")
    push_timeout: float = Field(10.0, gt=0, description="seconds a step pushed to the next server may wait for its "
                                "acknowledgement past when its bytes should have arrived over the link (or for room in "
                                "the push buffer) before the push counts as failed")


    @field_validator("adapters", mode="before")
    @classmethod
    def _names(cls, value):
        return tuple(part.strip() for part in value.split(",") if part.strip()) if isinstance(value, str) else value

    @field_validator("device_memory", "host_memory")
    @classmethod
    def _memory_size(cls, value: str) -> str:
        if value != "auto":
            from bloombee.server.memory import parse_bytes

            parse_bytes(value)
        return value

    @field_validator("quant_type")
    @classmethod
    def _quant_type(cls, value: str) -> str:
        if value != "auto":
            from bloombee.weight_formats import parse_quant_type

            parse_quant_type(value)
        return value

    @field_validator("offload")
    @classmethod
    def _fraction(cls, value):
        if value != "auto" and not 0.0 <= value <= 1.0:
            raise ValueError("offload must be auto or a fraction from 0 to 1")
        return value


class ClientSettings(BaseModel):
    """Timeouts and routing preferences of one client process."""

    model_config = ConfigDict(extra="forbid")

    request_timeout: float = Field(60.0, gt=0, description="longest wait for any one reply (info, forward, a step)")
    connect_timeout: float = Field(30.0, gt=0, description="seconds to start the DHT peer and join the swarm")
    open_timeout: float = Field(10.0, gt=0, description="seconds to open a session on one server")
    shared_streams: Literal["on", "off"] = Field("on", description="on: carry all of this client's sessions on a "
                                                 "server over one stream where the server announces shared_streams, "
                                                 "what is ready at once as one message; off: a stream per session")
    step_timeout_min: float = Field(4.0, gt=0, description="a step (or a replay, or a history fetch) fails after "
                                    "max(this, step_timeout_factor x its expected time) seconds")
    step_timeout_factor: float = Field(3.0, ge=1.0, description="safety factor over a step's expected time (the "
                                       "session's recent steps of that size, else the servers' announced figures)")
    update_period: float = Field(15.0, gt=0, description="seconds between refreshes of the swarm view")
    ban_base_seconds: float = Field(5.0, gt=0, description="first ban of a failing server; doubles on each new failure")
    ban_max_seconds: float = Field(300.0, gt=0, description="longest ban of a failing server, seconds")
    max_retries: int = Field(5, ge=0, description="times one step is re-routed after server failures")
    quant_types: str = Field("none,int8,nf4", description="weight precisions of the servers this client routes "
                             "through, comma-separated (a server announces its own): leave out int8 or nf4 to use "
                             "full-precision servers only")
    hop_penalty_seconds: float = Field(0.02, ge=0, description="extra cost per hop, to prefer shorter chains")
    link_bandwidth_mbps: float = Field(100.0, gt=0, description="this machine's link speed, Mbit/s")
    compression: Literal["auto", "on", "off"] = Field("auto", description="compress activations on each hop: auto (when "
                                                      "it saves time on that link), on or off")
    micro_batches: Literal["auto"] | int = Field("auto", description="micro-batches per step: auto (the planner's "
                                                 "model of the chain decides) or a count; 1 = off")
    draft_model: str = Field("auto", description="draft model for speculative decoding: auto (the one the model's "
                             "generation config names as bloombee_draft_model, if any: bloombee-tiny names "
                             "bloombee-tiny-draft), none, or a model name, folder or hub id")
    speculation: Literal["auto", "on", "off"] = Field("auto", description="with a draft model: speculate in every "
                                                      "round (on), never (off), or while it is faster than plain "
                                                      "decoding on the measured links (auto: the break-even bandwidth)")
    draft_widths: str = Field("2,2,1,1", description="the draft tree's width at each depth, comma-separated: depth d "
                              "holds w0*...*wd nodes (2,2,1,1: 15 in all), the most probable paths when greedy, "
                              "w_d children per node when sampling")
    prune_tau: float = Field(0.3, ge=0.0, description="the first server drops draft-tree candidates whose keep score "
                             "is below this, with their descendants (0 = no pruning; greedy decoding only)")
    batch_invariant: Literal["on", "off"] = Field("off", description="on: compute the LM head in the matmul sizes "
                                                  "from which this device rounds a row alike whatever rows share "
                                                  "them (measured when the model loads: a few seconds for a large "
                                                  "vocabulary on a CPU), so that with servers in --batch-invariant "
                                                  "on a speculative tree's tokens equal plain decoding's")
    active_adapter: str | None = Field(None, description="the LoRA adapter this client's sessions and forwards "
                                       "compute, by the name its servers were given with --adapters; only servers "
                                       "holding it are routed to (unset: the base model)")
    verify_probability: float = Field(0.0, ge=0.0, le=1.0, description="verify untrusted servers: with this "
                                      "probability per step, and always at a server's first step in a session, "
                                      "recompute each span's output on another server holding its blocks and ban "
                                      "servers that disagree (0 = off)")
    verify_seed: int | None = Field(None, description="seed of the random choice of verified steps and verifiers "
                                    "(unset: unseeded)")

    @field_validator("quant_types", mode="before")
    @classmethod
    def _quant_types(cls, value) -> str:
        from bloombee.weight_formats import parse_quant_types

        return ",".join(parse_quant_types(value))

    @property
    def accepted_quant_types(self) -> tuple[str, ...]:
        """quant_types as a tuple."""
        return tuple(self.quant_types.split(","))

    @field_validator("draft_widths")
    @classmethod
    def _widths(cls, value: str) -> str:
        parts = [part.strip() for part in value.split(",") if part.strip()]
        if not all(part.isdigit() and int(part) >= 1 for part in parts):
            raise ValueError(f"draft_widths must be whole numbers of at least 1, comma-separated, got {value!r}")
        return ",".join(parts)

    @property
    def widths(self) -> tuple[int, ...]:
        """draft_widths as numbers."""
        return tuple(int(part) for part in self.draft_widths.split(",") if part)

    @field_validator("micro_batches")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value < 1:
            raise ValueError("micro_batches must be auto or a count of at least 1")
        return value


class ApiSettings(BaseModel):
    """Limits of one `bloombee-api` process: how it shares the swarm between HTTP requests."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port to listen on (0: any free port)")
    max_sessions: int = Field(4, ge=1, description="inference sessions open in the swarm at once")
    max_queue: int = Field(32, ge=1, description="requests waiting for a session before new ones get HTTP 429")
    max_batch_rows: int = Field(8, ge=1, description="rows (prompts x choices) one batched session carries")
    batch_window_ms: float = Field(20.0, ge=0, description="milliseconds a request waits for others to share its session")
    max_tokens: int = Field(2048, ge=1, description="most new tokens one request may ask for")
    default_max_tokens: int = Field(256, ge=1, description="new tokens of a request that sets no max_tokens")
    status_refresh_seconds: float = Field(5.0, gt=0, description="how often /status reloads itself, seconds")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus metrics on this TCP port "
                                     "(/metrics; unset: not served)")
    metrics_host: str = Field("127.0.0.1", description="address the metrics port listens on")


def load_settings(cls: type[SettingsT], overrides: dict[str, Any] | None = None) -> SettingsT:
    """Build settings from defaults, then `BLOOMBEE_<FIELD>` environment variables, then explicit overrides."""
    values: dict[str, Any] = {}
    for name in cls.model_fields:
        env_value = os.environ.get(ENV_PREFIX + name.upper())
        if env_value is not None:
            values[name] = env_value
    values.update({key: value for key, value in (overrides or {}).items() if value is not None})
    return cls(**values)
