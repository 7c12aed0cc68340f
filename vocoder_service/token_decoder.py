"""Speech tokens -> mel: a codebook lookup plus an optional residual conv net of bounded lookahead.

On disk (a voice's `vocoder/` folder): `token_decoder.json` and `token_decoder.safetensors`.
The JSON holds `codebook_size`, `num_mels`, `frames_per_token`, and for the conv net `channels`
and `layers` (a list of `{"kernel_size": k, "lookahead": r}`; an empty list means codebook only);
`lookahead` / `left_context` may be given and must then match the layers. Codebook rows are
frame-major: row = frame 0's `num_mels` values, then frame 1's, and so on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CONFIG_NAME = "token_decoder.json"
WEIGHTS_NAME = "token_decoder.safetensors"


@dataclass(frozen=True)
class ConvLayer:
    """One conv of the decoder: `kernel_size` taps, `lookahead` of them on future tokens."""

    kernel_size: int
    lookahead: int = 0

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or not 0 <= self.lookahead < self.kernel_size:
            raise ValueError(
                f"conv layer needs kernel_size >= 1 and 0 <= lookahead < kernel_size "
                f"(got kernel_size={self.kernel_size}, lookahead={self.lookahead})"
            )


@dataclass(frozen=True)
class TokenDecoderConfig:
    """Sizes of a token decoder (see module docstring for the file format)."""

    codebook_size: int
    num_mels: int = 80
    frames_per_token: int = 1
    channels: int = 256
    layers: tuple[ConvLayer, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.codebook_size < 1 or self.num_mels < 1 or self.channels < 1:
            raise ValueError("codebook_size, num_mels and channels must be positive")
        if self.frames_per_token not in (1, 2):
            raise ValueError(f"frames_per_token must be 1 or 2 (got {self.frames_per_token})")

    @property
    def lookahead(self) -> int:
        """Future tokens a token's mel depends on."""
        return sum(layer.lookahead for layer in self.layers)

    @property
    def left_context(self) -> int:
        """Past tokens a token's mel depends on."""
        return sum(layer.kernel_size - 1 - layer.lookahead for layer in self.layers)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenDecoderConfig:
        """Parse `token_decoder.json`; derived `lookahead`/`left_context`, if present, must match."""
        try:
            config = cls(
                codebook_size=int(data["codebook_size"]),
                num_mels=int(data.get("num_mels", 80)),
                frames_per_token=int(data.get("frames_per_token", 1)),
                channels=int(data.get("channels", 256)),
                layers=tuple(
                    ConvLayer(int(x["kernel_size"]), int(x.get("lookahead", 0)))
                    for x in data.get("layers", [])
                ),
            )
        except KeyError as exc:
            raise ValueError(f"token decoder config lacks {exc}") from None
        for key in ("lookahead", "left_context"):
            if key in data and int(data[key]) != getattr(config, key):
                raise ValueError(
                    f"token decoder config says {key}={data[key]} but its layers give "
                    f"{getattr(config, key)}"
                )
        return config

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = [asdict(x) for x in self.layers]
        out.update(lookahead=self.lookahead, left_context=self.left_context)
        return out


class TokenDecoder(nn.Module):
    """Codebook indices `[B, T]` -> log-mel `[B, num_mels, T * frames_per_token]`."""

    def __init__(self, config: TokenDecoderConfig):
        super().__init__()
        self.config = config
        dim = config.num_mels * config.frames_per_token
        self.codebook = nn.Parameter(torch.zeros(config.codebook_size, dim))
        self.convs = nn.ModuleList()
        for i, layer in enumerate(config.layers):
            self.convs.append(
                nn.Conv1d(dim if i == 0 else config.channels, config.channels, layer.kernel_size)
            )
        self.proj_out = nn.Conv1d(config.channels, dim, 1) if config.layers else None

    @property
    def lookahead(self) -> int:
        return self.config.lookahead

    @property
    def left_context(self) -> int:
        return self.config.left_context

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.codebook[codes].transpose(1, 2)  # [B, dim, T]
        if self.proj_out is not None:
            h = x
            for i, (conv, layer) in enumerate(zip(self.convs, self.config.layers)):
                # zero padding at the sequence ends, split between past and future taps
                y = conv(
                    F.pad(
                        h if i == 0 else F.gelu(h),
                        (layer.kernel_size - 1 - layer.lookahead, layer.lookahead),
                    )
                )
                h = y if i == 0 else h + y
            x = x + self.proj_out(F.gelu(h))
        b, _, t = x.shape
        fpt, n = self.config.frames_per_token, self.config.num_mels
        return x.reshape(b, fpt, n, t).permute(0, 2, 3, 1).reshape(b, n, t * fpt)

    def check_codes(self, codes: np.ndarray) -> np.ndarray:
        """Codes as int64; out-of-range ids raise ValueError."""
        codes = np.asarray(codes)
        if codes.size and not np.issubdtype(codes.dtype, np.integer):
            raise ValueError(f"speech tokens must be integers (got dtype {codes.dtype})")
        codes = codes.astype(np.int64)
        if codes.size and (codes.min() < 0 or codes.max() >= self.config.codebook_size):
            bad = codes[(codes < 0) | (codes >= self.config.codebook_size)][0]
            raise ValueError(
                f"speech token {bad} is outside the codebook [0, {self.config.codebook_size})"
            )
        return codes

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """One sequence of codes `[T]` -> mel `[num_mels, T * frames_per_token]` float32 numpy."""
        codes = self.check_codes(codes)
        with torch.inference_mode():
            return self(torch.from_numpy(codes)[None])[0].float().numpy()


def save_token_decoder(decoder: TokenDecoder, folder: str | Path) -> None:
    """Write `token_decoder.json` and `token_decoder.safetensors` into `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(decoder.config.to_dict(), indent=2) + "\n")
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in decoder.state_dict().items()},
        str(folder / WEIGHTS_NAME),
    )


def load_token_decoder(folder: str | Path) -> TokenDecoder | None:
    """Load from a voice's `vocoder/` folder; None when it holds no token decoder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not cfg_path.is_file():
        return None
    if not weights_path.is_file():
        raise FileNotFoundError(f"{cfg_path} exists but {weights_path} does not")
    config = TokenDecoderConfig.from_dict(json.loads(cfg_path.read_text()))
    decoder = TokenDecoder(config)
    sd = load_file(str(weights_path))
    try:
        result = decoder.load_state_dict(sd, strict=False)
    except RuntimeError as exc:
        raise ValueError(f"{weights_path} does not fit {cfg_path}: {exc}") from None
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{weights_path} does not fit {cfg_path}: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    return decoder.eval()
