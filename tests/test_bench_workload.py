"""The engine benchmarks' FLOP floor: the weight multiplies a workload needs, as HF does them."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench.workload import MODEL_KINDS, Request, linear_parameters, projection_flops


def test_projection_flops_are_hf_weight_multiplies():
    """A prompt's prefill (logits of its last position only) and one decode step of HF's Qwen3
    make exactly the matrix products `projection_flops` counts for two generated tokens. On the
    meta device: the products are counted by their shapes, and no memory is touched."""
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**MODEL_KINDS["qwen3"])).eval()
    prompt = list(range(3, 10))
    with torch.no_grad(), FlopCounterMode(display=False) as counter, torch.device("meta"):
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        model(torch.tensor([[5]]), cache=out.cache, use_cache=True)
    counts = counter.get_flop_counts()["Global"]
    products = sum(n for op, n in counts.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert products > 0
    assert products == projection_flops("qwen3", [Request(prompt, max_tokens=2)])


def test_linear_parameters_split_the_model():
    body, head = linear_parameters("qwen3")
    kind = MODEL_KINDS["qwen3"]
    assert head == kind["vocab_size"] * kind["hidden_size"]
    hidden, inner, layers = (
        kind["hidden_size"],
        kind["intermediate_size"],
        kind["num_hidden_layers"],
    )
    q = kind["num_attention_heads"] * kind["head_dim"]
    kv = kind["num_key_value_heads"] * kind["head_dim"]
    assert body == layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * inner)
