"""Exactness: our block stacks + client head equal the transformers models (hidden states and greedy tokens)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import transformers

from bloombee.loading import load_block_stack, load_client_head
from bloombee.models import families, family_for_model_type
from bloombee.models.codegen import SPECS_DIR, render_all, write_all
from bloombee.models.core import masks
from bloombee.models.core.packing import Segment
from bloombee.speculative.tree import depths, tree_mask

from conftest import TINY_VARIANTS

VARIANTS = list(TINY_VARIANTS)
LAYERS = 4

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def load_servers(folder, num_layers=LAYERS):
    """Two 'servers' holding [0, k) and [k, L), and the client head."""
    k = num_layers // 2
    return [load_block_stack(folder, 0, k), load_block_stack(folder, k, num_layers)], load_client_head(folder)


def run_chain(stacks, hidden, rope_positions, caches, cache_positions, mask):
    outs = []
    for stack, stack_caches in zip(stacks, caches):
        hidden = stack(hidden, rope_positions, stack_caches, cache_positions, mask)
        outs.append(hidden)
    return outs


def greedy(stacks, head, input_ids, steps, key_padding=None):
    """Greedy decoding with our stacks and KV caches; input_ids may be left-padded (key_padding [b, T])."""
    b, t = input_ids.shape
    if key_padding is None:
        key_padding = torch.ones(b, t, dtype=torch.bool)
    caches = [stack.new_caches(b, t + steps) for stack in stacks]
    padding = torch.cat([key_padding.bool(), torch.ones(b, steps, dtype=torch.bool)], dim=1)
    rope_all = masks.rope_positions_from_padding(padding)
    tokens, new = input_ids, []
    cache_positions = torch.arange(t)
    for _ in range(steps):
        length = int(cache_positions[-1]) + 1
        mask = masks.causal_mask(cache_positions, length, padding)
        hidden = run_chain(stacks, head.embed(tokens), rope_all[:, cache_positions], caches, cache_positions,
                           mask)[-1]
        next_tokens = head.logits(hidden[:, -1]).argmax(-1)
        new.append(next_tokens)
        tokens = next_tokens[:, None]
        cache_positions = torch.tensor([length])
    return torch.stack(new, dim=1)


def assert_hidden_states_match(folder, model):
    """Prompt, then token by token, through two stacks: hidden states and logits equal the reference's."""
    stacks, head = load_servers(folder)
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 20))
    ref = model(ids, output_hidden_states=True).hidden_states  # embeddings, layer 1..L (last one normed)
    prompt = 12
    caches = [stack.new_caches(2, 32) for stack in stacks]
    chunks = []
    for lo, hi in [(0, prompt)] + [(i, i + 1) for i in range(prompt, 20)]:
        cache_positions = torch.arange(lo, hi)
        mask = masks.causal_mask(cache_positions, hi, batch_size=2)
        chunks.append(run_chain(stacks, head.embed(ids[:, lo:hi]), cache_positions.expand(2, -1), caches,
                                cache_positions, mask))
    k = LAYERS // 2
    mid = torch.cat([c[0] for c in chunks], dim=1)
    last = torch.cat([c[1] for c in chunks], dim=1)
    assert (head.embed(ids) - ref[0]).abs().max() == 0
    assert (mid - ref[k]).abs().max() <= 1e-5
    assert (head.norm(last) - ref[-1]).abs().max() <= 1e-5
    logits = head.logits(last)
    assert (logits - model(ids).logits).abs().max() <= 1e-4


def assert_greedy_tokens_match(folder, model):
    """32 greedy tokens through two stacks and the head equal ``model.generate``'s."""
    stacks, head = load_servers(folder)
    torch.manual_seed(2)
    ids = torch.randint(1, 128, (1, 8))
    ref = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)[:, 8:]
    assert torch.equal(greedy(stacks, head, ids, 32), ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_hidden_states_match_prompt_then_token_by_token(variant, tiny_checkpoint):
    assert_hidden_states_match(*tiny_checkpoint(variant, LAYERS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_stateless_forward_matches(variant, tiny_checkpoint):
    folder, model = tiny_checkpoint(variant, 2)
    stack, head = load_block_stack(folder, 0, 2), load_client_head(folder)
    ids = torch.randint(1, 128, (2, 10))
    positions = torch.arange(10)
    out = stack(head.embed(ids), positions.expand(2, -1), None, positions, masks.stateless_causal_mask(10, None, 2))
    ref = model(ids, output_hidden_states=True).hidden_states[-1]
    assert (head.norm(out) - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_generate(variant, tiny_checkpoint):
    assert_greedy_tokens_match(*tiny_checkpoint(variant, LAYERS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_is_built_from_its_familys_reference_classes(variant):
    config_class, model_class, _ = TINY_VARIANTS[variant]
    family = family_for_model_type(getattr(transformers, config_class).model_type)
    assert (family.config_class, family.reference_model_class) == (config_class, model_class)


@pytest.fixture
def readme_family(tmp_path, monkeypatch):
    """The worked example of specs/README.md rendered into a temporary folder (outside bloombee/models),
    imported from there and put in the registry for this test only."""
    yaml_text = (SPECS_DIR / "README.md").read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    specs, packages = tmp_path / "new-specs", tmp_path / "packages"
    specs.mkdir()
    (specs / "starcoder2.yaml").write_text(yaml_text)
    write_all(render_all(specs), packages)
    monkeypatch.syspath_prepend(str(packages))
    try:
        family = importlib.import_module("starcoder2").FAMILY
        assert family.block_class.__module__ == "starcoder2.block"
        monkeypatch.setitem(families(), family.name, family)
        yield family
    finally:
        for name in [m for m in sys.modules if m == "starcoder2" or m.startswith("starcoder2.")]:
            del sys.modules[name]


def test_new_spec_from_readme_is_exact(readme_family, tiny_checkpoint, monkeypatch):
    kwargs = {"intermediate_size": 96, "num_key_value_heads": 2, "sliding_window": 6}
    monkeypatch.setitem(TINY_VARIANTS, "starcoder2",
                        (readme_family.config_class, readme_family.reference_model_class, kwargs))
    folder, model = tiny_checkpoint("starcoder2", LAYERS)
    assert type(model).__name__ == "Starcoder2ForCausalLM"
    assert_hidden_states_match(folder, model)
    assert_greedy_tokens_match(folder, model)


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral", "qwen2-sliding", "qwen3", "mixtral", "falcon-7b",
                                     "falcon-40b", "gemma", "gemma3", "bloom", "gpt-oss", "deepseek-v3"])
def test_left_padded_batch_matches_generate(variant, tiny_checkpoint):
    folder, model = tiny_checkpoint(variant, LAYERS)
    stacks, head = load_servers(folder)
    torch.manual_seed(3)
    ids = torch.randint(1, 128, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    ids[1, :5] = 0
    attention_mask[1, :5] = 0
    ref = model.generate(ids, attention_mask=attention_mask, max_new_tokens=16, min_new_tokens=16,
                         do_sample=False)[:, 12:]
    assert torch.equal(greedy(stacks, head, ids, 16, attention_mask.bool()), ref)
    # the padded row alone (no padding) gives the same tokens
    alone = greedy(stacks, head, ids[1:, 5:], 16)
    assert torch.equal(alone, ref[1:])


def test_micro_batches_write_their_own_cache_rows(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama-gqa", 2)
    stack, head = load_block_stack(folder, 0, 2), load_client_head(folder)
    ids = torch.randint(1, 128, (4, 6))
    full_caches, split_caches = stack.new_caches(4, 8), stack.new_caches(4, 8)
    positions = torch.arange(6)
    mask = masks.causal_mask(positions, 6, batch_size=4)
    full = stack(head.embed(ids), positions.expand(4, -1), full_caches, positions, mask)
    parts = [stack(head.embed(ids[i:i + 2]), positions.expand(2, -1), split_caches, positions, mask[i:i + 2],
                   batch_offset=i) for i in (0, 2)]
    assert torch.allclose(torch.cat(parts), full, atol=1e-6)
    for a, b in zip(full_caches, split_caches):
        assert torch.allclose(a.k, b.k, atol=1e-6) and torch.allclose(a.v, b.v, atol=1e-6)


def test_longrope_rotates_a_step_past_the_original_context_with_the_long_factors(tiny_checkpoint):
    """A step whose longest position is past original_max_position_embeddings uses the long factors, as transformers'
    forward of the same tokens does (the other phi3-longrope tests stay within it: the short factors)."""
    folder, model = tiny_checkpoint("phi3-longrope", LAYERS, original_max_position_embeddings=8)
    stacks, head = load_servers(folder)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12)
    rotary = stacks[0].rotaries[None]
    assert rotary._inv_freq(positions) is rotary.long_inv_freq
    assert not torch.equal(rotary.long_inv_freq, rotary.inv_freq)
    caches = [stack.new_caches(1, 16) for stack in stacks]
    last = run_chain(stacks, head.embed(ids), positions[None], caches, positions, masks.causal_mask(positions, 12))[-1]
    assert (head.logits(last) - model(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("nodes_alone", [False, True])
@pytest.mark.parametrize("variant", ["bloom", "deepseek-v3"])
def test_a_tree_step_equals_each_branch_decoded_in_order(tiny_checkpoint, variant, nodes_alone):
    """A tree step (all nodes at once, or node by node as batch-invariant servers attend) gives each node the hidden
    state its branch decoded token by token gives: with ALiBi, which counts a key's position among the keys its query
    attends (a node's ancestors), and with latent attention's cache of latents and rope keys."""
    folder, _ = tiny_checkpoint(variant, 2)
    stack, head = load_block_stack(folder, 0, 2), load_client_head(folder)
    for block in stack.blocks:
        block.attn.tree_nodes_alone = nodes_alone
    generator = torch.Generator().manual_seed(4)
    prompt, nodes = torch.randint(1, 128, (1, 6), generator=generator), torch.randint(1, 128, (5,), generator=generator)
    parents = torch.tensor([-1, 0, 0, 1, 2])
    caches = stack.new_caches(1, 16)
    positions = torch.arange(6)
    stack(head.embed(prompt), positions[None], caches, positions, masks.causal_mask(positions, 6))
    slots = torch.arange(6, 11)
    mask = tree_mask([parents], 5, torch.ones(1, 6, dtype=torch.bool))
    segment = Segment(1, 5, slots, mask, caches, tree_start=6)
    tree = stack.forward_packed(head.embed(nodes), 6 + depths(parents), [segment])
    for leaf, branch in ((3, [0, 1, 3]), (4, [0, 2, 4])):
        ids = torch.cat([prompt[0], nodes[branch]])[None]
        positions = torch.arange(ids.shape[1])
        alone = stack(head.embed(ids), positions[None], stack.new_caches(1, 16), positions,
                      masks.causal_mask(positions, ids.shape[1]))
        assert (tree[leaf] - alone[0, -1]).abs().max() <= 1e-5


def test_what_transformers_keeps_in_float32_stays_so_in_a_bfloat16_server(tiny_checkpoint):
    """DeepSeek-V3's router (its weight and correction bias) loads in float32 in a bfloat16 server, and gpt-oss's
    norms multiply their scale in float32, as transformers keeps and computes them."""
    folder, model = tiny_checkpoint("deepseek-v3", 2)
    stack = load_block_stack(folder, 0, 2, dtype=torch.bfloat16)
    router = stack.blocks[1].mlp.router
    assert stack.dtype == torch.bfloat16 == stack.blocks[1].mlp.experts[0].up_proj.weight.dtype
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, model.model.layers[1].mlp.gate.e_score_correction_bias)
    folder, model = tiny_checkpoint("gpt-oss", 2)
    norm = load_block_stack(folder, 0, 2, dtype=torch.bfloat16).blocks[0].attn_norm
    theirs = type(model.model.layers[0].input_layernorm)(64, norm.eps)
    theirs.weight.data = norm.weight.float()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(norm(x), theirs(x))
