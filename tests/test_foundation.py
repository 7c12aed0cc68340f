"""Foundation: package layout, generated contract, device selection, the `kernels` name clash."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_contract_is_current(tmp_path):
    sys.path.insert(0, str(ROOT / "protos"))
    try:
        from generate import generate
    finally:
        sys.path.pop(0)
    fresh = generate(tmp_path)
    for path in fresh:
        if path.suffix in (".py", ".pyi") and path.name != "__init__.py":
            installed = ROOT / path.relative_to(tmp_path)
            assert installed.read_text() == path.read_text(), (
                f"{installed} is stale: run `make protos`"
            )


def test_contract_names_match_design():
    from splittts.text.v1 import text_pb2
    from splittts.tts.v1 import tts_pb2
    from splittts.vocoder.v1 import vocoder_pb2

    tts = tts_pb2.DESCRIPTOR.services_by_name["TextToSpeech"]
    assert {m.name for m in tts.methods} == {"Synthesize", "StreamingSynthesize", "ListVoices"}
    assert tts.methods_by_name["StreamingSynthesize"].client_streaming
    assert tts.methods_by_name["Synthesize"].server_streaming
    text = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"]
    assert {m.name for m in text.methods} == {"Generate", "GetModelInfo"}
    voc = vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"]
    assert voc.methods_by_name["Vocode"].client_streaming
    assert voc.methods_by_name["Vocode"].server_streaming
    fields = set(tts_pb2.LatencyReport.DESCRIPTOR.fields_by_name)
    assert {
        "ttft_ms",
        "ttfa_ms",
        "queue_ms",
        "prefill_ms",
        "decode_ms",
        "vocoder_compute_ms",
        "hops",
        "rtf",
        "underruns",
        "audio_s",
    } <= fields
    assert set(tts_pb2.AudioEncoding.keys()) >= {"LINEAR16", "WAV", "FLAC", "OGG_OPUS"}


def test_every_proto_field_is_commented():
    """The contract documents every message field and RPC (a comment line directly above)."""
    for proto in (ROOT / "protos").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = (
                s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option"))
            )
            is_rpc = s.startswith("rpc ")
            if not (is_field or is_rpc) or "_UNSPECIFIED" in s:
                continue
            j = i - 1
            while (
                j >= 0
                and lines[j].strip().startswith("//") is False
                and (lines[j].strip().endswith(";") and "=" in lines[j])
            ):
                j -= 1  # a run of sibling fields may share one comment
            assert j >= 0 and lines[j].strip().startswith("//"), f"{proto.name}:{i + 1} {s}"


def test_hf_kernels_probe_stays_false():
    """Our top-level `kernels` package must not be mistaken for Hugging Face's `kernels`."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from transformers.utils.import_utils import is_kernels_available;"
            "print(is_kernels_available())",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_select_device():
    import torch

    from servicekit.device import parse_dtype, select_device

    assert select_device("auto").type in ("npu", "cuda", "cpu")
    assert select_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of"):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            select_device("cuda")
    with pytest.raises(ValueError, match="torch_npu"):
        select_device("npu")
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_dtype("int3")


def test_torch_npu_guard_without_cann():
    """With auto-loading off, torch imports even where torch_npu cannot load; auto picks cpu."""
    code = (
        "import servicekit.device as d, os; print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'],"
        " d.npu_available())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.split() == ["0", "False"]
