"""Quantised servers in a real swarm: greedy tokens equal a local model whose blocks are quantised the same way (int8,
nf4; Llama and Mixtral), across a server killed mid-generation, with KV offload, micro-batches, compression and
speculation on top; records and status announce each server's precision and weight bytes; clients route only through
the precisions they accept and are told when that leaves blocks unserved; a server sized by --device-memory fits more
nf4 blocks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteriaList

from bloombee.client.routing import MissingBlocksError
from bloombee.dht.records import fetch_records
from bloombee.loading import load_model_config
from bloombee.loading.local_model import LocalModel
from bloombee.models import family_for_config
from bloombee.models.core.quantize import planned_weight_bytes
from conftest import make_tiny_model
from swarm_support import KillServerAt, client, start_swarm

MODEL = "bloombee-tiny"
SERVERS = {  # name: (blocks, quant type, extra flags)
    "i1": ("0:4", "int8", ()), "i2": ("4:8", "int8", ()),
    "n1": ("0:4", "nf4", ("--offload", "0.5")), "n3": ("4:8", "nf4", ()), "n4": ("4:8", "nf4", ()),
}
FIT_MEMORY = "12MiB"  # with --cache-tokens 1024: all 8 blocks in nf4 (1.4 MB each), 3 in float32 (3.8 MB each)
PROMPT = torch.tensor([[11, 22, 33, 44, 55, 66], [7, 8, 9, 10, 11, 12]])
NEW_TOKENS = 16


def generate_killing(swarm, model, prompt, span_index):
    """Greedy tokens of `prompt` in one session whose server of span `span_index` is SIGKILLed after 6 tokens."""
    killer = KillServerAt(swarm, model, span_index, after=6, prompt_length=prompt.shape[1])
    with model.inference_session(max_length=64, batch_size=prompt.shape[0]) as session:
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([killer]))
        assert killer.killed is not None and session.recoveries >= 1
    return out


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = start_swarm(MODEL, tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("cache"))
    try:
        for name, (blocks, quant, flags) in SERVERS.items():
            swarm.add_server("--blocks", blocks, "--quant-type", quant, "--dtype", "float32", *flags, name=name,
                             wait=False)
        swarm.add_server("--quant-type", "nf4", "--dtype", "float32", "--device-memory", FIT_MEMORY,
                         "--cache-tokens", "1024", name="fit", wait=False)
        plan = tmp_path_factory.mktemp("plan") / "plan.json"
        plan.write_text(json.dumps({"feasible": True, "nodes": ["planned"], "plan": {
            "assignment": [8], "alphas": [0.0], "batch_size": 4, "micro_batches": 1, "quant_types": ["int8"]}}))
        swarm.add_server("--plan", str(plan), "--node", "planned", "--dtype", "float32", name="planned", wait=False)
        swarm.wait_online([*SERVERS, "fit", "planned"])
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def local():
    return {quant: LocalModel(MODEL, torch.float32, quant) for quant in ("int8", "nf4")}


def test_int8_chains_equal_the_local_int8_model_and_routing_takes_the_fewest_hops(swarm, local):
    """Through i1 and i2, then as routing chooses among them and `planned` (all 8 blocks): the one hop."""
    expected = local["int8"].greedy(PROMPT, NEW_TOKENS)
    for allowed, chain in ((["i1", "i2"], ["i1", "i2"]), (None, ["planned"])):
        with client(swarm, quant_types=("int8",), allowed_servers=allowed) as model:
            with model.inference_session(max_length=64, batch_size=PROMPT.shape[0]) as session:
                out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
                assert [span.record.public_name for span in session.spans] == chain
        assert torch.equal(out, expected)


def test_nf4_with_offload_micro_batches_and_compression_survives_a_kill(swarm, local):
    """n1 keeps half its KV cache in host memory; the second span's server dies after 6 tokens."""
    with client(swarm, quant_types="nf4", micro_batches=2, compression="on", request_timeout=30.0,
                allowed_servers=["n1", "n3", "n4"]) as model:
        out = generate_killing(swarm, model, PROMPT, span_index=1)
    assert torch.equal(out, local["nf4"].greedy(PROMPT, NEW_TOKENS))


def test_speculation_on_an_nf4_server_is_plain_greedy_decoding(swarm, local):
    with client(swarm, quant_types="nf4", allowed_servers=["fit"]) as model:
        spec = model.generate(PROMPT[:1], max_new_tokens=NEW_TOKENS, do_sample=False,
                              draft_model="bloombee-tiny-draft", speculation="on", prune_tau=0.2)
        assert model.last_speculation.tree_rounds > 0
    assert torch.equal(spec, local["nf4"].greedy(PROMPT[:1], NEW_TOKENS))


def test_records_and_status_announce_precision_and_weight_bytes(swarm):
    config = load_model_config(MODEL)
    family = family_for_config(config)
    with torch.device("meta"):
        block = family.block_class(family.block_config(config, 0), 0)
    records = {record.public_name: record for records in fetch_records(swarm.dht, swarm.prefix, 8)
               for record in records.values()}
    for name in ("i1", "i2", "n1", "fit"):
        record = records[name]
        quant = SERVERS[name][1] if name in SERVERS else "nf4"
        blocks = record.end_block - record.start_block
        assert record.quant_type == quant and record.weight_bytes == blocks * planned_weight_bytes(block, quant, 4)
    status = subprocess.run([str(Path(sys.executable).parent / "bloombee-client"), "status", "--model", MODEL,
                             "--initial-peers", *swarm.initial_peers, "--json"],
                            capture_output=True, text=True, timeout=120)
    servers = {server["public_name"]: server for server in json.loads(status.stdout)["models"][0]["servers"]}
    assert servers["i1"]["quant_type"] == "int8" and servers["i1"]["weight_bytes"] == records["i1"].weight_bytes


def test_a_server_sized_by_its_memory_fits_all_blocks_in_nf4_and_a_planned_one_takes_the_plans_precision(swarm):
    records = {record.public_name: record for records in fetch_records(swarm.dht, swarm.prefix, 8)
               for record in records.values()}
    assert (records["fit"].start_block, records["fit"].end_block, records["fit"].quant_type) == (0, 8, "nf4")
    assert (records["planned"].start_block, records["planned"].end_block, records["planned"].quant_type) == \
        (0, 8, "int8")


def test_a_client_accepting_only_full_precision_is_told_what_serves_the_blocks(swarm):
    with client(swarm, quant_types="none") as model:
        with pytest.raises(MissingBlocksError, match=r"served only by servers whose weights are int8 or nf4, and this "
                                                     r"client accepts none \(quant_types\)"):
            model.generate(PROMPT[:1], max_new_tokens=2, do_sample=False)


@pytest.fixture(scope="module")
def mixtral_swarm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model") / "tiny-mixtral"
    make_tiny_model("mixtral", num_layers=4, seed=3).save_pretrained(folder)
    swarm = start_swarm(folder, tmp_path_factory.mktemp("mixtral-logs"), tmp_path_factory.mktemp("mixtral-cache"),
                        num_blocks=4)
    try:
        for name, blocks in (("m1", "0:2"), ("m2", "0:2"), ("m3", "2:4")):
            swarm.add_server("--blocks", blocks, "--quant-type", "nf4", "--dtype", "float32", name=name, wait=False)
        swarm.wait_online(["m1", "m2", "m3"])
        yield swarm
    finally:
        swarm.stop()


def test_an_nf4_mixtral_chain_equals_the_local_nf4_model_across_a_kill(mixtral_swarm):
    with client(mixtral_swarm, request_timeout=30.0) as model:
        out = generate_killing(mixtral_swarm, model, PROMPT, span_index=0)
    assert torch.equal(out, LocalModel(mixtral_swarm.model, torch.float32, "nf4").greedy(PROMPT, NEW_TOKENS))
