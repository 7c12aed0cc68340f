"""A stream's input side: mel frames (or speech tokens decoded to them) and when each arrived."""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from vocoder_service.hifigan import HifiGanConfig
from vocoder_service.token_decoder import TokenDecoder


class StreamInput:
    """Holds the mel frames that jobs still need, decodes tokens lazily, and remembers when the
    input that made each frame count available arrived (for latency accounting)."""

    def __init__(self, config: HifiGanConfig, token_decoder: TokenDecoder | None = None):
        if token_decoder is not None and token_decoder.config.num_mels != config.num_mels:
            raise ValueError(
                f"token decoder makes {token_decoder.config.num_mels} mels but the "
                f"generator takes {config.num_mels}"
            )
        self.num_mels = config.num_mels
        self.token_decoder = token_decoder
        self._mel = np.zeros((config.num_mels, 0), np.float32)
        self._mel_base = 0  # absolute frame index of self._mel[:, 0]
        self.frames_received = 0  # frames decoded or pushed so far
        self._tokens = np.zeros(0, np.int64)
        self._tok_base = 0  # absolute index of self._tokens[0]
        self.tokens_received = 0
        self._tok_decoded = 0
        self._arrivals: deque[tuple[int, float]] = deque()  # (frames available, time)
        self.ended = False
        self.flushed_at = 0.0
        self.boundary_frames = 0  # frames that go out without waiting for right context
        self._boundary_tokens = 0

    @property
    def frames_total(self) -> int:
        """Frames the input received so far makes, tokens not yet decoded included."""
        if self.token_decoder is not None:
            return self.tokens_received * self.token_decoder.config.frames_per_token
        return self.frames_received

    def push_mel(self, mel: np.ndarray | torch.Tensor) -> None:
        """Append log-mel frames `[num_mels, frames]`."""
        if self.token_decoder is not None:
            raise ValueError("this stream takes speech tokens, not mel frames")
        self._check_open()
        mel = np.asarray(
            mel.detach().cpu() if isinstance(mel, torch.Tensor) else mel, dtype=np.float32
        )
        if mel.ndim != 2 or mel.shape[0] != self.num_mels:
            raise ValueError(f"mel chunk must be [{self.num_mels}, frames] (got {mel.shape})")
        if not np.isfinite(mel).all():
            raise ValueError("mel chunk holds NaN or infinite values")
        self._append_mel(mel)
        self._note_arrival(self.frames_received)

    def push_tokens(self, codes: np.ndarray | list[int]) -> None:
        """Append speech-token codebook indices (decoded to mel by `decode`)."""
        if self.token_decoder is None:
            raise ValueError(
                "this stream takes mel frames; load a voice with a token decoder for tokens"
            )
        self._check_open()
        codes = self.token_decoder.check_codes(np.asarray(codes).reshape(-1))
        self._tokens = np.concatenate([self._tokens, codes])
        self.tokens_received += codes.size
        decodable = max(0, self.tokens_received - self.token_decoder.lookahead)
        self._note_arrival(decodable * self.token_decoder.config.frames_per_token)

    def flush(self) -> None:
        """End of input: every token can be decoded without lookahead."""
        self.ended = True
        self.flushed_at = time.perf_counter()
        self._note_arrival(self.frames_total)

    def mark_boundary(self) -> None:
        """Everything received so far goes out without waiting for right context."""
        self._check_open()
        if self.token_decoder is not None:
            self._boundary_tokens = self.tokens_received
            self.decode()
        self.boundary_frames = self.frames_received
        self._note_arrival(self.frames_received)

    def decodable_frames(self) -> int:
        """Frames available once `decode` runs, judged from counts alone."""
        dec = self.token_decoder
        if dec is None or self.ended:
            return self.frames_total
        decodable = max(self.tokens_received - dec.lookahead, self._boundary_tokens)
        return decodable * dec.config.frames_per_token

    def decode(self) -> None:
        """Decode the tokens whose lookahead has arrived into mel frames."""
        dec = self.token_decoder
        if dec is None:
            return
        end = (
            self.tokens_received
            if self.ended
            else max(self.tokens_received - dec.lookahead, self._boundary_tokens)
        )
        a = self._tok_decoded
        if end <= a:
            return
        ws = max(0, a - dec.left_context)
        we = min(self.tokens_received, end + dec.lookahead)
        window = self._tokens[ws - self._tok_base : we - self._tok_base]
        with torch.inference_mode():
            mel = dec(torch.from_numpy(window)[None])[0].float().numpy()
        fpt = dec.config.frames_per_token
        self._append_mel(mel[:, (a - ws) * fpt : (end - ws) * fpt])
        self._tok_decoded = end
        keep_from = max(0, end - dec.left_context)  # tokens older than this are never read again
        self._tokens = self._tokens[keep_from - self._tok_base :]
        self._tok_base = keep_from

    def frames(self, start: int, end: int) -> np.ndarray:
        """Mel frames [start, end) (absolute indices; none before the last `release`)."""
        return self._mel[:, start - self._mel_base : end - self._mel_base]

    def release(self, before: int) -> None:
        """Frames before `before` are never read again."""
        self._mel = self._mel[:, before - self._mel_base :]
        self._mel_base = before

    def ready_time(self, frames_needed: int) -> float:
        """When the input that made `frames_needed` frames available arrived."""
        if self.ended and frames_needed > self._arrivals[-1][0]:
            return self.flushed_at  # only the end of stream made these ready
        while len(self._arrivals) > 1 and self._arrivals[0][0] < frames_needed:
            self._arrivals.popleft()  # later jobs need at least as many frames
        return self._arrivals[0][1]

    def _check_open(self) -> None:
        if self.ended:
            raise ValueError("the stream was flushed; no more input is accepted")

    def _note_arrival(self, frames_available: int) -> None:
        if not self._arrivals or frames_available > self._arrivals[-1][0]:
            self._arrivals.append((frames_available, time.perf_counter()))

    def _append_mel(self, mel: np.ndarray) -> None:
        self._mel = np.concatenate([self._mel, mel], axis=1)
        self.frames_received += mel.shape[1]
