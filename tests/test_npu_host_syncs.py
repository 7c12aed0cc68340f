"""Device-to-host reads per engine step on the NPU path, run on CPU through a torch_npu STAND-IN.

Not a hardware test. The stand-in's tensors live on the CPU, so a copy cannot be seen as a
transfer; instead a TorchFunctionMode counts the tensor calls that on a device make the host
wait for it: reading values (`tolist`, `item`, `bool`/`int`/`float`/index use, `numpy`), moving
to the host (`cpu()`, `.to("cpu")`) and ops whose output size depends on values (`nonzero`,
boolean-mask indexing, `repeat_interleave` without `output_size`). Calls inside the stand-in's
torch_npu functions are not counted: on a device they are the kernels themselves.
"""

import dataclasses
import sys

import pytest
import torch
from hf_models import make_tiny_model
from torch.overrides import TorchFunctionMode

import kernels
import kernels.ops
from tests import torch_npu_standin as standin
from text_service.engine import EngineArgs, LLMEngine
from text_service.sampling_params import SamplingParams

_READS = {
    "tolist",
    "item",
    "numpy",
    "cpu",
    "nonzero",
    "masked_select",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
}
_MASKED = {"__getitem__", "__setitem__", "index_put_", "index_put"}
# head sizes, block size and dtype inside the torch_npu operations' documented constraints, so
# that every op runs the stand-in and none falls back to the reference
KINDS = {
    "qwen3_5": dict(head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128),
    "qwen3": dict(head_dim=128),
}
NPU_OPS = {"npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "_npu_paged_attention"}
NPU_DELTA_OPS = {"npu_chunk_gated_delta_rule", "npu_recurrent_gated_delta_rule"}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _has_bool_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, (tuple, list)):
        return any(_has_bool_tensor(v) for v in value)
    return False


class HostReads(TorchFunctionMode):
    """Records the tensor calls that read device values back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and self._reads_back(func, args, kwargs):
            self.reads.append(func.__name__)
        return func(*args, **kwargs)

    @staticmethod
    def _reads_back(func, args, kwargs) -> bool:
        name = getattr(func, "__name__", "")
        if name in _READS:
            return True
        if name in _MASKED:  # a boolean mask: the result's size is its count of True
            return len(args) > 1 and _has_bool_tensor(args[1])
        if name == "to":  # an explicit move to the host
            return any(isinstance(a, str) and a == "cpu" for a in (*args[1:], kwargs.get("device")))
        if name == "repeat_interleave":  # tensor repeats: the output size is their sum
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        return False


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch):
    """NPU ops on the stand-in as the ops of device "cpu", and a HostReads deaf inside them."""
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    monkeypatch.setattr(kernels.ops, "_chosen", {})
    npu = kernels.get_ops("npu")
    monkeypatch.setattr(kernels.ops, "_chosen", {"cpu": npu})
    standin.calls.clear()
    counter = HostReads()

    def deaf(fn):
        def call(*args, **kwargs):
            counter.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.paused -= 1

        return call

    for name in NPU_OPS | NPU_DELTA_OPS | {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul"}:
        monkeypatch.setattr(standin, name, deaf(getattr(standin, name)))
    return counter


@pytest.fixture(scope="module", params=sorted(KINDS))
def model_dir(request, tmp_path_factory):
    return request.param, make_tiny_model(
        tmp_path_factory.mktemp(request.param), request.param, **KINDS[request.param]
    )


def _engine(path) -> LLMEngine:
    return LLMEngine(
        EngineArgs(
            model=str(path),
            device="cpu",
            dtype="bfloat16",
            block_size=128,
            kv_cache_memory_bytes=1 << 24,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            enable_prefix_caching=False,
        )
    )


def _steps(engine: LLMEngine, counter: HostReads, strip_host_metadata: bool = False):
    """(num_decodes, num_seqs, host reads) of each step: a prefill, then a 40-token prompt in
    chunks alongside the first one's decodes, then decodes alone."""
    runner, steps = engine.runner, []
    prepare = runner._prepare

    def recording(*args, **kwargs):
        ids, positions, ctx = prepare(*args, **kwargs)
        if strip_host_metadata:
            ctx = dataclasses.replace(
                ctx, query_start_loc_list=None, seq_lens_list=None, all_slots_valid=None
            )
        steps.append([ctx.num_decodes, ctx.num_seqs])
        return ids, positions, ctx

    runner._prepare = recording
    engine.add_request("a", list(range(1, 21)), GREEDY)
    step = 0
    while engine.has_unfinished_requests():
        if step == 1:
            engine.add_request("b", list(range(30, 70)), GREEDY)
        counter.reads.clear()
        with counter:
            engine.step()
        steps[-1].append(list(counter.reads))
        step += 1
    return steps


def test_counter_counts_a_deliberate_read(host_reads) -> None:
    t = torch.arange(4)
    with host_reads:
        t.tolist()
        bool(t[0])
        t.to("cpu")
        t[t > 1]
        t + 1  # stays on the device
    assert host_reads.reads == ["tolist", "__bool__", "to", "__getitem__"]


def test_each_step_reads_back_only_the_sampled_tokens(host_reads, model_dir) -> None:
    kind, path = model_dir
    steps = _steps(_engine(path), host_reads)
    expected_ops = NPU_OPS | (NPU_DELTA_OPS if kind == "qwen3_5" else set())
    assert expected_ops <= set(standin.calls), "a kernel fell back to the reference"
    kinds = {"prefill" if nd == 0 else "decode" if nd == n else "mixed" for nd, n, _ in steps}
    assert kinds == {"prefill", "mixed", "decode"}
    for num_decodes, num_seqs, reads in steps:
        assert reads == ["tolist"], (num_decodes, num_seqs, reads)  # the sampler's token ids


def test_without_host_metadata_the_layers_read_back(host_reads, model_dir) -> None:
    # The same steps with the Context's host copies removed: the kernels read the device, and
    # the counter sees those reads (so the test above would catch them coming back).
    _, path = model_dir
    steps = _steps(_engine(path), host_reads, strip_host_metadata=True)
    for _, _, reads in steps:
        assert len(reads) > 1
    assert {"__bool__", "tolist", "to"} <= {r for _, _, reads in steps for r in reads}
