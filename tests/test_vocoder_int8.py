"""The int8 vocoder recipe: which convolutions stay fp32, and the quantised graph."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import torch
from safetensors.torch import save_file

from recipes.default_voice.vocoder_int8 import fp32_nodes, quantize
from tests.test_hifigan import V1_TINY
from vocoder_service.backends import export_onnx
from vocoder_service.checkpoint import resolve_checkpoint
from vocoder_service.hifigan import Generator, HifiGanConfig

TINY = HifiGanConfig.from_dict(V1_TINY)


def _export(tmp_path):
    torch.manual_seed(0)
    g = Generator(TINY).remove_weight_norm()
    folder = tmp_path / "g"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in g.state_dict().items()},
        str(folder / "generator.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(TINY.to_dict()))
    return export_onnx(resolve_checkpoint(folder), tmp_path / "fp32.onnx")


def _weight_dequantized(model) -> dict[str, bool]:
    """Conv node -> whether its weight comes through a DequantizeLinear."""
    producers = {o: n for n in model.graph.node for o in n.output}
    return {
        n.name: producers.get(n.input[1]) is not None
        and producers[n.input[1]].op_type == "DequantizeLinear"
        for n in model.graph.node
        if n.op_type in ("Conv", "ConvTranspose")
    }


def test_the_last_stage_and_conv_post_stay_fp32(tmp_path):
    src = _export(tmp_path)
    model = onnx.load(str(src))
    keep = fp32_nodes(model, 4, 3, 1)
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    ups = [n.name for n in convs if n.op_type == "ConvTranspose"]
    assert ups[-1] in keep and not set(ups[:-1]) & set(keep)
    assert convs[-1].name in keep  # conv_post
    blocks = [n for n in keep if "resblocks." in n]
    assert blocks and all(int(n.split("resblocks.")[1].split("/")[0]) >= 9 for n in blocks)
    assert len(keep) == 1 + 3 * 3 * 2 + 1  # 3 blocks of 3 units of 2 convs
    assert fp32_nodes(model, 4, 3, 0) == []


def test_quantised_graph_runs_close_to_fp32(tmp_path):
    src = _export(tmp_path)
    rng = np.random.default_rng(0)
    calib = [(rng.standard_normal((1, 80, 40)) - 5).astype(np.float32) for _ in range(4)]
    out = quantize(src, tmp_path / "int8.onnx", calib, 4, 3, 1)
    model = onnx.load(str(out))
    keep = set(fp32_nodes(onnx.load(str(src)), 4, 3, 1))
    quantised = _weight_dequantized(model)
    assert quantised and all(v == (k not in keep) for k, v in quantised.items())
    mel = (rng.standard_normal((1, 80, 30)) - 5).astype(np.float32)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"mel": mel}
    )[0]
    want, got = run(src), run(out)
    assert got.shape == want.shape == (1, 30 * 256)
    snr = 10 * np.log10((want**2).sum() / ((got - want) ** 2).sum())
    assert snr > 25, snr
