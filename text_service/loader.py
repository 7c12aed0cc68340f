"""Load HF safetensors checkpoints (single file or sharded with an index) into our models."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from text_service.hf_config import load_hf_config
from text_service.models import CausalLM, build_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: unknown, missing or misshapen tensors."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index if it is sharded."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {absent}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every tensor of every shard, read lazily on the CPU."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (
            SafetensorError
        ) as e:  # truncated or not safetensors at all: a bad model, not a crash
            raise WeightLoadError(f"{path} is not a readable safetensors file ({e})") from None


def expected_tensors(model: CausalLM) -> dict[str, tuple[str, int | None]]:
    """Checkpoint tensor name -> (parameter name, shard index or None) for every tensor the model needs."""
    fused: dict[str, list[tuple[str, int]]] = {}
    for source, (target, shard) in model.packed_modules_mapping.items():
        fused.setdefault(target, []).append((source, shard))
    expected: dict[str, tuple[str, int | None]] = {}
    for param_name, _ in model.named_parameters():
        *prefix, module, leaf = param_name.split(".")
        if module in fused:
            for source, shard in fused[module]:
                expected[".".join([*prefix, source, leaf])] = (param_name, shard)
        else:
            expected[param_name] = (param_name, None)
    return expected


def _our_name(model: CausalLM, name: str) -> str | None:
    """The checkpoint name in our naming, or None for tensors the model deliberately skips."""
    for old, new in model.checkpoint_renames.items():
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if name.startswith(model.ignored_checkpoint_prefixes):
        return None
    if model.tie_word_embeddings and name == "lm_head.weight":
        return None  # tied: the LM head is the embedding matrix
    return name


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _checkpoint_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its parameter; raise WeightLoadError on any mismatch."""
    params = dict(model.named_parameters())
    expected = expected_tensors(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for ckpt_name, tensor in iter_checkpoint(model_dir):
            name = _our_name(model, ckpt_name)
            if name is None:
                continue
            if name not in expected:
                unexpected.append(ckpt_name)
                continue
            param_name, shard = expected[name]
            param = params[param_name]
            try:
                load = param.weight_loader  # type: ignore[attr-defined]  # set by the layer
                if shard is None:
                    load(param, tensor)
                else:
                    load(param, tensor, shard)
            except ValueError as e:
                raise WeightLoadError(
                    f"checkpoint tensor {ckpt_name!r} -> {param_name!r}: {e}"
                ) from None
            loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if unexpected or missing:
        problems = []
        if unexpected:
            problems.append(
                f"checkpoint tensors the model does not use: {_listing(sorted(unexpected))}"
            )
        if missing:
            problems.append(
                f"tensors the model needs but the checkpoint lacks: {_listing(missing)}"
            )
        raise WeightLoadError(
            f"checkpoint {model_dir} does not match {type(model).__name__}: " + "; ".join(problems)
        )


def load_model(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_positions: int | None = None,
) -> CausalLM:
    """Config, model and weights of an HF-format directory; dtype defaults to the checkpoint's."""
    config = load_hf_config(model_dir)
    if dtype is None:
        dtype = _checkpoint_dtype(config)
    model = build_model(config, device=device, dtype=dtype, max_positions=max_positions)
    load_weights(model, model_dir)
    return model
