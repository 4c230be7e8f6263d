"""Spec validation: every error names the file, the field and what is allowed; nothing is generated from a bad spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bloombee.models import families, family_for_model_type
from bloombee.models.codegen import SPECS_DIR, render_all
from bloombee.models.spec import SpecError, load_spec


def _write(tmp_path: Path, mutate, name="llama") -> Path:
    data = yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text())
    mutate(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_committed_specs_are_valid():
    for path in sorted(SPECS_DIR.glob("*.yaml")):
        assert load_spec(path).family == path.stem


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.update(colour="blue"), r"unknown field 'colour'; allowed fields here: family, model_types"),
    (lambda d: d["features"].update(flash=True), r"unknown field 'features.flash'; allowed fields here: rotary"),
    (lambda d: d.pop("config_class"), r"missing required field 'config_class'"),
    (lambda d: d["features"].pop("qk_norm"), r"missing required field 'features.qk_norm'"),
    (lambda d: d["features"].update(rotary="maybe"), r"field 'features.rotary': Input should be a valid boolean"),
    (lambda d: d.update(model_types="llama"), r"field 'model_types': Input should be a valid list"),
    (lambda d: d["classes"].update(attention="FlashAttention"),
     r"field 'classes.attention': attention class 'FlashAttention' is not allowed; allowed: Attention, "
     r"FusedQKVAttention"),
    (lambda d: d["classes"].update(mlp="SwiGLU"), r"MLP class 'SwiGLU' is not allowed; allowed: FusedGatedMLP, GatedMLP, GeluMLP"),
    (lambda d: d["classes"].update(norm="BatchNorm"), r"norm class 'BatchNorm' is not allowed; allowed: Float32RMSNorm, LayerNorm"),
    (lambda d: d.update(config_class="NoSuchConfig"), r"field 'config_class': 'NoSuchConfig' is not a class"),
    (lambda d: d.update(config_adapter="magic"), r"config adapter 'magic' is not allowed; allowed: bloom, deepseek, falcon, sparse_moe, standard"),
    (lambda d: d["config_fields"].update(rope_theta="rope_theta"),
     r"field 'config_fields': block config field 'rope_theta' is not allowed; allowed: "),
    (lambda d: d["weights"].update(block_prefix="model.layers."), r"'weights.block_prefix'.*must contain"),
    (lambda d: d["weights"]["block"].update({"foo.": "bar."}), r"target must start with one of the block modules"),
    (lambda d: d["weights"]["head"].update({"x.": "pooler."}), r"'pooler.' is not allowed; allowed: embed_norm., embed_tokens."),
    (lambda d: d.update(dht_prefix="{name}.v1"), r"field 'dht_prefix'.*no '\.'"),
    (lambda d: d["features"].update(mixture_of_experts=True), r"mixture_of_experts must be true exactly when"),
    (lambda d: d["features"].update(sliding_window=True), r"sliding_window must be true exactly when"),
    (lambda d: d["features"].update(alibi=True), r"features.alibi and features.rotary exclude each other"),
    (lambda d: d["features"].update(embedding_norm=True), r"embedding_norm must be true exactly when weights.head"),
    (lambda d: d.update(family="llama2"), r"field 'family': 'llama2' must equal the file name"),
])
def test_spec_errors_name_file_field_and_allowed(tmp_path, mutate, expected):
    path = _write(tmp_path, mutate)
    with pytest.raises(SpecError, match=expected) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_bad_spec_blocks_all_generation(tmp_path):
    for path in SPECS_DIR.glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text())
    _write(tmp_path, lambda d: d["classes"].update(norm="Nope"), name="qwen3")
    with pytest.raises(SpecError, match="qwen3.yaml"):
        render_all(tmp_path)


def test_not_yaml_mapping(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(path)


def test_registry_maps_model_types():
    assert set(families()) == {p.stem for p in SPECS_DIR.glob("*.yaml")}
    for model_type, family in [("llama", "llama"), ("mistral", "mistral"), ("qwen3", "qwen3"),
                               ("mixtral", "mixtral"), ("falcon", "falcon"), ("bloom", "bloom")]:
        assert family_for_model_type(model_type).name == family
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; supported model types: bloom, deepseek_v3, falcon"):
        family_for_model_type("gpt2")
