"""Layer decomposition shared by the time and memory predictors.

`decompose(model, shape, precision)` runs one forward pass of the model on *fake* tensors
(`torch._subclasses.FakeTensorMode`: shapes and dtypes only, no data, no memory) and attributes every
aten op to the innermost module that issued it.  Each module that owns parameters or ops becomes a
`LayerRecord`: its kind, parameter count, forward/backward FLOPs and bytes moved, and the bytes of
the tensors autograd saves for backward, per dtype.  Multimodal models are traced stage by stage
(vision tower, projector, language model) so no stage needs data-dependent ops.

FLOP conventions (the hand-checked ones in the tests):
  * matmul `mm/addmm [m,k]x[k,n]` = 2*m*k*n; `bmm/baddbmm` = 2*b*m*k*n
  * convolution = 2 * output elements * (C_in / groups) * prod(kernel)
  * fused attention (SDPA) = 4 * b * heads * s_q * s_k * d  (QK^T and PV)
  * other non-view ops: one FLOP per output element
  * backward = 2x forward for matmul/conv/attention ops, 1x for the others
Bytes moved per op = bytes of its tensor inputs + outputs (views move nothing; a lookup such as
`embedding` reads only the selected rows); backward moves 2x.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .kernels import kernel_spec
from .zoo import Shape, ZooModel

log = logging.getLogger(__name__)

__all__ = [
    "KINDS",
    "PRECISIONS",
    "Decomposition",
    "LayerRecord",
    "OP_CLASSES",
    "classify",
    "decompose",
    "op_class",
    "op_flops",
    "precision_setup",
]

PRECISIONS = ("fp32", "bf16", "fp16", "mixed")
"""fp32; bf16 = pure bf16 weights and optimizer; fp16 = fp16 autocast + grad scaler over fp32 weights;
mixed = bf16 autocast over fp32 master weights."""

KINDS = (
    "linear",
    "conv",
    "embedding",
    "norm",
    "activation",
    "attention",
    "dropout",
    "rotary",
    "experts",
    "router",
    "container",
    "loss",
    "unknown",
)

_VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "transpose",
    "permute",
    "t",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "detach",
    "alias",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "narrow",
    "lift_fresh",
    "_reshape_alias",
    "expand_as",
    "view_as",
    "unflatten",
    "flatten",
    "contiguous",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "dim",
    "is_same_size",
    "_local_scalar_dense",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
}
_SDPA_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "scaled_dot_product_attention",
}
_GATHER_OPS = {"embedding", "index_select", "index", "gather"}
_GROUPED_MM_OPS = {"_grouped_mm", "grouped_mm"}
_HEAVY = {"mm", "addmm", "bmm", "baddbmm", "convolution", *_SDPA_OPS, *_GROUPED_MM_OPS}
_CAST_OPS = {"_to_copy", "to", "copy_", "_autocast_to_reduced_precision", "_autocast_to_full_precision"}
_SCATTER_OPS = {
    "index_add",
    "index_add_",
    "scatter",
    "scatter_",
    "scatter_add",
    "scatter_add_",
    "index_put",
    "index_put_",
}
_SELECT_OPS = {"nonzero", "where", "one_hot", "topk", "sort", "argsort", "bincount", "histc", "cumsum", "unique"}
OP_CLASSES = ("matmul", "sdpa", "experts", "gather", "scatter", "select", "cast", "other")
"""Op classes of `Decomposition.op_mix`: dense matmuls/convolutions, fused attention, grouped
(routed-experts) matmuls, gathers/lookups, scatters, data-dependent selection (top-k, nonzero,
where: routing bookkeeping), dtype casts, and every other non-view op."""
ROUTINGS = ("balanced", "worst")
"""Token routing assumed for mixture-of-experts layers while tracing (see `decompose`)."""

_KIND_PATTERNS = [
    ("rotary", re.compile(r"Rotary")),
    ("experts", re.compile(r"Experts$|ExpertList$")),
    ("router", re.compile(r"Router$")),
    ("attention", re.compile(r"Attention$|Attn$|SelfAttention|SdpaAttention")),
    ("linear", re.compile(r"^(Linear|Conv1D|NonDynamicallyQuantizableLinear|LazyLinear)$")),
    ("conv", re.compile(r"^(Conv[123]d|ConvTranspose[123]d)$")),
    ("embedding", re.compile(r"^Embedding$|PatchEmbed|Embeddings?$")),
    ("norm", re.compile(r"Norm(2d)?$|RMSNorm|LayerNorm|GroupNorm|BatchNorm")),
    (
        "activation",
        re.compile(r"GELU|SiLU|ReLU|Tanh|Sigmoid|Activation$|QuickGELU|Mish|Softmax$|^Identity$|LayerScale$"),
    ),
    ("dropout", re.compile(r"Dropout")),
    (
        "container",
        re.compile(
            r"(Layer|Block|Model|MLP|Mlp|Encoder|Decoder|Projector|Merger|Pooler|Head|Output|Intermediate|Classifier"
            r"|ForCausalLM|LMHeadModel|ForConditionalGeneration|ForImageClassification|ModuleList|Sequential"
            r"|Transformer)$"
        ),
    ),
]


def classify(module_or_name: nn.Module | str) -> str:
    """The layer kind of a module class ('linear', 'attention', ...; 'unknown' if unrecognized)."""
    name = module_or_name if isinstance(module_or_name, str) else type(module_or_name).__name__
    if name == "<loss>":
        return "loss"
    for kind, pat in _KIND_PATTERNS:
        if pat.search(name):
            return kind
    return "unknown"


def _numel(shape: Iterable[int]) -> int:
    return int(math.prod(int(s) for s in shape))


def op_flops(name: str, args: tuple, out: Any) -> int:
    """Forward FLOPs of one aten op from its argument shapes (see module docstring)."""
    if name in _VIEW_OPS:
        return 0
    if name == "mm":
        (m, k), n = args[0].shape, args[1].shape[1]
        return 2 * m * k * n
    if name == "addmm":
        (m, k), n = args[1].shape, args[2].shape[1]
        return 2 * m * k * n
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        bs, m, k = a.shape
        return 2 * bs * m * k * b.shape[2]
    if name == "convolution":
        w = args[1]
        outs = out[0] if isinstance(out, (tuple, list)) else out
        return 2 * outs.numel() * w.shape[1] * _numel(w.shape[2:])
    if name in _GROUPED_MM_OPS:  # routed experts: [S, K] x [E, K, N] with per-expert row offsets
        a, b = args[0], args[1]
        return 2 * _numel(a.shape) * b.shape[-1]
    if name in _SDPA_OPS:
        q, k = args[0], args[1]
        *lead, sq, d = q.shape
        return 4 * _numel(lead) * sq * k.shape[-2] * d
    return sum(t.numel() for t in _tensors(out))


def _mm_shape(name: str, args: tuple) -> tuple[int, int, int, int] | None:
    """(batch, m, k, n) of a dense matmul op, None for any other op."""
    if name in ("mm", "addmm"):
        a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
        return 1, int(a.shape[0]), int(a.shape[1]), int(b.shape[1])
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return int(a.shape[0]), int(a.shape[1]), int(a.shape[2]), int(b.shape[2])
    return None


def op_class(name: str) -> str:
    """The `OP_CLASSES` entry of an aten op name."""
    if name in _GROUPED_MM_OPS:
        return "experts"
    if name in _SDPA_OPS:
        return "sdpa"
    if name in _HEAVY:
        return "matmul"
    if name in _GATHER_OPS:
        return "gather"
    if name in _SCATTER_OPS:
        return "scatter"
    if name in _SELECT_OPS:
        return "select"
    if name in _CAST_OPS:
        return "cast"
    return "other"


def _op_dtype(name: str, args: tuple, outs: list) -> str:
    """The dtype an op computed in: its first floating input for matmuls (the output of a cast), else
    its first floating output; 'int' for integer-only bookkeeping."""
    cand = _tensors(list(args)) if name in _HEAVY else outs
    for t in cand:
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "int"


def _tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass
class LayerRecord:
    """One layer of the decomposition (a module that owns parameters or issues ops directly)."""

    name: str
    cls: str
    kind: str
    stage: str
    block: str
    order: int
    params: int = 0
    param_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    saved_bytes: dict = dataclasses.field(default_factory=dict)
    max_out_bytes: int = 0
    in_bytes: int = 0
    out_bytes: int = 0
    ops: int = 0

    @property
    def saved_total(self) -> int:
        return int(sum(self.saved_bytes.values()))

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["saved_total"] = self.saved_total
        return d


@dataclasses.dataclass
class Decomposition:
    """The per-layer records of one model at one shape and precision."""

    model: str
    family: str
    modality: str
    shape: Shape
    precision: str
    records: list[LayerRecord]
    unknown: collections.Counter
    param_dtype_bytes: int
    compute_dtype_bytes: int
    held_output_bytes: int
    input_bytes: int
    largest_param_bytes: int
    tokens: int
    buffer_bytes: int = 0
    op_mix: dict = dataclasses.field(default_factory=dict)
    """Forward work by op class and the dtype the op actually ran at (autocast casts matmuls but
    not, e.g., grouped expert matmuls or norms): keys "<class>_<quantity>:<dtype>" with class in
    `OP_CLASSES` and quantity count/flops/bytes; see `op_class`."""
    matmul_shapes: dict = dataclasses.field(default_factory=dict)
    """Forward dense matmuls by "dtype:batch:m:k:n" -> count (mm/addmm with batch 1, bmm/baddbmm),
    so a kernel's speed measured on this machine at each shape can be looked up."""
    kernel_calls: dict = dataclasses.field(default_factory=dict)
    """Forward matmuls, convolutions and fused attention as replayable specs (`kernels.kernel_spec`)
    -> count, so each can be timed on this machine at its exact shape and dtype."""

    @property
    def params(self) -> int:
        return sum(r.params for r in self.records)

    @property
    def param_bytes(self) -> int:
        return sum(r.param_bytes for r in self.records)

    @property
    def fwd_flops(self) -> int:
        return sum(r.fwd_flops for r in self.records)

    @property
    def bwd_flops(self) -> int:
        return sum(r.bwd_flops for r in self.records)

    @property
    def saved_bytes(self) -> int:
        return sum(r.saved_total for r in self.records)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Sums of the numeric fields per layer kind (the time predictor's features)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            d = out.setdefault(r.kind, collections.defaultdict(float))
            d["count"] += 1
            d["params"] += r.params
            d["fwd_flops"] += r.fwd_flops
            d["bwd_flops"] += r.bwd_flops
            d["fwd_bytes"] += r.fwd_bytes
            d["bwd_bytes"] += r.bwd_bytes
            d["saved_bytes"] += r.saved_total
        return {k: dict(v) for k, v in out.items()}

    def saved_by_dtype(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for r in self.records:
            out.update(r.saved_bytes)
        return dict(out)

    def summary(self) -> dict:
        return {
            "model": self.model,
            "shape": dataclasses.asdict(self.shape),
            "precision": self.precision,
            "layers": len(self.records),
            "params": self.params,
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "saved_bytes": self.saved_bytes,
            "saved_by_dtype": self.saved_by_dtype(),
            "buffer_bytes": self.buffer_bytes,
            "unknown_kinds": dict(self.unknown),
        }


def precision_setup(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(parameter dtype, autocast dtype or None) of a precision setting."""
    if precision == "fp32":
        return torch.float32, None
    if precision == "bf16":
        return torch.bfloat16, None
    if precision == "fp16":
        return torch.float32, torch.float16
    if precision == "mixed":
        return torch.float32, torch.bfloat16
    raise ValueError(f"precision: {precision!r} is not known; use one of {list(PRECISIONS)}")


_BLOCK_RE = re.compile(r"^(.*?\.(?:layers|layer|h|blocks)\.\d+)(?:\.|$)")


def _block_of(name: str) -> str:
    m = _BLOCK_RE.match(name)
    return m.group(1) if m else ""


class _Tracer(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, owner: _Trace):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = _tensors([list(args), kwargs])
        if flat and not any(isinstance(t, FakeTensor) for t in flat):
            # only real tensors in: integer buffers (expert offsets) and the assumed routing; the
            # control flow of routed experts reads their values, so run these small ops for real
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        elif name in _GROUPED_MM_OPS:
            out = _grouped_mm_out(func, args, kwargs)
        elif name == "index" and any(_real_bool(i) for i in args[1]):
            # a fake tensor selected by a real boolean mask (image placeholders): the mask's values
            # are known, so index by its positions instead of a data-dependent nonzero on fake data
            with unset_fake_temporarily():
                idx = [i.nonzero(as_tuple=True) if _real_bool(i) else (i,) for i in args[1]]
            out = func(args[0], [j for group in idx for j in group], *args[2:], **kwargs)
        else:
            out = func(*args, **kwargs)
            if not flat and _tensors(out) and not any(t.is_floating_point() for t in _tensors(out)):
                # an integer factory (arange of positions, a token-id constant): real, so integer
                # bookkeeping derived from real ids (3-D rotary positions) stays computable
                with unset_fake_temporarily():
                    out = func(*args, **kwargs)
        self.owner.on_op(name, args, out, kwargs)
        return out


def _real_bool(t: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.dtype == torch.bool


def _grouped_mm_out(func, args: tuple, kwargs: dict):
    """Output of a grouped matmul on fake tensors.  Its meta kernel accepts bf16 only (the CUDA
    kernel's rule) while the CPU kernel also runs fp32/fp16, so for other dtypes the shape is inferred
    here: [S, K] x [E, K, N] -> [S, N]; [E, M, K] x [E, K, N] -> [E, M, N];
    [M, K] x [K, N] split by offsets -> [E, M, N]."""
    a, b = args[0], args[1]
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    dtype = kwargs.get("out_dtype") or a.dtype
    shape: tuple[int, ...]
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:  # [E, M, K] x [K, N] split by offsets over M
        shape = (a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=dtype, device=a.device)


class _Trace:
    def __init__(self, module: nn.Module, param_keys: set):
        self.names = {m: n for n, m in module.named_modules()}
        self.stack: list[nn.Module] = []
        self.records: dict[str, LayerRecord] = {}
        self.stage = ""
        self.seen_storages: set = set()
        self.param_keys = param_keys
        self.mix: collections.Counter = collections.Counter()
        self.mm_shapes: collections.Counter = collections.Counter()
        self.kernels: collections.Counter = collections.Counter()
        self.clock = 0  # counts non-view ops: a record's `order` is the time of its last op
        self.handles = []
        for m in module.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, mod, args):
        self.stack.append(mod)
        rec = self.record(mod)
        rec.in_bytes = max(rec.in_bytes, sum(_nbytes(t) for t in _tensors(args) if t.is_floating_point()))

    def _post(self, mod, args, out):
        if self.stack and self.stack[-1] is mod:
            self.stack.pop()
        rec = self.record(mod)
        rec.out_bytes = max(rec.out_bytes, sum(_nbytes(t) for t in _tensors(out) if t.is_floating_point()))

    def record(self, mod: nn.Module | None) -> LayerRecord:
        if mod is None:
            name, cls = f"<{self.stage}>", "<loss>"
        else:
            name, cls = self.names.get(mod, type(mod).__name__) or "<root>", type(mod).__name__
        rec = self.records.get(name)
        if rec is None:
            rec = LayerRecord(name, cls, classify(cls), self.stage, _block_of(name), self.clock)
            if mod is not None:
                for p in mod.parameters(recurse=False):
                    rec.params += p.numel()
                    rec.param_bytes += _nbytes(p)
            self.records[name] = rec
        return rec

    def on_op(self, name: str, args: tuple, out: object, kwargs: dict | None = None) -> None:
        rec = self.record(self.stack[-1] if self.stack else None)
        rec.ops += 1
        outs = _tensors(out)
        if name in _VIEW_OPS or not outs:  # views and metadata queries (prim.device, sizes) move nothing
            return
        # order by the last op, not by module entry: a container's own ops (the loss inside a
        # ForCausalLM's forward, a block's residual add) run after its children, so their backward
        # runs before the children's
        self.clock += 1
        rec.order = self.clock
        fl = op_flops(name, args, out)
        rec.fwd_flops += fl
        rec.bwd_flops += fl * (2 if name in _HEAVY else 1)
        if name in _GATHER_OPS:  # a lookup reads the selected rows (output-sized), not the whole table
            moved = 2 * sum(_nbytes(t) for t in outs) + sum(_nbytes(t) for t in _tensors(args[1:2]))
        else:
            moved = sum(_nbytes(t) for t in _tensors(args)) + sum(_nbytes(t) for t in outs)
        rec.fwd_bytes += moved
        rec.bwd_bytes += 2 * moved
        rec.max_out_bytes = max(rec.max_out_bytes, max(_nbytes(t) for t in outs))
        dtype = _op_dtype(name, args, outs)
        shape = _mm_shape(name, args)
        if shape is not None:
            self.mm_shapes[f"{dtype}:" + ":".join(map(str, shape))] += 1
        spec = kernel_spec(name, args, kwargs or {}, dtype, fl, shape)
        if spec is not None:
            self.kernels[spec] += 1
        key = f"{op_class(name)}_%s:{dtype}"
        self.mix[key % "count"] += 1
        self.mix[key % "flops"] += fl
        self.mix[key % "bytes"] += moved

    def on_saved(self, t: torch.Tensor) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            key = StorageWeakRef(t.untyped_storage())
        except (NotImplementedError, RuntimeError):  # pragma: no cover - exotic tensor subclasses
            return
        if key in self.param_keys or key in self.seen_storages:
            return
        self.seen_storages.add(key)
        rec = self.record(self.stack[-1] if self.stack else None)
        dt = str(t.dtype).replace("torch.", "")
        rec.saved_bytes[dt] = rec.saved_bytes.get(dt, 0) + t.untyped_storage().nbytes()

    def held_bytes(self, outputs: object) -> int:
        """Bytes of returned tensors (e.g. logits) that stay alive and were not saved already."""
        from torch.multiprocessing.reductions import StorageWeakRef

        total = 0
        for t in _tensors(outputs):
            key = StorageWeakRef(t.untyped_storage())
            if key in self.seen_storages or key in self.param_keys:
                continue
            self.seen_storages.add(key)
            total += t.untyped_storage().nbytes()
        return total


def _output_tensors(out: object) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out):
        return _tensors([getattr(out, f.name) for f in dataclasses.fields(out)])
    if hasattr(out, "to_tuple"):
        return _tensors(list(out.to_tuple()))
    return _tensors(out)


def assumed_routing(shape: torch.Size, dtype: torch.dtype, num_experts: int, routing: str) -> torch.Tensor:
    """The expert indices [tokens, top_k] a routed-experts layer is traced with.

    balanced: token t's slot j goes to expert (t * top_k + j) mod E: every expert receives
      tokens * top_k / E token-slots (+-1), the expectation under uniform routing.
    worst: every token goes to experts 0..top_k-1: the largest per-expert group (all tokens).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing: {routing!r} is not known; use one of {list(ROUTINGS)}")
    tokens, k = int(shape[0]), int(shape[-1]) if len(shape) > 1 else 1
    if routing == "balanced":
        idx = torch.arange(tokens * k) % max(num_experts, 1)
    else:
        idx = torch.arange(k).repeat(tokens)
    return idx.reshape(shape).to(dtype)


def _experts_modules(module: nn.Module) -> list[tuple[nn.Module, int]]:
    """Routed-experts modules (transformers 5.x experts interface: forward(hidden_states, top_k_index,
    top_k_weights), e.g. fused `gate_up_proj`/`down_proj` experts or a drop-in replacement) and the
    position of `top_k_index` among their forward's positional parameters."""
    import inspect

    out = []
    for m in module.modules():
        try:
            params = list(inspect.signature(m.forward).parameters)
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            continue
        if "top_k_index" in params:
            out.append((m, params.index("top_k_index")))
    return out


def _num_experts(m: nn.Module) -> int:
    n = getattr(m, "num_experts", None)
    if isinstance(n, int) and n > 0:
        return n
    for p in m.parameters(recurse=False):
        if p.dim() == 3:  # fused [E, out, in] expert weights
            return int(p.shape[0])
    raise ValueError(f"routing: cannot tell how many experts {type(m).__name__} has (no num_experts attribute)")


def _install_routing(module: nn.Module, routing: str) -> list:
    """Forward pre-hooks that hand every routed-experts module a concrete routing (the router's top-k
    on fake tensors has no values, and the experts' dispatch reads them)."""
    from torch.utils._python_dispatch import _disable_current_modes

    handles = []
    for m, pos in _experts_modules(module):
        n_exp = _num_experts(m)

        def hook(mod, args, kwargs, pos=pos, n_exp=n_exp):
            idx = kwargs.get("top_k_index") if "top_k_index" in kwargs else args[pos] if len(args) > pos else None
            if idx is None:
                return None
            with _disable_current_modes():
                concrete = assumed_routing(idx.shape, idx.dtype, n_exp, routing)
            if "top_k_index" in kwargs:
                return args, {**kwargs, "top_k_index": concrete}
            return (*args[:pos], concrete, *args[pos + 1 :]), kwargs

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _trace_stages(fake_model: ZooModel, batch: dict, tr: _Trace, autocast_dtype: torch.dtype | None) -> int:
    """Trace every stage's forward into ``tr``; returns the bytes the last outputs keep alive for the loss."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        tr.on_saved(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with _Tracer(tr):
            ctx = (
                torch.autocast("cpu", dtype=autocast_dtype)
                if autocast_dtype is not None
                else torch.autocast("cpu", enabled=False)
            )
            with ctx:
                outs = []
                for stage, fn in fake_model.stages(batch):
                    tr.stage = stage
                    outs.append(fn())
    held = 0
    for o in outs[-1:]:
        held += tr.held_bytes(_output_tensors(o))
    return held


def _attribute_params(tr: _Trace, fake_mod: nn.Module) -> None:
    """Give every parameter to one record, uncalled modules included, so each weight counts once."""
    called = set(tr.records)
    for name, mod in fake_mod.named_modules():
        if name not in called and any(True for _ in mod.parameters(recurse=False)):
            tr.stage = "unused"
            tr.record(mod)  # parameters of modules the forward never calls still occupy memory
    seen_params: set[int] = set()
    for r, mod in ((tr.records[n], m) for n, m in fake_mod.named_modules() if n in tr.records):
        # tied weights (e.g. GPT-2's lm_head = wte) are counted once, at their first owner
        r.params = r.param_bytes = 0
        for p in mod.parameters(recurse=False):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                r.params += p.numel()
                r.param_bytes += _nbytes(p)


def decompose(model: ZooModel, shape: Shape, precision: str = "fp32", routing: str = "balanced") -> Decomposition:
    """Per-layer records of `model` for one training batch of `shape` at `precision`.

    The model's own weights are never touched: tracing runs on a fake copy (no memory, no compute).
    Unknown layer kinds are logged by class name and counted in `Decomposition.unknown`.

    Mixture-of-experts layers route tokens by data (the router's top-k), which fake tensors do not
    have.  Routed-experts modules are therefore traced with an assumed routing (`assumed_routing`,
    balanced by default); integer buffers (e.g. compressed experts' offsets) keep their real values,
    and ops on nothing but those real tensors run for real.  With the grouped-matmul and the
    per-expert loop implementations, what the experts save for backward depends on the total
    token-slots (tokens x top_k), not on how they are distributed, so the balanced assumption does
    not bias the activation factor; "worst" puts every token on the same top_k experts.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    param_dtype, autocast_dtype = precision_setup(precision)
    if routing not in ROUTINGS:
        raise ValueError(f"routing: {routing!r} is not known; use one of {list(ROUTINGS)}")
    fm = FakeTensorMode(allow_non_fake_inputs=True)
    real = model.module
    fake_mod = _fake_copy(real, fm, param_dtype)
    route_handles = _install_routing(fake_mod, routing)
    real_batch = model.make_batch(shape, dtype=param_dtype)
    # floating inputs are fake; integer ones (token ids, labels, image grids) stay real, as the
    # placeholder masks and multimodal positions computed from them are data dependent
    batch = {k: fm.from_tensor(v) if v.is_floating_point() else v.clone() for k, v in real_batch.items()}
    with fm:
        fake_model = dataclasses.replace(model, module=fake_mod)
        param_keys = {StorageWeakRef(p.untyped_storage()) for p in fake_mod.parameters()}
        param_keys |= {StorageWeakRef(b.untyped_storage()) for b in fake_mod.buffers()}
        tr = _Trace(fake_mod, param_keys)
        try:
            held = _trace_stages(fake_model, batch, tr, autocast_dtype)
        finally:
            tr.close()
            for h in route_handles:
                h.remove()
    _attribute_params(tr, fake_mod)
    records = [r for r in tr.records.values() if r.params or r.ops or r.saved_total]
    unknown = collections.Counter(r.cls for r in records if r.kind == "unknown" and r.ops)
    for cls, n in unknown.items():
        log.warning("unknown layer kind %s (%d instance(s)); counted as 'unknown'", cls, n)
    compute_dtype = autocast_dtype or param_dtype
    input_bytes = sum(_nbytes(v) for v in real_batch.values())
    largest = max((_nbytes(p) for p in fake_mod.parameters()), default=0)
    buffers = {id(b): _nbytes(b) for b in fake_mod.buffers()}
    return Decomposition(
        model=model.name,
        family=model.family,
        modality=model.modality,
        shape=shape,
        precision=precision,
        records=records,
        unknown=unknown,
        param_dtype_bytes=torch.finfo(param_dtype).bits // 8,
        compute_dtype_bytes=torch.finfo(compute_dtype).bits // 8,
        held_output_bytes=held,
        input_bytes=input_bytes,
        largest_param_bytes=largest,
        tokens=shape.batch * model.total_tokens(shape),
        buffer_bytes=sum(buffers.values()),
        op_mix=dict(tr.mix),
        matmul_shapes=dict(tr.mm_shapes),
        kernel_calls=dict(tr.kernels),
    )


def _fake_copy(module: nn.Module, fm, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A structural copy of `module` whose parameters and buffers are fake tensors (shared weights kept
    shared), so tracing never allocates or computes on real weights."""
    import copy

    memo: dict[int, torch.Tensor] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in memo:
            continue
        if t.is_meta:  # built on the meta device (a large config): a fake CPU tensor, still no storage
            want = dtype if t.is_floating_point() else t.dtype
            with fm:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=want, device="cpu")
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
            continue
        if not t.is_floating_point() and not isinstance(t, nn.Parameter):
            memo[id(t)] = t.clone()  # integer buffers (indices, offsets) stay real: control flow reads them
            continue
        f = fm.from_tensor(t.detach())
        if dtype != torch.float32 and f.is_floating_point():
            with fm:
                f = f.to(dtype)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(module, memo)
