"""The planner's input file: a pydantic model of the model, the workload, the client and the nodes.

Units are in the field names: memory in GiB (``*_gib``), model sizes in bytes, times in
milliseconds (``*_ms``), network bandwidth in megabits per second (``*_mbps``, 1 Mbps = 1e6 bit/s)
and codec speeds in megabytes per second (``*_mb_per_s``, 1 MB = 1e6 bytes, raw bytes in or out).

Every model forbids unknown keys, so a typo is reported with the field's path
(``nodes.2.link.uplink_mbs: Extra inputs are not permitted``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bloombee.weight_formats import QUANT_TYPES, QuantType, linear_weight_bytes

GIB = float(1 << 30)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CLIENT = "client"


class PlanInputError(ValueError):
    """The input file (or the overrides given with it) does not describe a valid planning problem.

    The message names every offending field by its path, e.g. ``nodes[1].gpu_memory_gib``.
    """


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------- model


class ModelSpec(_Strict):
    """The transformer's shapes as the planner needs them.

    Either give the byte figures directly or the shapes they follow from; sizes in bytes use the
    workload's dtype. ``bloombee-plan --model`` fills this section from a model config. Quantised
    weights (int8, nf4) shrink only the blocks' nn.Linear weights: planning them needs
    ``linear_params_per_block`` (and, for int8's per-row scales, ``linear_rows_per_block``).
    """

    name: str = "model"
    num_blocks: int = Field(ge=1, description="L, the number of transformer blocks")
    hidden_size: int = Field(ge=1, description="H")
    params_per_block: int | None = Field(None, ge=1, description="parameters of one block (x dtype size = weight bytes)")
    weight_bytes_per_block: int | None = Field(None, ge=1, description="overrides params_per_block x dtype size")
    linear_params_per_block: int | None = Field(
        None, ge=0, description="weights of the block's nn.Linear layers (the part int8 / nf4 shrink; biases and norms "
        "stay in the dtype)"
    )
    linear_rows_per_block: int | None = Field(None, ge=0, description="output rows of those layers (int8's scales)")
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    kv_bytes_per_token_per_block: int | None = Field(
        None, ge=1, description="overrides 2 x num_key_value_heads x head_dim x dtype size"
    )
    activation_bytes_per_token: int | None = Field(None, ge=1, description="default hidden_size x dtype size")
    intermediate_size: int | None = Field(None, ge=1, description="MLP width, for the default workspace")
    workspace_bytes_per_token: int | None = Field(
        None, ge=0, description="GPU activation workspace per sequence of a micro-batch; default (4H + 2I) x dtype size"
    )

    @model_validator(mode="after")
    def _enough_to_size_a_block(self) -> "ModelSpec":
        if self.params_per_block is None and self.weight_bytes_per_block is None:
            raise ValueError("params_per_block: give params_per_block or weight_bytes_per_block")
        if self.kv_bytes_per_token_per_block is None and (self.num_key_value_heads is None or self.head_dim is None):
            raise ValueError(
                "kv_bytes_per_token_per_block: give kv_bytes_per_token_per_block "
                "or both num_key_value_heads and head_dim"
            )
        if (self.linear_params_per_block is not None and self.params_per_block is not None
                and self.linear_params_per_block > self.params_per_block):
            raise ValueError("linear_params_per_block: exceeds params_per_block")
        return self

    def weight_bytes(self, dtype: str, quant: QuantType = "none") -> float:
        """Bytes of one block's weights on the device, its nn.Linear weights kept in `quant`."""
        dense = _given_or_sized(self.weight_bytes_per_block, (self.params_per_block,), dtype)
        if quant == "none":
            return dense
        problem = self.quant_problem(dtype, quant)
        if problem:
            raise PlanInputError(problem)
        linear, dtype_bytes = self.linear_params_per_block, DTYPE_BYTES[dtype]
        quantised = linear_weight_bytes(linear, self.linear_rows_per_block or 0, quant, dtype_bytes)
        return dense - linear * dtype_bytes + quantised

    def quant_problem(self, dtype: str, quant: QuantType) -> str:
        """Why this section cannot size blocks kept in `quant` ('' if it can)."""
        if quant == "none":
            return ""
        if self.linear_params_per_block is None:
            return (f"model.linear_params_per_block: the model section needs linear_params_per_block (the weights of a "
                    f"block's nn.Linear layers) to plan quantised ({quant}) nodes; --model fills it")
        if quant == "int8" and self.linear_rows_per_block is None:
            return ("model.linear_rows_per_block: the model section needs linear_rows_per_block (the output rows of a "
                    "block's nn.Linear layers, one int8 scale each) to plan int8 nodes; --model fills it")
        dense = _given_or_sized(self.weight_bytes_per_block, (self.params_per_block,), dtype)
        if self.linear_params_per_block * DTYPE_BYTES[dtype] > dense:
            return (f"model.linear_params_per_block: {self.linear_params_per_block} weights of {dtype} exceed the "
                    f"block's {dense:.0f} bytes of weights")
        return ""

    def kv_bytes_per_token(self, dtype: str) -> float:
        return _given_or_sized(self.kv_bytes_per_token_per_block, (2, self.num_key_value_heads, self.head_dim), dtype)

    def activation_bytes(self, dtype: str) -> float:
        return _given_or_sized(self.activation_bytes_per_token, (self.hidden_size,), dtype)

    def workspace_bytes(self, dtype: str) -> float:
        intermediate = self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size
        return _given_or_sized(self.workspace_bytes_per_token, (4 * self.hidden_size + 2 * intermediate,), dtype)


def _given_or_sized(given: int | None, factors: tuple[int | None, ...], dtype: str) -> float:
    """``given`` bytes if set, else as many values of ``dtype`` as the product of ``factors``."""
    return float(given) if given is not None else float(math.prod(factors) * DTYPE_BYTES[dtype])


# ------------------------------------------------------------------------------------------ workload


class WorkloadSpec(_Strict):
    batch_sizes: list[int] = Field(default_factory=lambda: [8, 16, 32, 64], min_length=1)
    micro_batches: list[int] = Field(default_factory=lambda: [1, 2, 4, 8], min_length=1)
    seq_len: int = Field(128, ge=1, description="context length s (prompt + generated) the KV cache is sized for")
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    compression: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: compress a hop where it pays; on: wherever both ends have a codec; off: never"
    )
    quant: list[QuantType] = Field(
        default_factory=lambda: ["none"], min_length=1,
        description="weight precisions the planner may give a node (a node's fixed quant_type wins)"
    )

    @field_validator("batch_sizes", "micro_batches")
    @classmethod
    def _positive_unique(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("every entry must be >= 1")
        return sorted(set(values))

    @field_validator("quant")
    @classmethod
    def _known_order(cls, values: list[QuantType]) -> list[QuantType]:
        """Without repeats, most precise first (the order ties between precisions go by)."""
        return [quant for quant in QUANT_TYPES if quant in values]


# ----------------------------------------------------------------------------------------- cost model


class CostTable(_Strict):
    """Per-block times measured at a few micro-batch sizes; interpolated piecewise-linearly.

    Below the smallest measured size the first entry is used (smaller micro-batches are not
    assumed faster); above the largest the last two points are extended linearly.
    """

    micro_batch: list[float] = Field(min_length=1)
    mlp_ms: list[float]
    attn_gpu_ms: list[float]
    attn_cpu_ms: list[float]

    @model_validator(mode="after")
    def _same_lengths(self) -> "CostTable":
        sizes = self.micro_batch
        if any(b <= 0 for b in sizes) or any(b2 <= b1 for b1, b2 in zip(sizes, sizes[1:])):
            raise ValueError("micro_batch: sizes must be positive and strictly increasing")
        for name in ("mlp_ms", "attn_gpu_ms", "attn_cpu_ms"):
            values = getattr(self, name)
            if len(values) != len(sizes):
                raise ValueError(f"{name}: has {len(values)} entries, micro_batch has {len(sizes)}")
            if any(v < 0 for v in values):
                raise ValueError(f"{name}: times must be >= 0")
        return self


class CostCoefficients(_Strict):
    """Per-block times as polynomials in the micro-batch size b: t(b) = c0 + c1*b + c2*b^2 + ... (ms)."""

    mlp_ms: list[float] = Field(min_length=1)
    attn_gpu_ms: list[float] = Field(min_length=1)
    attn_cpu_ms: list[float] = Field(min_length=1)


class BlockCost(_Strict):
    """The profiled cost of one block on this node.

    ``mlp_ms`` is everything that stays on the GPU whatever the KV placement (projections, MLP,
    norms); ``attn_gpu_ms`` / ``attn_cpu_ms`` is attention over the KV cache when the cache is on
    the GPU / in host memory. Give exactly one of ``table`` and ``coefficients``. If
    ``reference_seq_len`` is set the attention times were measured at that context length and are
    scaled linearly to the workload's ``seq_len``; otherwise they are taken as measured at it. A
    time that comes out negative (a polynomial, an extrapolated table) counts as zero.
    """

    table: CostTable | None = None
    coefficients: CostCoefficients | None = None
    reference_seq_len: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> "BlockCost":
        if (self.table is None) == (self.coefficients is None):
            raise ValueError("give exactly one of table and coefficients")
        return self


# ----------------------------------------------------------------------------------------- network


class LinkSpec(_Strict):
    """A machine's access link. A hop src -> dst (without an override) has bandwidth
    min(src.uplink, dst.downlink) and latency src.latency + dst.latency."""

    uplink_mbps: float = Field(gt=0)
    downlink_mbps: float = Field(gt=0)
    latency_ms: float = Field(0.0, ge=0)


class CompressionSpec(_Strict):
    """The activation codec on this machine: ratio r (raw/compressed) and its speeds in raw bytes."""

    ratio: float = Field(gt=0)
    compress_mb_per_s: float = Field(gt=0)
    decompress_mb_per_s: float = Field(gt=0)
    call_ms: float = Field(0.0, ge=0, description="CPU time of one encode and one decode beyond their bytes")


class LinkOverride(_Strict):
    """One measured hop; what it gives replaces the value derived from the two access links."""

    src: str
    dst: str
    bandwidth_mbps: float | None = Field(None, gt=0)
    latency_ms: float | None = Field(None, ge=0)


class LinkMatrix(_Strict):
    """Pairwise overrides as matrices (row = sender, column = receiver), like the paper's Table 3.

    ``null`` (or the diagonal) keeps the value derived from the access links.
    """

    names: list[str] = Field(min_length=1)
    bandwidth_mbps: list[list[float | None]] | None = None
    latency_ms: list[list[float | None]] | None = None

    @model_validator(mode="after")
    def _square(self) -> "LinkMatrix":
        n = len(self.names)
        if len(set(self.names)) != n:
            raise ValueError("names: duplicate names")
        for field in ("bandwidth_mbps", "latency_ms"):
            matrix = getattr(self, field)
            if matrix is None:
                continue
            if len(matrix) != n or any(len(row) != n for row in matrix):
                raise ValueError(f"{field}: must be a {n} x {n} matrix (one row and column per name)")
            for i, row in enumerate(matrix):
                for j, value in enumerate(row):
                    if value is None or i == j:
                        continue
                    if field == "bandwidth_mbps" and value <= 0:
                        raise ValueError(f"{field}[{i}][{j}]: bandwidth must be > 0")
                    if field == "latency_ms" and value < 0:
                        raise ValueError(f"{field}[{i}][{j}]: latency must be >= 0")
        return self


# ------------------------------------------------------------------------------------------- nodes


class CpuShare(_Strict):
    """A process on a CPU: which machine it runs on, how many of its cores its compute uses, and what messages cost
    it, as that machine measures (`bloombee.host_costs`)."""

    host: str = Field(min_length=1, description="machine fingerprint: nodes with the same host share its cores")
    threads: int = Field(ge=1, description="compute threads of this node")
    cores: int = Field(ge=1, description="cores of the machine")
    message_ms: float = Field(0.0, ge=0, description="CPU time this process (with its p2p daemon) spends on one "
                                                       "message it sends or receives, in turns with its compute")
    busy_cores: float = Field(0.0, ge=0, description="cores of the machine that processes outside the chain's "
                                                     "compute (p2p daemons, DHT peers) keep busy while it computes")
    stack_mbps: float = Field(0.0, ge=0, description="rate at which this process and its p2p daemon move a message's "
                                                     "bytes (0: not modelled); while a message streams through the "
                                                     "process, that share of its transfer takes turns with its compute")
    daemon_share: float = Field(0.0, ge=0, le=1, description="the share of `message_ms` its p2p daemon spends, a "
                                                             "process of its own beside its compute")
    interpreter_share: float = Field(0.0, ge=0, le=1, description="the share of the work of moving a message's bytes "
                                                                  "(`stack_mbps`) done by the process itself")


class NodeSpec(_Strict):
    name: str = Field(min_length=1)
    gpu: str | None = Field(None, description="free text, e.g. 'RTX 4090'")
    gpu_memory_gib: float = Field(gt=0)
    host_memory_gib: float = Field(ge=0, description="host memory available to offloaded KV cache")
    reserved_gib: float = Field(1.0, ge=0, description="GPU memory not available to the planner (CUDA context, allocator)")
    offload: float | None = Field(None, ge=0, le=1, description="the KV fraction this node keeps in host memory when "
                                  "it is fixed (a running server's); default: the smallest that fits")
    cost: BlockCost = Field(description="one block at the node's own precision (quant_type, else none)")
    quant_type: QuantType | None = Field(None, description="the precision the node's blocks are fixed in (a running "
                                         "server's); default: the planner chooses among workload.quant")
    quant_costs: dict[QuantType, BlockCost] = Field(
        default_factory=dict, description="one block at other precisions; a precision not here is timed by `cost`"
    )
    link: LinkSpec
    compression: CompressionSpec | None = None
    cpu: CpuShare | None = None

    def quant_choices(self, allowed: list[QuantType]) -> tuple[QuantType, ...]:
        """The precisions the planner may give this node: its fixed one, else the allowed ones."""
        return (self.quant_type,) if self.quant_type is not None else tuple(allowed)

    def quant_cost(self, quant: QuantType) -> BlockCost:
        """The cost of one block kept in `quant`: measured in quant_costs, else the node's own `cost`."""
        return self.quant_costs.get(quant, self.cost)

    def borrows_cost(self, quant: QuantType) -> bool:
        """Whether `quant` is timed by the node's cost at another precision (nothing measured at it)."""
        return quant not in self.quant_costs and quant != (self.quant_type or "none")


class NodeProfile(NodeSpec):
    """A server's planner node as its DHT record announces it: measured by its profile on its own host, validated
    once when the record is read (fields a newer server adds are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    def node(self, **changes: Any) -> dict[str, Any]:
        """The planner node dict of this profile, with `changes` (a chain's name for it, its offload)."""
        return {**self.model_dump(exclude_none=True), **changes}


class ClientSpec(_Strict):
    name: Literal["client"] = CLIENT
    link: LinkSpec
    compression: CompressionSpec | None = None
    cpu: CpuShare | None = Field(None, description="the client's machine, when servers may share it")


# --------------------------------------------------------------------------------------- the file


class PlanInputs(_Strict):
    """Everything the planner needs. ``nodes`` are in pipeline order."""

    model: ModelSpec
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    client: ClientSpec
    nodes: list[NodeSpec] = Field(min_length=1)
    link_overrides: list[LinkOverride] = Field(default_factory=list)
    link_matrix: LinkMatrix | None = None

    @model_validator(mode="after")
    def _names(self) -> "PlanInputs":
        names = [node.name for node in self.nodes]
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name == CLIENT:
                raise ValueError(f"nodes[{i}].name: '{CLIENT}' is reserved for the client")
            if name in seen:
                raise ValueError(f"nodes[{i}].name: duplicate node name '{name}'")
            seen.add(name)
        known = seen | {CLIENT}
        for i, link in enumerate(self.link_overrides):
            for field in ("src", "dst"):
                value = getattr(link, field)
                if value not in known:
                    raise ValueError(f"link_overrides[{i}].{field}: unknown machine '{value}' (known: {sorted(known)})")
            if link.src == link.dst:
                raise ValueError(f"link_overrides[{i}]: src and dst are both '{link.src}'")
        if self.link_matrix is not None:
            for i, value in enumerate(self.link_matrix.names):
                if value not in known:
                    raise ValueError(f"link_matrix.names[{i}]: unknown machine '{value}' (known: {sorted(known)})")
        return self

    @model_validator(mode="after")
    def _quantised_sizes(self) -> "PlanInputs":
        for quant in self.quant_types_in_play:
            problem = self.model.quant_problem(self.workload.dtype, quant)
            if problem:
                raise ValueError(problem)
        return self

    # --- convenience -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.model.num_blocks

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.nodes]

    @property
    def quant_choices(self) -> list[tuple[QuantType, ...]]:
        """Per node, the precisions the planner may give it (most precise first)."""
        return [node.quant_choices(self.workload.quant) for node in self.nodes]

    @property
    def quant_types_in_play(self) -> tuple[QuantType, ...]:
        """The precisions some node may get, most precise first."""
        used = {quant for choices in self.quant_choices for quant in choices}
        return tuple(quant for quant in QUANT_TYPES if quant in used)

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "PlanInputs":
        """Read a YAML or JSON file; ``overrides`` (same layout, e.g. ``{"workload": {"seq_len": 512}}``)
        are merged in before validation. Raises PlanInputError naming the offending fields."""
        return cls.from_dict(read_input_file(path), overrides=overrides, source=str(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], overrides: dict[str, Any] | None = None, source: str = "input"
    ) -> "PlanInputs":
        data = _deep_merge(raw, overrides or {})
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PlanInputError(f"invalid planner input ({source}):\n{format_validation_error(exc)}") from None


def read_input_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read planner input {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PlanInputError(f"cannot parse planner input {path}: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PlanInputError(f"planner input {path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        location = _format_loc(error.get("loc", ()))
        message = error.get("msg", "invalid")
        # model validators put the field in the message themselves ("Value error, nodes[1].name: ...")
        message = message.removeprefix("Value error, ")
        head, sep, rest = message.partition(": ")
        if sep and head and " " not in head and location:
            # a model validator naming a field inside the model it validates
            location = location + ("" if head.startswith("[") else ".") + head
            message = rest
        if location:
            lines.append(f"  {location}: {message}")
        else:
            lines.append(f"  {message}")
    return "\n".join(lines)


def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
