"""The client workload, run inside the client's namespace: `ip netns exec NS python -m benchmarks.netbench.worker`.

It talks to the harness with one JSON object per line: commands on stdin, replies on the
original stdout (everything else the process prints goes to stderr, i.e. its log). Commands:

- ``init``: join the swarm (a client-mode DHT peer bound to the namespace's address, NAT traversal off);
- ``wait_online``: wait until the named servers announce themselves online;
- ``run``: one warm-up session (a 1-token prompt and ``warmup_steps`` decode steps), then one measured session: a prefill step of the prompt and
  ``new_tokens - 1`` greedy decode steps through ``session.step`` (the client computes embeddings
  and the LM head itself). Before the prefill, before the first decode step and after the last
  one it writes ``{"event": "mark", ...}`` and waits for ``{"cmd": "continue"}``: the harness
  reads the interface counters there. A configuration that speculates (``speculates``) runs
  ``model.generate`` with its draft model instead (marks before and after), timed end to end and to
  its first token, with the speculation's round statistics;
- ``speculate``: ``model.generate`` of ``new_tokens`` greedy tokens per row, plain or with the draft model
  (``generate`` keyword arguments as given: ``speculation``, ``prune_tau``, ``draft_widths``), after one
  warm-up call: its wall time, the speculation's round statistics and each row's completion time;
- ``quit``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger("benchmarks.netbench.worker")

ROOT = Path(__file__).resolve().parents[2]
EVAL_TEXT = ROOT / "bloombee" / "assets" / "eval" / "heldout_sample.txt"
COMMANDS = ("init", "wait_online", "run", "speculate")


class Channel:
    def __init__(self, inp: TextIO, out: TextIO):
        self.inp, self.out = inp, out

    def send(self, obj: dict) -> None:
        self.out.write(json.dumps(obj) + "\n")
        self.out.flush()

    def receive(self) -> dict | None:
        line = self.inp.readline()
        return json.loads(line) if line else None

    def mark(self, name: str) -> None:
        self.send({"event": "mark", "name": name})
        reply = self.receive()
        if not reply or reply.get("cmd") != "continue":
            raise RuntimeError(f"expected 'continue' after mark {name}, got {reply!r}")


class Workload:
    def __init__(self, channel: Channel):
        self.channel = channel
        self.dht = None
        self.model_path: str = ""
        self.models: dict[str, Any] = {}
        self.dtype = None

    # -- commands ----------------------------------------------------------------------------

    def init(self, model: str, initial_peers: list[str], host_ip: str, dtype: str = "float32", threads: int = 0) -> dict:
        import torch

        from bloombee.dht.peers import start_dht
        from bloombee.loading import dht_prefix, load_model_config

        if threads:
            torch.set_num_threads(threads)
        self.model_path = model
        self.config = load_model_config(model)
        if dtype == "auto":  # the checkpoint's own dtype, as the servers' --dtype auto does
            saved = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None) or torch.float32
            self.dtype = getattr(torch, saved) if isinstance(saved, str) else saved
        else:
            self.dtype = getattr(torch, dtype)
        self.prefix = dht_prefix(model)
        self.dht = start_dht(initial_peers, host_maddrs=[f"/ip4/{host_ip}/tcp/0"], nat_traversal=False, client_mode=True)
        return {"peer_id": self.dht.peer_id.to_base58(), "prefix": self.prefix, "dtype": str(self.dtype).replace("torch.", ""), "num_blocks": self.config.num_hidden_layers,
                "hidden_size": self.config.hidden_size, "vocab_size": self.config.vocab_size}

    def wait_online(self, names: list[str], timeout_s: float = 300.0) -> dict:
        """Poll the DHT until every named server is online or `timeout_s` passes; says who is still missing."""
        from bloombee.dht.records import ServerState, fetch_records

        deadline = time.monotonic() + timeout_s
        while True:
            online: dict[str, list[int]] = {}
            for records in fetch_records(self.dht, self.prefix, self.config.num_hidden_layers):
                for record in records.values():
                    if record.state == ServerState.ONLINE:
                        online[record.public_name] = [record.start_block, record.end_block]
            missing = sorted(set(names) - set(online))
            if not missing or time.monotonic() > deadline:
                return {"online": online, "missing": missing}
            time.sleep(0.5)

    def _model(self, allowed: list[str], settings: dict[str, Any]):
        from bloombee.client import AutoDistributedModel

        key = json.dumps([sorted(allowed), settings], sort_keys=True)
        if key not in self.models:
            self.models[key] = AutoDistributedModel.from_pretrained(self.model_path, dht=self.dht, dtype=self.dtype,
                                                                    allowed_servers=allowed, **settings)
        return self.models[key]

    def prompt_ids(self, batch: int, prompt_len: int, seed: int):
        """Real text for models with a tokenizer (activations of real text compress like real ones), else random ids."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        try:
            from transformers import AutoTokenizer

            from bloombee.loading import resolve_model

            tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.model_path))
            ids = tokenizer(EVAL_TEXT.read_text(), return_tensors="pt", verbose=False).input_ids[0]
            if len(ids) >= prompt_len * 2:
                starts = torch.randint(0, len(ids) - prompt_len, (batch,), generator=generator)
                return torch.stack([ids[s:s + prompt_len] for s in starts.tolist()]), "text"
        except (OSError, ValueError):
            pass
        return torch.randint(0, self.config.vocab_size, (batch, prompt_len), generator=generator), "random"

    def run(self, allowed: list[str], settings: dict[str, Any], batch: int, prompt_len: int, new_tokens: int,
            warmup_steps: int = 2, seed: int = 0, marks: bool = True, max_length: int = 0) -> dict:
        """One measured generation: through `model.generate` with the draft model when the settings speculate
        (`speculates`), else the plain step loop; after a warm-up of the same kind."""
        import torch

        from bloombee.client.micro_batching import client_cpu_share

        model = self._model(allowed, settings)
        ids, source = self.prompt_ids(batch, prompt_len, seed)
        mark = self.channel.mark if marks else None
        if speculates(settings):
            measured = self._run_generate(model, ids, new_tokens, warmup_steps, mark)
        else:
            measured = self._run_steps(model, ids, new_tokens, warmup_steps, max_length, mark)
        return {**measured, "prompt_source": source, "torch_threads": torch.get_num_threads(),
                "client_settings": settings, "client_cpu": client_cpu_share()}

    def _run_steps(self, model, ids, new_tokens: int, warmup_steps: int, max_length: int, mark) -> dict:
        """The plain loop: a prefill step and `new_tokens - 1` greedy decode steps through `session.step`."""
        import torch

        max_length = max(max_length, ids.shape[1] + max(new_tokens, warmup_steps + 1))  # the sessions' KV cache length
        began = time.perf_counter()
        with torch.inference_mode():  # opens connections and push streams, warms the codec policies; a 1-token prompt
            self._generate(model, ids[:, :1], warmup_steps + 1, max_length, None)
        warmup_s = time.perf_counter() - began
        with torch.inference_mode():
            steps, chain, wall = self._generate(model, ids, new_tokens, max_length, mark)
        return {"mode": "steps", "steps": steps, "chain": chain, "generation_s": wall, "warmup_s": warmup_s}

    def _run_generate(self, model, ids, new_tokens: int, warmup_steps: int, mark) -> dict:
        """`model.generate` of `new_tokens` greedy tokens per row with the settings' draft model (speculative
        decoding as the product runs it), timed end to end and to its first token."""
        if model.settings_draft() is None:
            raise ValueError(f"the configuration speculates but {self.model_path} names no draft model; "
                             "give one as the draft_model client setting")
        kwargs = {"do_sample": False, "eos_token_id": None}
        began = time.perf_counter()
        model.generate(ids[:, :1], max_new_tokens=warmup_steps + 1, **kwargs)
        warmup_s = time.perf_counter() - began
        clock = TokenClock()
        if mark is not None:
            mark("start")
        began = time.perf_counter()
        output = model.generate(ids, max_new_tokens=new_tokens, streamer=clock, **kwargs)
        wall = time.perf_counter() - began
        if mark is not None:
            mark("end")
        stats = model.last_speculation
        return {"mode": "generate", "steps": [], "generation_s": wall, "warmup_s": warmup_s,
                "first_token_s": clock.first_token_at - began, "batch": int(ids.shape[0]),
                "new_tokens": int(output.shape[1] - ids.shape[1]),
                "chain": [{"name": name, "start": start, "end": end} for name, start, end in stats.chain],
                "speculation": {"tree_rounds": stats.tree_rounds, "plain_rounds": stats.plain_rounds,
                                "accepted": stats.accepted, "nodes_proposed": stats.nodes_proposed}}

    def speculate(self, allowed: list[str], settings: dict[str, Any], batch: int, prompt_len: int, new_tokens: int,
                  generate: dict[str, Any], seed: int = 0) -> dict:
        import torch

        model = self._model(allowed, settings)
        ids, source = self.prompt_ids(batch, prompt_len, seed)
        kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": None, **generate}
        model.generate(ids, **{**kwargs, "max_new_tokens": 4})
        model.last_speculation = None
        began = time.perf_counter()
        output = model.generate(ids, **kwargs)
        wall = time.perf_counter() - began
        stats = model.last_speculation
        rounds = {} if stats is None else {
            "tree_rounds": stats.tree_rounds, "plain_rounds": stats.plain_rounds, "accepted": stats.accepted,
            "nodes_proposed": stats.nodes_proposed, "nodes_per_hop": stats.nodes_per_hop,
            "completed_at": stats.completed_at}
        return {"wall_s": wall, "new_tokens": int(output.shape[1] - ids.shape[1]) * batch, "prompt_source": source,
                "output": output[:, ids.shape[1]:].tolist(), "torch_threads": torch.get_num_threads(), **rounds}

    # -- the generation loop -----------------------------------------------------------------

    def _generate(self, model, ids, new_tokens: int, max_length: int, mark) -> tuple[list[dict], list[dict], float]:
        head = model.head
        head_dtype = next(head.parameters()).dtype
        steps: list[dict] = []
        with model.remote.inference_session(max_length=max_length, batch_size=ids.shape[0]) as session:
            chain = [{"peer_id": span.peer_id, "name": span.record.public_name, "start": span.start, "end": span.end,
                      "profile": span.record.profile and span.record.profile.model_dump(mode="json", exclude_none=True),
                      "dtype": span.record.dtype, "offload": span.record.offload, "quant_type": span.record.quant_type,
                      "device_memory_bytes": span.record.device_memory_bytes,
                      "host_memory_bytes": span.record.host_memory_bytes} for span in session.spans]
            tokens = ids
            began = time.perf_counter()
            for index in range(new_tokens):
                kind = "prefill" if index == 0 else "decode"
                if mark is not None and index <= 1:
                    mark("start" if index == 0 else "decode")
                t0 = time.perf_counter()
                hidden = head.embed(tokens)
                t1 = time.perf_counter()
                out = session.step(hidden)
                t2 = time.perf_counter()
                tokens = head.logits(out[:, -1:].to(head_dtype)).argmax(-1)
                t3 = time.perf_counter()
                steps.append(step_record(kind, hidden, session.last_step, t3 - t0, (t1 - t0) + (t3 - t2)))
            wall = time.perf_counter() - began
            if mark is not None:
                mark("end")
        return steps, chain, wall


def speculates(settings: dict[str, Any]) -> bool:
    """Whether a configuration's client settings switch speculative decoding on (or to auto): it then runs through
    `model.generate`, the only path that speculates."""
    return settings.get("speculation", "off") != "off"


class TokenClock:
    """A transformers-style streamer that notes when the first generated tokens arrive (the prompt comes first)."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, tokens) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def step_record(kind: str, hidden, stats, wall_s: float, head_s: float) -> dict:
    return {
        "kind": kind, "tokens": int(hidden.shape[1]), "batch": int(hidden.shape[0]), "wall_s": wall_s, "head_s": head_s,
        "chain_s": stats.total_s, "client_encode_s": stats.client_encode_s, "client_decode_s": stats.client_decode_s,
        "client_layout": stats.client_layout, "sent_raw_bytes": stats.sent_raw_bytes, "sent_wire_bytes": stats.sent_wire_bytes,
        "received_wire_bytes": stats.received_wire_bytes, "micro_batches": stats.micro_batches,
        "reports": [report.model_dump() if report is not None else None for report in stats.reports],
        "sent_at": stats.sent_at, "received_at": stats.received_at,
        "micro_batch_reports": [[report.model_dump() for report in reports] for reports in stats.micro_batch_reports],
    }


def main() -> None:
    protocol_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the log, never into the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=os.environ.get("NETBENCH_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    channel = Channel(sys.stdin, protocol_out)
    workload = Workload(channel)
    channel.send({"event": "ready", "pid": os.getpid()})
    while True:
        command = channel.receive()
        if command is None or command.get("cmd") == "quit":
            break
        name = command.pop("cmd", None)
        try:
            if name not in COMMANDS:
                raise ValueError(f"unknown command {name!r}; expected one of {', '.join(COMMANDS)}")
            result = getattr(workload, name)(**command)
            channel.send({"event": "result", "cmd": name, "result": result})
        except Exception as error:  # reported to the harness, which decides
            logger.exception("command %s failed", name)
            channel.send({"event": "error", "cmd": name, "error": f"{type(error).__name__}: {error}"})
    if workload.dht is not None:
        workload.dht.shutdown()


if __name__ == "__main__":
    main()
