"""The DHT record a server announces for each block it hosts, and reading the swarm's records back."""

import logging
from collections import Counter
from enum import Enum
from typing import Any

import hivemind
from hivemind.dht.node import DHTNode
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bloombee.dht.security import owner_peer_id
from bloombee.planner.inputs import NodeProfile
from bloombee.weight_formats import QuantType

logger = logging.getLogger(__name__)


class ServerState(str, Enum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


class ServerRecord(BaseModel):
    """What a server says about itself, once per hosted block, under the key `{prefix}.{block}`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    start_block: int = Field(ge=0)
    end_block: int = Field(gt=0)
    throughput: float = Field(ge=0, description="decode steps per second through one block at batch 1")
    row_seconds: float | None = Field(None, ge=0, description="seconds one more row adds to a decode forward through "
                                      "one block, measured at start (the server batches sessions' steps; None: unknown)")
    busy_vectors: float = Field(0.0, ge=0, description="mean vectors (rows x positions) of this server's recent "
                                "forwards: the load a new step would be batched with")
    link_bandwidth: float = Field(gt=0, description="estimated link bandwidth, bytes per second")
    cache_tokens_left: int = Field(ge=0, description="batch x length tokens of a session over all hosted blocks that fit now")
    offload: float = Field(0.0, ge=0, le=1, description="fraction of each block's KV heads sessions keep in host memory")
    device_memory_bytes: int = Field(0, ge=0, description="device memory for sessions, the weights already in")
    host_memory_bytes: int = Field(0, ge=0, description="host memory for offloaded KV cache and session history")
    device_free_bytes: int = Field(0, ge=0)
    host_free_bytes: int = Field(0, ge=0)
    device_bytes_per_token: int = Field(0, ge=0, description="device bytes one token of a session over all hosted "
                                        "blocks takes (its batch x max_length tokens are allocated when it opens)")
    host_bytes_per_token: int = Field(0, ge=0, description="host bytes of the same: offloaded KV, history, token mask")
    dtype: str
    quant_type: QuantType = Field("none", description="precision of the blocks' linear weights (compute is in dtype)")
    weight_bytes: int = Field(0, ge=0, description="bytes of the hosted blocks' weights on the device, scales included")
    device: str
    version: str
    public_name: str = ""
    codec_version: int = Field(0, description="bloombee.codec frame version this server reads and writes; 0: unknown")
    codecs: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    adapters: tuple[str, ...] = Field((), description="LoRA adapters a session may compute, by the names the server "
                                      "was given (--adapters)")
    maddrs: tuple[str, ...] = ()
    profile: NodeProfile | None = Field(None, description="planner node measured by its profile: memory, cost table, link, codec")
    max_length: int | None = Field(None, ge=1, description="longest session (prompt + generated positions) this "
                                   "server opens (None: not announced)")
    max_chunk_tokens: int | None = Field(None, ge=1, description="most tokens (rows x positions) one step of "
                                         "consecutive tokens may carry (None: no limit announced)")
    planned_batch_size: int | None = Field(None, ge=1, description="batch size B of the plan this server follows")
    planned_micro_batches: int | None = Field(None, ge=1, description="micro-batches M that plan chose for B")

    @model_validator(mode="after")
    def _check_range(self) -> "ServerRecord":
        if self.end_block <= self.start_block:
            raise ValueError(f"end_block {self.end_block} must exceed start_block {self.start_block}")
        return self


MODELS_KEY = "bloombee_models"  # the swarm's directory of served models, one subkey per server (its owner marker)


class ModelEntry(BaseModel):
    """What a server says about the model it serves."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, description="the name the server was started with: alias, hub id or folder")
    num_blocks: int = Field(gt=0)


class ModelListing(ModelEntry):
    """A ModelEntry as stored under MODELS_KEY, with the server's owner marker as subkey."""

    prefix: str = Field(min_length=1, description="the model's DHT prefix: its block keys are `{prefix}.{block}`")


RECORD_SCHEMAS = (ServerRecord, ModelListing)  # what a DHT value may be (bloombee.dht.security)


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.{block}"


def announce(dht: hivemind.DHT, prefix: str, record: ServerRecord, expiration_time: float,
             timeout: float | None = None) -> None:
    """Store the record, signed, under every hosted block's key with this peer's owner marker as the subkey
    (TimeoutError after `timeout` seconds)."""
    keys = [block_key(prefix, block) for block in range(record.start_block, record.end_block)]
    store = _StoreRecords(keys, dht.owner_subkey, record.model_dump(mode="json"), expiration_time)
    dht.run_coroutine(store, return_future=True).result(timeout)


def announce_model(dht: hivemind.DHT, prefix: str, entry: ModelEntry, expiration_time: float,
                   timeout: float | None = None) -> None:
    """List the model in the swarm's directory, signed, under this peer's owner marker (TimeoutError after
    `timeout` seconds)."""
    listing = ModelListing(prefix=prefix, **entry.model_dump())
    store = _StoreRecords([MODELS_KEY], dht.owner_subkey, listing.model_dump(mode="json"), expiration_time)
    dht.run_coroutine(store, return_future=True).result(timeout)


def fetch_models(dht: hivemind.DHT) -> dict[str, ModelEntry]:
    """The swarm's served models by DHT prefix (where servers disagree on one, what most of them say);
    malformed entries are logged and skipped."""
    votes: dict[str, Counter[ModelEntry]] = {}
    for owner, value in dht.run_coroutine(_GetRecords([MODELS_KEY])).get(MODELS_KEY, {}).items():
        try:
            listing = ModelListing.model_validate(value)
        except ValidationError as error:
            logger.warning("Ignoring malformed model entry from %s: %s", owner_peer_id(owner), error.errors()[0]["msg"])
            continue
        votes.setdefault(listing.prefix, Counter())[ModelEntry(model=listing.model, num_blocks=listing.num_blocks)] += 1
    return {prefix: counter.most_common(1)[0][0] for prefix, counter in votes.items()}


class _StoreRecords:
    """Picklable coroutine that runs inside the DHT process and stores one record under many keys."""

    def __init__(self, keys: list[str], subkey: bytes, value: dict[str, Any], expiration_time: float):
        self.keys, self.subkey, self.value, self.expiration_time = keys, subkey, value, expiration_time

    async def __call__(self, dht: hivemind.DHT, node: DHTNode) -> None:
        results = await node.store_many(
            keys=self.keys,
            values=[self.value] * len(self.keys),
            expiration_time=self.expiration_time,
            subkeys=[self.subkey] * len(self.keys),
        )
        failed = [key for key, stored in results.items() if not stored]
        if failed:
            logging.getLogger(__name__).warning("DHT refused records for %s", failed)


class _GetRecords:
    """Picklable coroutine that fetches the raw subkey dictionaries of many keys."""

    def __init__(self, keys: list[str]):
        self.keys = keys

    async def __call__(self, dht: hivemind.DHT, node: DHTNode) -> dict[str, dict[str, Any]]:
        # latest: merge the subkeys (servers) of every replica reached, not only the first unexpired copy
        found = await node.get_many(self.keys, sufficient_expiration_time=float("inf"), return_futures=False)
        raw: dict[str, dict[str, Any]] = {}
        for key, item in found.items():
            if item is not None and isinstance(item.value, dict):
                raw[key] = {subkey: entry.value for subkey, entry in item.value.items()}
        return raw


def fetch_records(dht: hivemind.DHT, prefix: str, num_blocks: int) -> list[dict[str, ServerRecord]]:
    """For each block 0..num_blocks-1, the valid records keyed by the peer id of the key that signed them (the
    DHT node has checked signatures, size and schema); malformed records are skipped."""
    keys = [block_key(prefix, block) for block in range(num_blocks)]
    raw = dht.run_coroutine(_GetRecords(keys))
    per_block: list[dict[str, ServerRecord]] = []
    for block, key in enumerate(keys):
        records: dict[str, ServerRecord] = {}
        for owner, value in raw.get(key, {}).items():
            peer_id = owner_peer_id(owner)  # the DHT node accepts owned subkeys only
            record = parse_record(value, key, peer_id)
            if record is not None and record.start_block <= block < record.end_block:
                records[peer_id] = record
        per_block.append(records)
    return per_block


def parse_record(value: Any, key: str, peer_id: Any) -> ServerRecord | None:
    """Validate one raw value; a malformed record is logged and ignored."""
    try:
        return ServerRecord.model_validate(value)
    except ValidationError as error:
        logger.warning("Ignoring malformed record under %s from %s: %s", key, peer_id, error.errors()[0]["msg"])
        return None
