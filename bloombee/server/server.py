"""A block server process: load blocks, serve them over hivemind P2P, announce them in the DHT."""

import asyncio
import logging
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hivemind
import torch
import yaml
from hivemind.utils import get_dht_time

import bloombee
from bloombee import codec
from bloombee.dht.records import ModelEntry, ServerRecord, ServerState, announce, announce_model, fetch_records
from bloombee.loading import dht_prefix, load_block_stack, load_model_config, resolve_model
from bloombee.loading.weights import resolve_dtype
from bloombee.models.core.quantize import checkpoint_quant_type, resolve_quant_type
from bloombee.planner.costs import offload_fraction
from bloombee.models.core.invariance import make_batch_invariant
from bloombee.models.core.packing import KEY_GRANULE
from bloombee.protocol import announced_features
from bloombee.speculative.pruning import TreePruner
from bloombee.server.announcing import EXPIRY_PERIODS, room_moved, why_announce
from bloombee.server.backend import BlockBackend
from bloombee.server.block_selection import block_coverage, choose_start_block, should_move
from bloombee.server.handler import BlockServicer
from bloombee.server.metrics import ServerMetrics
from bloombee.server.profile import cached_profile, measure_profile
from bloombee.server.memory import (
    CUDA_RESERVED,
    MemoryBudget,
    SessionBytes,
    WeightsDoNotFit,
    blocks_that_fit,
    default_budgets,
    format_bytes,
)
from bloombee.server.sessions import SessionRegistry
from bloombee.server.throughput import (INVARIANCE_COST, block_throughput_meter, invariance_slowdown,
                                        measured_row_range)
from bloombee.settings import ServerSettings
from bloombee.weight_formats import QuantType

logger = logging.getLogger(__name__)

MIN_ANNOUNCE_GAP = 1.0  # seconds between two checks of the record when sessions come and go
WARM_ROWS = 16  # decode steps of up to this many rows are warmed up at start (BlockBackend.warm_up)


@dataclass
class BlockChoice:
    """Which blocks to serve: an explicit range, or how many blocks to place where the swarm is weakest."""

    start: int | None = None
    end: int | None = None
    num_blocks: int | None = None


class Server:
    """Owns one DHT peer, one block range and the servicer; `run()` serves until `stop()` or a signal."""

    def __init__(self, model: str, dht: hivemind.DHT, blocks: BlockChoice, settings: ServerSettings,
                 device: str = "cpu", dtype: str = "auto", public_name: str = "", link_bandwidth: float = 12.5e6,
                 profile: bool = True, profile_path: str | None = None, planned: tuple[int, int] | None = None,
                 planned_offload: float | None = None, quant_type: QuantType | None = None):
        self.model_path = resolve_model(model)
        self.config = load_model_config(self.model_path)
        self.model_name, self.prefix = model, dht_prefix(model)
        self.total_blocks = self.config.num_hidden_layers
        self.dht, self.settings, self.blocks = dht, settings, blocks
        self.device, self.dtype_name = torch.device(device), dtype
        self.public_name, self.link_bandwidth = public_name, link_bandwidth
        self.planned = planned  # (B, M) of the plan this server follows
        self.planned_offload = planned_offload  # that plan's alpha for this node
        self.quant_type = quant_type or resolve_quant_type(settings.quant_type, self.device,
                                                           checkpoint_quant_type(self.config))
        self.memory = default_budgets(self.device, settings.device_memory, settings.host_memory)
        self.state = ServerState.JOINING
        self._stop = asyncio.Event()
        self._sessions_changed = asyncio.Event()
        self._announced: ServerRecord | None = None  # the record last announced, and when (time.monotonic())
        self._announced_at = 0.0
        self.backend = self._load(*self._initial_range())
        self.registry = SessionRegistry(self._session_budget(), self._sessions_changed.set)
        self.profile = self._profile(Path(profile_path) if profile_path else None) if profile or profile_path else None
        self.metrics = ServerMetrics(self.registry)
        self.servicer = BlockServicer(self.backend, self.registry, settings, self.info, link_bandwidth, self.meter,
                                      self.metrics)

    def _initial_range(self) -> tuple[int, int]:
        if self.blocks.start is not None and self.blocks.end is not None:
            if not 0 <= self.blocks.start < self.blocks.end <= self.total_blocks:
                raise ValueError(f"--blocks {self.blocks.start}:{self.blocks.end} is outside the model's "
                                 f"{self.total_blocks} blocks; use START:END with 0 <= START < END <= {self.total_blocks}")
            return self.blocks.start, self.blocks.end
        num_blocks = min(self.blocks.num_blocks or self._blocks_that_fit(), self.total_blocks)
        coverage = block_coverage(fetch_records(self.dht, self.prefix, self.total_blocks))
        start = choose_start_block(coverage, num_blocks)
        logger.info("Chose blocks [%d, %d) where the swarm is weakest (coverage %s)", start, start + num_blocks, coverage)
        return start, start + num_blocks

    def _dtype_setting(self) -> torch.dtype | str:
        """--dtype as the loader takes it: "auto" (the checkpoint's) or a torch dtype."""
        return self.dtype_name if self.dtype_name == "auto" else getattr(torch, self.dtype_name)

    def _blocks_that_fit(self) -> int:
        """As many blocks as --device-memory holds with their weights in this server's precision and a KV cache of
        --cache-tokens tokens each (all of the model's when they fit)."""
        dtype = resolve_dtype(self._dtype_setting(), self.config)
        room = self.memory[0] - (CUDA_RESERVED if self.device.type == "cuda" else 0)
        return blocks_that_fit(self.config, dtype, self.quant_type, room, self.settings.cache_tokens)

    def _cache_key(self, start: int, end: int, dtype: torch.dtype) -> str:
        """What a measured figure of this server depends on: model, blocks, device, dtype and weight precision."""
        return f"{self.prefix}|{start}:{end}|{self.device.type}|{dtype}|{self.quant_type}"

    def _load(self, start: int, end: int) -> BlockBackend:
        stack = load_block_stack(self.model_path, start, end, dtype=self._dtype_setting(), device=self.device,
                                 quant_type=self.quant_type)
        backend = BlockBackend(stack, self.device, stack.dtype,
                               pruner=TreePruner.load(self.model_path, end, device=self.device),
                               adapters=self.settings.adapters)
        backend.offload = self._offload(backend)
        backend.max_chunk_tokens = self.settings.max_chunk_tokens
        backend.batch_invariant, backend.exact_trees = self._make_batch_invariant(
            backend, self._cache_key(start, end, backend.dtype))
        self.meter = block_throughput_meter(backend, self._cache_key(start, end, backend.dtype))
        warm_rows = min(WARM_ROWS, self.settings.max_batch_rows)
        began = time.perf_counter()
        backend.warm_up(warm_rows)
        logger.info("Warmed up decode steps of 1 to %d rows in %.0f ms", warm_rows, 1e3 * (time.perf_counter() - began))
        logger.info("Loaded blocks [%d, %d) of %s on %s as %s with %s weights (%s), %.0f%% of the KV cache in host "
                    "memory", start, end, self.model_path, self.device, backend.dtype, self.quant_type,
                    format_bytes(backend.weight_bytes), 100 * backend.offload)
        return backend

    def _make_batch_invariant(self, backend: BlockBackend, key: str) -> tuple[bool, bool]:
        """--batch-invariant: whether the blocks' matmuls were made to round a row alike whatever rows share them
        (on; auto: where that slows neither a batch-1 decode step nor a prompt by more than INVARIANCE_COST), and
        whether a tree's nodes are attended one at a time (on only: it costs a tree step 2-3x on a CPU,
        benchmarks/README.md)."""
        setting, stack = self.settings.batch_invariant, backend.stack
        if setting == "off":
            return False, False
        chunks = measured_row_range(backend, key)
        if chunks is not None and setting == "auto":
            slowdown = invariance_slowdown(backend, chunks, key)
            if slowdown > 1 + INVARIANCE_COST:
                logger.info("Not batch-invariant: chunked matmuls would slow a decode step or a prompt %.2fx here "
                            "(--batch-invariant on to have it anyway)", slowdown)
                return False, False
        trees = setting == "on"
        invariant = make_batch_invariant(stack, stack.dtype, self.device, chunks, trees)
        return invariant, invariant and trees

    def _room_for_sessions(self, backend: BlockBackend) -> int:
        """Device bytes left for sessions once the weights (and on CUDA its context and workspace) are in."""
        weights = backend.weight_bytes
        room = self.memory[0] - weights - (CUDA_RESERVED if self.device.type == "cuda" else 0)
        if room <= 0:
            raise WeightsDoNotFit(f"blocks [{backend.start}, {backend.end}) take {format_bytes(weights)} of weights, more "
                             f"than --device-memory {format_bytes(self.memory[0])} leaves room for; serve fewer blocks "
                             f"or give more device memory")
        return room

    def _offload(self, backend: BlockBackend) -> float:
        """--offload, else the plan's alpha, else the planner's rule: the smallest fraction of the KV cache of
        --cache-tokens tokens that leaves the rest room on the device."""
        if self.settings.offload != "auto":
            return float(self.settings.offload)
        if self.planned_offload is not None:
            return self.planned_offload
        full = backend.session_bytes(backend.start, backend.end, 1, self.settings.cache_tokens, offload=0.0)
        kv_heads = backend.stack.block_configs[0].cache_layout[0]
        return float(offload_fraction(self._room_for_sessions(backend), full.device, kv_heads))

    def _session_budget(self) -> MemoryBudget:
        return MemoryBudget(self._room_for_sessions(self.backend), self.memory[1], self.device.type)

    def _profile(self, path: Path | None) -> dict:
        """This server's planner node (measured once per model, range, device and dtype, then cached), for the DHT
        record; written to `path` (YAML) when given."""
        name = self.public_name or self.dht.peer_id.to_base58()
        key = self._cache_key(self.backend.start, self.backend.end, self.backend.dtype)
        node = cached_profile(key, lambda: measure_profile(self.backend), name, self.link_bandwidth * 8 / 1e6,
                              self.device, self.memory, self.quant_type)
        if path is None:
            return node
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"nodes": [node]}, sort_keys=False))
        logger.info("Wrote the planner profile of this server to %s", path)
        return node

    def record(self) -> ServerRecord:
        return ServerRecord(
            state=self.state,
            start_block=self.backend.start,
            end_block=self.backend.end,
            throughput=self.meter.value, row_seconds=self.meter.row_seconds, busy_vectors=self.meter.busy_vectors,
            link_bandwidth=self.link_bandwidth,
            cache_tokens_left=self._tokens_left(),
            offload=self.backend.offload,
            device_memory_bytes=self.registry.budget.total.device,
            host_memory_bytes=self.registry.budget.total.host,
            device_free_bytes=self.registry.budget.free.device,
            host_free_bytes=self.registry.budget.free.host,
            device_bytes_per_token=self._token_bytes().device,
            host_bytes_per_token=self._token_bytes().host,
            dtype=str(self.backend.dtype).removeprefix("torch."),
            quant_type=self.quant_type,
            weight_bytes=self.backend.weight_bytes,
            device=self.device.type,
            version=bloombee.__version__,
            public_name=self.public_name,
            codec_version=codec.CODEC_VERSION,
            codecs=codec.LAYOUTS,
            features=announced_features(pruner=self.backend.pruner is not None,
                                        batch_invariant=self.backend.batch_invariant,
                                        exact_trees=self.backend.exact_trees),
            adapters=self.backend.adapters.names,
            maddrs=tuple(str(maddr) for maddr in self.dht.get_visible_maddrs()),
            profile=self.profile,
            max_length=self.settings.max_length,
            max_chunk_tokens=self.settings.max_chunk_tokens,
            planned_batch_size=self.planned[0] if self.planned else None,
            planned_micro_batches=self.planned[1] if self.planned else None,
        )

    def _token_bytes(self) -> SessionBytes:
        """What one token of a session over all hosted blocks takes: a granule-long session's bytes per token (a KV
        cache holds whole granules of slots, core.packing)."""
        whole = self.backend.session_bytes(self.backend.start, self.backend.end, 1, KEY_GRANULE)
        return SessionBytes(whole.device // KEY_GRANULE, whole.host // KEY_GRANULE)

    def _tokens_left(self) -> int:
        """Batch x length tokens of a session over all hosted blocks that still fit in the free memory."""
        one, free = self._token_bytes(), self.registry.budget.free
        return int(min(free.device // one.device if one.device else free.host // one.host, free.host // one.host))

    def info(self) -> dict:
        return {**self.record().model_dump(mode="json"), "peer_id": self.dht.peer_id.to_base58(),
                "open_sessions": len(self.registry), "total_blocks": self.total_blocks, "prefix": self.prefix,
                "links": self.servicer.link_reports(), "push_buffer_bytes": self.settings.push_buffer_bytes,
                "push": asdict(self.servicer.push_stats),
                "forwards": {"count": self.servicer.batcher.forwards, "steps": self.servicer.batcher.steps,
                             "seconds": self.servicer.batcher.forward_seconds},
                "kept_forwards": {"count": len(self.servicer.kept_forwards), "bytes": self.servicer.kept_forwards.nbytes}}

    def _announce(self, record: ServerRecord | None = None) -> None:
        if not self.dht.is_alive():
            raise RuntimeError("the server's DHT process has ended; cannot announce")
        expiration = get_dht_time() + EXPIRY_PERIODS * self.settings.announce_period
        record = self.record() if record is None else record
        announce(self.dht, self.prefix, record, expiration, self.settings.announce_timeout)
        self._announced, self._announced_at = record, time.monotonic()
        announce_model(self.dht, self.prefix, ModelEntry(model=self.model_name, num_blocks=self.total_blocks), expiration,
                       self.settings.announce_timeout)

    def _announce_if_due(self) -> None:
        """Announce the record if clients would route differently on it than on the last one, or its refresh is due."""
        record = self.record()
        reason = why_announce(self._announced, record,
                              (time.monotonic() - self._announced_at) / self.settings.announce_period)
        if reason is not None:
            logger.debug("Announcing the record: %s", reason)
            self._announce(record)

    def _announce_offline(self) -> bool:
        """The last announcement; a failure is logged, since the server stops either way."""
        self.state = ServerState.OFFLINE
        try:
            self._announce()
        except Exception as error:
            logger.warning("Could not announce offline (%s: %s); the record expires by itself", type(error).__name__, error)
            return False
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        p2p = await self.dht.replicate_p2p()
        await self.servicer.start(p2p)
        if self.settings.metrics_port is not None:
            self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port)
            logger.info("Serving metrics on http://%s:%d/metrics", self.settings.metrics_host, self.settings.metrics_port)
        self.state = ServerState.ONLINE
        logger.info("Serving blocks [%d, %d) of %s as %s", self.backend.start, self.backend.end, self.prefix, self.dht.peer_id)
        try:
            await self._maintain()
        finally:
            announced = await loop.run_in_executor(None, self._announce_offline)
            self.meter.save()
            await self.servicer.batcher.close()
            self.servicer.compute.shutdown(wait=False)
            logger.info("Announced offline and stopped" if announced else "Stopped without announcing offline")

    async def _maintain(self) -> None:
        """Check the record every announce_period, and sooner when sessions move the cache room, announcing it when
        due (`announcing`); look for a better range every rebalance_period when serving no one."""
        loop = asyncio.get_running_loop()
        rebalanced_at = time.monotonic()
        while not self._stop.is_set():
            self._sessions_changed.clear()
            try:
                await loop.run_in_executor(None, self._announce_if_due)
            except TimeoutError:
                logger.warning("An announcement took over %g s; trying again in %g s",
                               self.settings.announce_timeout, self.settings.announce_period)
            await self._until_next_check()
            if self.blocks.start is None and time.monotonic() - rebalanced_at >= self.settings.rebalance_period:
                rebalanced_at = time.monotonic()
                await loop.run_in_executor(None, self._maybe_rebalance)

    async def _until_next_check(self) -> None:
        """Wait announce_period, or until the stop or until sessions opening or closing moved the cache room by more
        than `announcing.ROOM_CHANGE` (but at least MIN_ANNOUNCE_GAP seconds, so that the free memory clients route on
        is fresh without flooding the DHT)."""
        began = time.monotonic()
        deadline = began + self.settings.announce_period
        while not self._stop.is_set() and time.monotonic() < deadline:
            waits = [asyncio.create_task(self._stop.wait()), asyncio.create_task(self._sessions_changed.wait())]
            await asyncio.wait(waits, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            if self._sessions_changed.is_set():
                self._sessions_changed.clear()
                if room_moved(self._announced.cache_tokens_left if self._announced else 0, self._tokens_left()):
                    break
        gap = min(MIN_ANNOUNCE_GAP, self.settings.announce_period) - (time.monotonic() - began)
        if gap > 0 and not self._stop.is_set():
            await asyncio.sleep(gap)

    def _maybe_rebalance(self) -> None:
        if len(self.registry):
            return
        records = fetch_records(self.dht, self.prefix, self.total_blocks)
        coverage = block_coverage(records, exclude_peer=self.dht.peer_id.to_base58())
        start = should_move(coverage, self.backend.start, self.backend.end, self.meter.value, self.settings.balance_quality)
        if start is None or len(self.registry):
            return
        num_blocks = self.backend.end - self.backend.start
        logger.info("Moving from blocks [%d, %d) to [%d, %d) to balance the swarm", self.backend.start, self.backend.end, start, start + num_blocks)
        self.state = ServerState.OFFLINE
        self._announce()
        self.meter.save()
        self.backend = self.servicer.backend = self._load(start, start + num_blocks)
        self.servicer.meter = self.meter
        self.registry.budget = self._session_budget()
        self.state = ServerState.ONLINE
        self._announce()
