"""The vocoder in int8 through ONNX Runtime's static quantisation, judged by the voice.

    python -m recipes.default_voice.vocoder_int8 [--voice voices/default] [--count 100]

The generator's offline ONNX export is quantised in QDQ form: per-channel int8 weights and uint8
activations at the convolutions' inputs, ranges (MinMax) calibrated on decoded mels of the
voice's training sentences (`distill.py prepare` writes their codes). Only convolutions run in
int8: the sums and activations between them run in float, on values rounded to the 8-bit grid of
the convolutions that read them. The last `--fp32-stages` upsampling
stages and conv_post stay fp32, where the signal is closest to audio. Then fp32, the chosen
int8 and int8 of every convolution vocode the same natural held-out sentences offline on one
thread, scored as `vocoder_precision.py` scores (WER, DNSMOS, CPU s per audio s). One JSON
object on stdout (and `<cache>/vocoder_int8.json`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from recipes.default_voice.config import RecipeConfig

ROOT = Path(__file__).resolve().parents[2]


def fp32_nodes(model, num_stages: int, num_kernels: int, keep: int) -> list[str]:
    """Names of the convolution nodes of the last `keep` upsampling stages and conv_post, in the
    generator's export (its upsamplers are the ConvTranspose nodes in order, its residual
    blocks' nodes are named `.../resblocks.J/...`, conv_post is the last Conv)."""
    if keep <= 0:
        return []
    nodes = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    ups = [n.name for n in nodes if n.op_type == "ConvTranspose"]
    if len(ups) != num_stages:
        raise ValueError(f"expected {num_stages} ConvTranspose nodes, found {len(ups)}")
    first_block = (num_stages - keep) * num_kernels
    blocks = [
        n.name
        for n in nodes
        if "resblocks." in n.name
        and int(n.name.split("resblocks.")[1].split("/")[0]) >= first_block
    ]
    return ups[-keep:] + blocks + [nodes[-1].name]


def quantize(
    src: Path,
    out: Path,
    calibration: list[np.ndarray],
    num_stages: int,
    num_kernels: int,
    fp32_stages: int,
) -> Path:
    """Static QDQ quantisation of an offline generator export (`mel` in, `audio` out)."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.mels = iter(calibration)

        def get_next(self) -> dict | None:
            mel = next(self.mels, None)
            return None if mel is None else {"mel": mel}

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        keep = fp32_nodes(onnx.load(str(pre)), num_stages, num_kernels, fp32_stages)
        quantize_static(
            str(pre),
            str(out),
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Conv", "ConvTranspose"],
            nodes_to_exclude=keep,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    return out


def calibration_mels(voice: Path, codes: Path, count: int = 30, frames: int = 200) -> list:
    """Decoded mels `[1, num_mels, <= frames]` of `count` training utterances spread over the set."""
    import torch

    from recipes.default_voice.distill import utterance_codes
    from vocoder_service.token_decoder import load_token_decoder

    decoder = load_token_decoder(voice / "vocoder")
    if decoder is None:
        raise SystemExit(f"{voice} has no token decoder")
    utterances = utterance_codes(codes)
    picks = np.linspace(0, len(utterances) - 1, count).astype(int)
    out = []
    with torch.inference_mode():
        for k in picks:
            c = torch.from_numpy(utterances[k])
            out.append(decoder(c[None])[:, :, :frames].float().numpy())
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--voice", type=Path, default=ROOT / "voices" / "default")
    p.add_argument("--count", type=int, default=100, help="held-out sentences")
    p.add_argument("--codes", type=Path, default=RecipeConfig.cache / "distill" / "codes.npz")
    p.add_argument("--fp32-stages", type=int, default=1, help="last upsampling stages kept fp32")
    args = p.parse_args()

    import onnxruntime as ort
    import torch

    from recipes.default_voice.vocoder_precision import held_out_mels, score
    from vocoder_service.backends import export_onnx
    from vocoder_service.voice import load_voice

    torch.set_num_threads(1)
    checkpoint = load_voice(args.voice).generator
    config = checkpoint.config
    stages, kernels = len(config.upsample_rates), len(config.resblock_kernel_sizes)
    calibration = calibration_mels(args.voice, args.codes)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory() as tmp:
        src = export_onnx(checkpoint, Path(tmp) / "fp32.onnx")
        models = {"fp32 (onnxruntime)": src}
        for keep in dict.fromkeys((args.fp32_stages, 0)):
            stages_kept = f"last {keep} stages" if keep > 1 else "last stage"
            name = f"int8, {stages_kept} fp32" if keep else "int8, every conv"
            out = Path(tmp) / f"int8_{keep}.onnx"
            models[name] = quantize(src, out, calibration, stages, kernels, keep)
        sessions = {
            n: ort.InferenceSession(str(m), options, providers=["CPUExecutionProvider"])
            for n, m in models.items()
        }

        def vocoder(session):
            return lambda mel: session.run(None, {"mel": mel})[0].reshape(-1)

        texts, mels = held_out_mels(args.voice, args.count, RecipeConfig().seed)
        result = score({n: vocoder(s) for n, s in sessions.items()}, texts, mels)
    result["offline"] = True
    RecipeConfig.cache.mkdir(parents=True, exist_ok=True)
    (RecipeConfig.cache / "vocoder_int8.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
