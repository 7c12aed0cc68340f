"""Decode steps replayed from graphs captured once per batch size: CPU graphs.

A decode step of a small speech LM is mostly Python. The default voice's LM makes some 130
operator calls a step, each a few microseconds of work, from inside modules, kernel wrappers
and the step context: its forward took 1.0-1.5 ms where its operators' own time is about 0.4
(bench/README.md). CUDA graphs answer this on a GPU; here the step's operators are recorded
once per batch size and replayed as straight-line code.

Capture: for each batch size n in 1..max_seqs, the decode-only forward and the logits run once
on placeholder inputs under a dispatch-level recorder. Every operator the step reaches (aten
ones, views included, and the compiled kernels) becomes a node of a `torch.fx` graph whose
inputs are the step's tensors (token ids, positions, seq_lens, slot_mapping, a block table
padded to the longest sequence's width, state_indices). Every other tensor it touches must be
the model's own (weights, cache pools, rotary tables) or the context's fixed tensors of a
decode-only step of n sequences (query_start_loc, has_initial_state, logits_indices); they are
held by reference, so the cache pools are written in place as in an eager step.

A graph fixes whatever Python decided during its capture, so a capture is refused (and that
size runs eagerly) where the step read a tensor's values on the host (`.item()`, `.tolist()`,
`bool(t)`, a tensor built from Python data) or touched a tensor that is neither an input nor
the model's: either could differ on the next step. The step's other host decisions depend on
its shapes and dtypes alone, which a graph's inputs keep. Graphs are taken on CPU only; other
devices run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Iterator

import torch
from torch import Tensor, fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from text_service.context import Context, reset_context, set_context
from text_service.models.base import CausalLM
from text_service.models.cache import kv_pools, state_pools

log = logging.getLogger(__name__)

aten = torch.ops.aten
# Operators through which a step reads tensor values on the host (`.item()`, `bool(t)`,
# `.tolist()` and `.numpy()` resolve conjugate and negative bits first) or builds a tensor from
# Python data: a graph would keep the values of its capture.
_HOST_VALUE_OPS = frozenset(
    {
        aten.item,
        aten._local_scalar_dense,
        aten.is_nonzero,
        aten.equal,
        aten.resolve_conj,
        aten.resolve_neg,
        aten.lift_fresh,
        aten.lift_fresh_copy,
    }
)

INPUT_NAMES = (
    "input_ids",
    "positions",
    "seq_lens",
    "slot_mapping",
    "block_tables",
    "state_indices",
)


class CaptureRefused(Exception):
    """The step cannot be replayed from a graph (the reason says why); it runs eagerly."""


class _Recorder(TorchDispatchMode):
    """Runs each operator and appends it to `graph`, its tensor arguments resolved to the nodes
    that made them, to inputs, or to constants the model owns."""

    def __init__(
        self, graph: fx.Graph, root: nn.Module, nodes: dict[int, fx.Node], owned: dict[int, str]
    ):
        super().__init__()
        self.graph, self.root = graph, root
        self.nodes = nodes  # id(tensor) -> node that holds it at replay
        self.owned = owned  # id(tensor) -> name, for the tensors a graph may hold as constants
        self.seen: list[Tensor] = []  # every tensor met, kept alive so that ids stay unique
        self.refusal: str | None = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ to keep torch.compile out of
        # it, which imports torch._dynamo on the first call: 1-2 s of every service start. The
        # recorder never runs under torch.compile.
        return False

    def _node(self, t: Tensor) -> fx.Node:
        node = self.nodes.get(id(t))
        if node is None:
            if id(t) not in self.owned:
                self.refusal = self.refusal or (
                    f"the step touched a {tuple(t.shape)} {t.dtype} tensor that is neither an "
                    "input, the output of an operator in the step, nor the model's own"
                )
            attr = f"_c{len(self.nodes)}"
            setattr(self.root, attr, t)
            node = self.nodes[id(t)] = self.graph.get_attr(attr)
            self.seen.append(t)
        return node

    def _bind(self, out, node: fx.Node) -> None:
        if isinstance(out, Tensor):
            self.nodes[id(out)] = node
            self.seen.append(out)
        elif isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, Tensor):
                    self._bind(item, self.graph.call_function(operator.getitem, (node, i)))

    def _constant(self, t: Tensor) -> bool:
        node = self.nodes.get(id(t))
        return node.op == "get_attr" if node is not None else id(t) in self.owned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _HOST_VALUE_OPS:
            self.refusal = self.refusal or f"the step read tensor values on the host ({func})"
        out = func(*args, **kwargs)
        if not func._schema.is_mutable and isinstance(out, Tensor):
            # `.to` a dtype the tensor has hands back the tensor itself: no step at all
            if args and out is args[0]:
                return out
            # a view of the model's own tensors (a squeezed weight) is one more of them
            if func.is_view and all(self._constant(t) for t in _tensors(args, kwargs)):
                self.owned[id(out)] = f"a view by {func}"
                self.seen.append(out)
                return out
        node_args, node_kwargs = tree_map_only(Tensor, self._node, (args, kwargs))
        self._bind(out, self.graph.call_function(func, tuple(node_args), dict(node_kwargs)))
        return out


def _tensors(args, kwargs) -> list[Tensor]:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]


def _owned_tensors(model: nn.Module) -> dict[int, str]:
    """id -> name of every tensor the model holds: parameters, buffers and tensor attributes
    of its modules (packed weights, cache pools) and of the helpers they hold (rotary tables)."""
    owned: dict[int, str] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, Tensor):
                owned[id(value)] = f"{prefix}.{name}"
            elif not isinstance(value, nn.Module) and hasattr(value, "__dict__"):
                for inner, item in vars(value).items():
                    if isinstance(item, Tensor):
                        owned[id(item)] = f"{prefix}.{name}.{inner}"
        for name, value in (
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ):
            owned[id(value)] = f"{prefix}.{name}"
    return owned


@contextlib.contextmanager
def _restored(tensors: list[Tensor], rows: Tensor) -> Iterator[None]:
    """Put back rows `rows` of each tensor afterwards (a capture writes its placeholder tokens'
    KV and states into the pools)."""
    saved = [t[rows].clone() for t in tensors]
    try:
        yield
    finally:
        for t, s in zip(tensors, saved):
            t[rows] = s


class DecodeGraph:
    """One batch size's captured decode step: inputs in, fp32 logits out."""

    def __init__(self, module: fx.GraphModule, num_seqs: int, max_blocks: int):
        self.module = module
        self.num_seqs = num_seqs
        # the block table input, at the width the graph was taken with; a step's narrower table
        # is copied in, and columns past a sequence's length are never read
        self.block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)

    def __call__(self, input_ids: Tensor, positions: Tensor, ctx: Context) -> Tensor:
        tables = ctx.block_tables
        self.block_tables[:, : tables.shape[1]] = tables
        return self.module.forward(
            input_ids,
            positions,
            ctx.seq_lens,
            ctx.slot_mapping,
            self.block_tables,
            ctx.state_indices,
        )


def capture(
    model: CausalLM, num_seqs: int, *, block_size: int, num_kv_blocks: int, max_blocks: int
) -> DecodeGraph:
    """Record the decode-only step of `num_seqs` sequences (raises CaptureRefused).

    Placeholder sequence i decodes at position 0 into KV block i (modulo the pool) and state
    slot i; both are restored afterwards, so a capture leaves the pools as it found them.
    """
    n = num_seqs
    blocks = torch.arange(n) % num_kv_blocks
    inputs = {
        "input_ids": torch.zeros(n, dtype=torch.int64),
        "positions": torch.zeros(n, dtype=torch.int64),
        "seq_lens": torch.ones(n, dtype=torch.int32),
        "slot_mapping": blocks * block_size,
        "block_tables": torch.zeros(n, max_blocks, dtype=torch.int32),
        "state_indices": torch.arange(n),
    }
    inputs["block_tables"][:, 0] = blocks.to(torch.int32)
    # the context's fixed tensors for n decodes; host lists stay None, so a kernel that wants
    # them reads the tensors and the capture is refused
    ctx = Context(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=inputs["seq_lens"],
        slot_mapping=inputs["slot_mapping"],
        block_tables=inputs["block_tables"],
        state_indices=inputs["state_indices"],
        has_initial_state=torch.ones(n, dtype=torch.bool),
        num_decodes=n,
        logits_indices=torch.arange(n),
        all_slots_valid=True,
    )
    owned = _owned_tensors(model)
    for name in ("query_start_loc", "has_initial_state", "logits_indices"):
        owned[id(getattr(ctx, name))] = f"context.{name}"

    graph, root = fx.Graph(), nn.Module()
    nodes = {id(inputs[name]): graph.placeholder(name) for name in INPUT_NAMES}
    recorder = _Recorder(graph, root, nodes, owned)
    with (
        torch.inference_mode(),
        _restored(kv_pools(model), blocks),
        _restored(state_pools(model), inputs["state_indices"]),
    ):
        set_context(ctx)
        try:
            with recorder:
                logits = model.compute_logits(model(inputs["input_ids"], inputs["positions"]))
        finally:
            reset_context()
    if recorder.refusal is not None:
        raise CaptureRefused(recorder.refusal)
    graph.output(recorder.nodes[id(logits)])
    return DecodeGraph(fx.GraphModule(root, graph), n, max_blocks)


class DecodeGraphs:
    """The captured decode steps of one model, by batch size."""

    def __init__(self, graphs: dict[int, DecodeGraph]):
        self.graphs = graphs

    @classmethod
    def capture_all(
        cls,
        model: CausalLM,
        max_seqs: int,
        *,
        block_size: int,
        num_kv_blocks: int,
        max_blocks: int,
    ) -> DecodeGraphs:
        """Graphs for batch sizes 1..max_seqs; none at all where the first capture is refused."""
        graphs: dict[int, DecodeGraph] = {}
        for n in range(1, max_seqs + 1):
            try:
                graphs[n] = capture(
                    model,
                    n,
                    block_size=block_size,
                    num_kv_blocks=num_kv_blocks,
                    max_blocks=max_blocks,
                )
            except CaptureRefused as refused:
                log.warning("decode steps of %d sequences run eagerly: %s", n, refused)
                if n == 1:
                    break
        return cls(graphs)

    def get(self, num_seqs: int) -> DecodeGraph | None:
        return self.graphs.get(num_seqs)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.graphs)
