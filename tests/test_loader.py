"""Loading HF safetensors checkpoints: sharding, tying, fused shards and clear mismatch errors."""

import json

import pytest
import torch
from hf_models import load_hf_model, make_tiny_model, tiny_config
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config

from text_service.hf_config import load_hf_config
from text_service.loader import WeightLoadError, expected_tensors, load_model
from text_service.models import build_model


def same_parameters(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def rewrite_checkpoint(path, edit) -> None:
    """Apply ``edit(dict of tensors)`` to a single-file checkpoint in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_needs_exactly_the_hf_state_dict(tmp_path, kind, tied):
    hf = load_hf_model(make_tiny_model(tmp_path, kind, tie_word_embeddings=tied))
    ours = build_model(tiny_config(kind, tie_word_embeddings=tied))
    hf_names = set(hf.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert set(expected_tensors(ours)) == hf_names


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single = make_tiny_model(tmp_path / "single", seed=5)
    sharded = make_tiny_model(tmp_path / "sharded", seed=5, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    same_parameters(load_model(sharded), load_model(single))


def test_fused_shards_and_untied_head_hold_checkpoint_tensors(tmp_path):
    path = make_tiny_model(tmp_path, tie_word_embeddings=False, seed=2)
    ckpt = load_file(path / "model.safetensors")
    model = load_model(path)
    mlp = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(
        mlp,
        torch.cat(
            [ckpt["model.layers.0.mlp.gate_proj.weight"], ckpt["model.layers.0.mlp.up_proj.weight"]]
        ),
    )
    gdn = model.model.layers[0].linear_attn.in_proj_qkvzba.weight
    parts = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
    assert torch.equal(
        gdn, torch.cat([ckpt[f"model.layers.0.linear_attn.{p}.weight"] for p in parts])
    )
    assert torch.equal(model.lm_head.weight, ckpt["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_model_has_no_head_and_ignores_a_redundant_one(tmp_path):
    path = make_tiny_model(tmp_path, tie_word_embeddings=True)
    rewrite_checkpoint(
        path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())
    )
    model = load_model(path)
    assert not hasattr(model, "lm_head")
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_extra_tensor_is_named(tmp_path):
    path = make_tiny_model(tmp_path)
    rewrite_checkpoint(
        path, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2))
    )
    with pytest.raises(
        WeightLoadError, match=r"does not use: model\.layers\.0\.mlp\.extra_proj\.weight"
    ):
        load_model(path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.norm.weight",
    ],
)
def test_missing_tensor_is_named(tmp_path, name):
    path = make_tiny_model(tmp_path)
    rewrite_checkpoint(path, lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match="lacks: " + name.replace(".", r"\.") + "$"):
        load_model(path)


def test_misshapen_tensor_is_named(tmp_path):
    path = make_tiny_model(tmp_path, "qwen3")
    rewrite_checkpoint(
        path, lambda t: t.__setitem__("model.layers.0.self_attn.v_proj.weight", torch.zeros(3, 64))
    )
    with pytest.raises(WeightLoadError, match=r"v_proj\.weight.*\(3, 64\)"):
        load_model(path)


def test_missing_checkpoint_files_are_reported(tmp_path):
    path = make_tiny_model(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)


@pytest.mark.parametrize("keep", [4, 100, "half"])
def test_truncated_checkpoint_is_a_load_error_naming_the_file(tmp_path, keep):
    path = make_tiny_model(tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    with pytest.raises(WeightLoadError, match=f"{weights} is not a readable safetensors file"):
        load_model(path)


def test_unsupported_model_type_is_rejected(tmp_path):
    config = tiny_config("qwen3")
    config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        load_model(tmp_path)


def test_image_text_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
    """model_type qwen3_5: text under model.language_model, vision and MTP tensors skipped, tie on top."""
    plain = make_tiny_model(tmp_path / "plain", tie_word_embeddings=True, seed=4)
    text = tiny_config("qwen3_5").to_dict()
    text["tie_word_embeddings"] = False
    out = tmp_path / "image_text"
    Qwen3_5Config(text_config=text, tie_word_embeddings=True).save_pretrained(out)
    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(plain / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, out / "model.safetensors")

    assert load_hf_config(out).tie_word_embeddings is True
    same_parameters(load_model(out), load_model(plain))
