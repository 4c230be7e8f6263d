"""Loading: only the hosted blocks' tensors are read, .bin fallback, dtype, tied heads, resolution and DHT prefix."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import bloombee.loading.resolve as resolve_mod
import bloombee.loading.weights as weights_mod
from bloombee.loading import (ALIASES, ModelNotFoundError, dht_prefix, load_block_stack, load_client_head,
                              load_model_config, resolve_model)
from bloombee.models.core import masks

pytestmark = pytest.mark.usefixtures("single_thread_torch")


class RecordingSafeOpen:
    """Wraps safetensors.safe_open, recording the files opened and the tensors read."""

    def __init__(self, real):
        self.real, self.files, self.tensors = real, set(), []

    def __call__(self, path, *args, **kwargs):
        recorder = self
        self.files.add(os.path.basename(str(path)))
        inner = self.real(path, *args, **kwargs)

        class Handle:
            def __enter__(self):
                self.f = inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                recorder.tensors.append(name)
                return self.f.get_tensor(name)

        return Handle()


def _block_bytes(model, indices, prefix="model.layers."):
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if any(name.startswith(f"{prefix}{i}.") for i in indices))


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_partial_loading_reads_only_hosted_blocks(tiny_checkpoint, monkeypatch, shard):
    folder, model = tiny_checkpoint("llama-gqa", 8, save_kwargs={"max_shard_size": shard} if shard else None)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    recorder = RecordingSafeOpen(weights_mod.safe_open)
    monkeypatch.setattr(weights_mod, "safe_open", recorder)
    stack = load_block_stack(folder, 4, 8)
    assert (stack.start, stack.end, len(stack.blocks)) == (4, 8, 4)
    assert recorder.tensors and all(n.startswith(tuple(f"model.layers.{i}." for i in range(4, 8)))
                                    for n in recorder.tensors)
    param_bytes = sum(p.numel() * p.element_size() for p in stack.parameters())
    assert param_bytes == _block_bytes(model, range(4, 8))
    if shard:  # only the shards holding blocks 4..7 were opened
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert recorder.files == {index[n] for n in recorder.tensors}
        assert len(set(index.values())) > len(recorder.files)
    # and it computes blocks 4..8 exactly
    ids = torch.randint(1, 128, (1, 9))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
        pos = torch.arange(9)
        out = stack(ref[4], pos[None], None, pos, masks.stateless_causal_mask(9))
        assert (model.model.norm(out) - ref[8]).abs().max() <= 1e-5


def _to_bin(folder, sharded):
    state = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    if not sharded:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        torch.save({n: state[n] for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True])
def test_bin_fallback(tiny_checkpoint, sharded):
    folder, model = tiny_checkpoint("mistral", 4)
    _to_bin(folder, sharded)
    stack, head = load_block_stack(folder, 2, 4), load_client_head(folder)
    assert sum(p.numel() * p.element_size() for p in stack.parameters()) == _block_bytes(model, [2, 3])
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        pos = torch.arange(6)
        out = stack(ref.hidden_states[2], pos[None], None, pos, masks.stateless_causal_mask(6))
        assert (head.logits(out) - ref.logits).abs().max() <= 1e-4


def test_dtype_auto_follows_config(tiny_checkpoint, tmp_path):
    folder, model = tiny_checkpoint("llama", 2)
    assert load_block_stack(folder, 0, 1, dtype="auto").dtype == torch.float32
    bf16 = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(bf16)
    stack = load_block_stack(bf16, 0, 2, dtype="auto")
    assert stack.dtype == torch.bfloat16 and stack.rotaries[None].inv_freq.dtype == torch.float32
    assert stack.new_caches(1, 4)[0].k.dtype == torch.bfloat16
    assert load_client_head(bf16, "auto").dtype == torch.bfloat16
    assert load_block_stack(folder, 0, 1, dtype=torch.float16).dtype == torch.float16


def test_tied_embeddings(tiny_checkpoint):
    folder, model = tiny_checkpoint("llama", 2, tie_word_embeddings=True)
    head = load_client_head(folder)
    assert head.lm_head.weight is head.embed_tokens.weight
    ids = torch.randint(1, 128, (1, 5))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        assert (head.logits(ref.hidden_states[-1]) - ref.logits).abs().max() == 0 or \
            (model.lm_head(ref.hidden_states[-1]) - ref.logits).abs().max() <= 1e-5
        assert torch.allclose(head.lm_head(ref.hidden_states[-1]), ref.logits, atol=1e-5)


def test_client_head_holds_only_head_tensors(tiny_checkpoint, monkeypatch):
    folder, model = tiny_checkpoint("falcon-40b", 2)
    recorder = RecordingSafeOpen(weights_mod.safe_open)
    monkeypatch.setattr(weights_mod, "safe_open", recorder)
    head = load_client_head(folder)
    assert not any(".h." in n for n in recorder.tensors)
    assert {n for n, _ in head.named_parameters()} <= {"embed_tokens.weight", "norm.weight", "norm.bias",
                                                       "lm_head.weight"}


def test_bad_block_range(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama", 2)
    for start, end in [(1, 1), (0, 3), (-1, 1)]:
        with pytest.raises(ValueError, match="block range"):
            load_block_stack(folder, start, end)


def test_bad_inputs_get_clear_errors(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama", 2)
    stack = load_block_stack(folder, 0, 2)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="hidden must be"):
        stack(torch.zeros(1, 3, 32), pos[None], None, pos, None)
    with pytest.raises(ValueError, match="rope_positions"):
        stack(torch.zeros(1, 3, 64), pos, None, pos, None)
    with pytest.raises(ValueError, match="attention_mask"):
        stack(torch.zeros(1, 3, 64), pos[None], None, pos, torch.ones(1, 3, 3))
    with pytest.raises(ValueError, match="caches"):
        stack(torch.zeros(1, 3, 64), pos[None], stack.new_caches(1, 4)[:1], pos, None)


# --- resolution, aliases, hub, DHT prefix ---------------------------------------------------------

def test_alias_table():
    assert ALIASES["llama-30b"] == "huggyllama/llama-30b"
    assert ALIASES["llama-2-70b"] == "meta-llama/Llama-2-70b-hf"
    assert ALIASES["llama-3-8b"] == "meta-llama/Meta-Llama-3-8B"
    assert ALIASES["mixtral-8x7b"] == "mistralai/Mixtral-8x7B-v0.1"
    assert ALIASES["falcon-40b"] == "tiiuae/falcon-40b"
    for alias in ("llama-13b", "llama-65b", "mistral-7b", "falcon-7b", "qwen2.5-72b", "qwen3-8b", "gemma-7b"):
        assert "/" in ALIASES[alias]


def test_package_alias_resolves_to_assets(tiny_checkpoint, tmp_path, monkeypatch):
    folder, _ = tiny_checkpoint("llama", 2)
    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copytree(folder, assets / "bloombee-tiny")
    monkeypatch.setattr(resolve_mod, "assets_dir", lambda: assets)
    assert resolve_model("bloombee-tiny") == assets / "bloombee-tiny"
    assert dht_prefix("bloombee-tiny") == dht_prefix(assets / "bloombee-tiny") == "bloombee-tiny"
    with pytest.raises(ModelNotFoundError, match="bloombee-tiny-draft.*missing"):
        resolve_model("bloombee-tiny-draft")


def test_real_package_assets_if_shipped():
    folder = resolve_mod.assets_dir() / "bloombee-tiny"
    if not (folder / "config.json").is_file():
        with pytest.raises(ModelNotFoundError, match="package-data folder"):
            resolve_model("bloombee-tiny")
        pytest.skip("bloombee/assets/bloombee-tiny is not shipped in this checkout")
    assert resolve_model("bloombee-tiny") == folder
    assert "." not in dht_prefix("bloombee-tiny")


def test_missing_local_folder_and_bad_names(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelNotFoundError, match="not a local folder"):
        resolve_model("./does/not/exist")


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 with an empty private hub cache."""
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_offline_hub_error_names_id_and_local_folder(offline_hub):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-org/no-such-model")
    message = str(info.value)
    assert "no-such-org/no-such-model" in message and "HF_HUB_OFFLINE" in message and "local folder" in message
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        load_block_stack("no-such-org/no-such-model", 0, 1)


def _to_bin_shards(folder):
    """Replace a sharded safetensors checkpoint by PyTorch .bin shards with the same split and an index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map = {}
    for file in sorted(set(index.values())):
        bin_file = file.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
        torch.save(load_file(folder / file), folder / bin_file)
        weight_map.update({n: bin_file for n, f in index.items() if f == file})
        os.remove(folder / file)
    os.remove(folder / "model.safetensors.index.json")
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hub_id_downloads_only_needed_shards(tiny_checkpoint, tmp_path, monkeypatch, fmt):
    """A fake hub serving a sharded checkpoint: a server for blocks 6..8 downloads only their shards."""
    import fnmatch

    import huggingface_hub

    hub, model = tiny_checkpoint("llama-gqa", 8, save_kwargs={"max_shard_size": "40KB"})
    if fmt == "bin":
        _to_bin_shards(hub)
    snapshot = tmp_path / "cache" / "models--some-org--Tiny-Llama-1.5" / "snapshots" / "rev"
    snapshot.mkdir(parents=True)

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        assert repo_id == "some-org/Tiny-Llama-1.5"
        for f in hub.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setitem(ALIASES, "tiny-llama", "some-org/Tiny-Llama-1.5")
    stack = load_block_stack("tiny-llama", 6, 8)
    assert sum(p.numel() * p.element_size() for p in stack.parameters()) == _block_bytes(model, [6, 7])
    index_name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    index = json.loads((hub / index_name).read_text())["weight_map"]
    wanted = {f for n, f in index.items() if n.startswith(("model.layers.6.", "model.layers.7."))}
    assert {f.name for f in snapshot.glob(f"*.{fmt}")} == wanted
    assert len(set(index.values())) > len(wanted)
    assert load_model_config("some-org/Tiny-Llama-1.5").num_hidden_layers == 8
    prefixes = {dht_prefix(x) for x in ("tiny-llama", "some-org/Tiny-Llama-1.5", snapshot)}
    assert prefixes == {"Tiny-Llama-1-5"}


def test_hub_id_from_offline_cache(offline_hub, tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama", 2)
    repo = offline_hub / "models--some-org--Cached"
    shutil.copytree(folder, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert load_block_stack("some-org/Cached", 0, 2).end == 2
    assert dht_prefix("some-org/Cached") == dht_prefix(repo / "snapshots" / ("a" * 40)) == "Cached"


def test_dht_prefix_of_plain_folder_is_its_name(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("qwen3", 2)
    copy = tmp_path / "Qwen3-0.6B"
    shutil.copytree(folder, copy)
    assert dht_prefix(copy) == "Qwen3-0-6B"
