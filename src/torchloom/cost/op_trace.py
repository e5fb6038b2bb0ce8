"""Record what one traced forward/backward costs, op by op, under fake tensors (no real memory, no compute).

:class:`OpRecorder` is a ``TorchDispatchMode`` used inside a ``FakeTensorMode``: every ATen op is counted
(``ops``), matrix products get their FLOPs (``torch.utils.flop_counter``'s formulas, the same numbers
``FlopCounterMode`` reports, plus CPU flash attention, which that registry lacks) and their GEMM shapes,
every other non-view op adds the bytes of its tensor inputs and outputs (the memory-bound traffic). Saved
tensors are recorded with ``saved_tensors_hooks`` (one count per storage; parameters, buffers and copies
computed from them alone, e.g. autocast's bf16 weight casts, are state, not activations), and a timeline
of the storages ops allocate (freed when their fake storage dies) gives the transient peak.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .model_info import Matmul, PassCost

aten = torch.ops.aten

_SDPA_FWD = {aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_efficient_attention,
             aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_cudnn_attention}
_SDPA_BWD = {aten._scaled_dot_product_flash_attention_for_cpu_backward,
             aten._scaled_dot_product_efficient_attention_backward,
             aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_cudnn_attention_backward}


# matrix products torch.utils.flop_counter has no formula for (CPU flash attention, MoE grouped GEMMs)
_EXTRA_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._grouped_mm}


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (views share it)."""
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gemms(packet, args, out) -> list[Matmul]:
    """GEMM shapes ``C[m,n] = A[m,k] @ B[k,n]`` of one matrix-product op (m = rows = tokens for linears)."""
    if packet is aten.mm:
        (m, k), n = args[0].shape, args[1].shape[1]
        return [Matmul(m, n, k)]
    if packet is aten.addmm:
        (m, k), n = args[1].shape, args[2].shape[1]
        return [Matmul(m, n, k)]
    if packet in (aten.bmm, aten.baddbmm):
        a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
        return [Matmul(a.shape[1], b.shape[2], a.shape[2], count=a.shape[0])]
    if packet in _SDPA_FWD:
        q, k, v = args[:3]
        bh, lq, lk, e, ev = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]
        return [Matmul(lq, lk, e, bh), Matmul(lq, ev, lk, bh)]  # scores = Q K^T, out = P V
    if packet in _SDPA_BWD:
        q, k, v = args[1:4]
        bh, lq, lk, e, ev = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]
        # recomputed scores, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (as flop_counter counts them)
        return [Matmul(lq, lk, e, bh), Matmul(lq, lk, ev, bh), Matmul(lk, ev, lq, bh), Matmul(lq, e, lk, bh),
                Matmul(e, lk, lq, bh)]
    if packet is aten._grouped_mm:
        return _grouped_gemms(*args)
    if packet is aten.convolution:
        x, w, o = args[0], args[1], out
        groups = int(args[8]) if len(args) > 8 else 1
        spatial = int(torch.Size(o.shape[2:]).numel()) if o.dim() > 2 else 1
        ksize = int(torch.Size(w.shape[2:]).numel()) if w.dim() > 2 else 1
        return [Matmul(o.shape[0] * spatial, w.shape[0] // groups, x.shape[1] // groups * ksize, count=groups)]
    return []


def _minlength(args, kwargs) -> int:
    return int(kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0)


def _bincount_result(args, kwargs):
    """``aten.bincount`` on a fake tensor: its length is ``max(input) + 1`` or ``minlength``, a data-dependent
    shape fake tensors cannot give. With a ``minlength`` (MoE token counts per expert: ``minlength=E``, every
    index below it) the result has ``minlength`` bins; without one the op fails as before."""
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    dtype = weights.dtype if weights is not None else torch.int64
    if dtype not in (torch.int64, torch.float64) and weights is not None:
        dtype = torch.float64  # bincount returns double for floating weights
    return torch.zeros(_minlength(args, kwargs), dtype=dtype, device=args[0].device)


def _grouped_mm_result(a, b, offs=None, bias=None, out_dtype=None):
    """Output of ``aten._grouped_mm`` (MoE experts) from shapes: 2-D x 3-D -> (M, N) (tokens grouped by
    expert); 2-D x 2-D -> (G, M, N) (grouped along K: weight gradients); 3-D x 3-D -> batched."""
    dtype = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[2])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    elif a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[2])
    return torch.empty(shape, dtype=dtype, device=a.device)


def _grouped_gemms(a, b, offs=None, *_, **__) -> list[Matmul]:
    """GEMMs of a grouped matmul; group sizes are data (routing), so tokens count as evenly spread."""
    if a.dim() == 2 and b.dim() == 3:  # (M, K) x (G, K, N)
        g = b.shape[0]
        return [Matmul(max(1, a.shape[0] // g), b.shape[2], a.shape[1], g)]
    if a.dim() == 3 and b.dim() == 2:  # (G, M, K) x (K_total?, N): per group
        return [Matmul(a.shape[1], b.shape[1], max(1, b.shape[0] // a.shape[0]), a.shape[0])]
    if a.dim() == 2 and b.dim() == 2:  # (M, K_total) x (K_total, N), K split by groups
        g = offs.shape[0]
        return [Matmul(a.shape[0], b.shape[1], max(1, a.shape[1] // g), g)]
    return [Matmul(a.shape[1], b.shape[2], a.shape[2], a.shape[0])]


def _flops(packet, args, kwargs, out) -> float:
    if packet is aten._grouped_mm:
        return sum(g.flops for g in _grouped_gemms(*args, **kwargs))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        return float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        return float(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return float(flop_registry[packet](*args, **kwargs, out_val=out))


@dataclass
class _Pass:
    flops: float = 0.0
    gemms: dict[tuple[int, int, int], int] = field(default_factory=lambda: defaultdict(int))
    other_bytes: float = 0.0
    ops: int = 0
    unshaped_flops: float = 0.0

    def cost(self) -> PassCost:
        mm = [Matmul(m, n, k, c) for (m, n, k), c in sorted(self.gemms.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1])]
        return PassCost(matmul_flops=self.flops, matmuls=mm, other_bytes=self.other_bytes, ops=self.ops)


class OpRecorder(TorchDispatchMode):
    """Counts ops, FLOPs, GEMM shapes and bytes per phase (``"fwd"``/``"bwd"``; set :attr:`phase`), tracks
    saved tensors (use :meth:`saving` around the forward) and the storages ops allocate.

    Args:
        state: tensors that are model state (parameters and buffers): saved copies of them are not activations.
    """

    def __init__(self, state: list[torch.Tensor]):
        super().__init__()
        self.phase = "fwd"
        self.passes = {"fwd": _Pass(), "bwd": _Pass()}
        self.state = {storage_key(t) for t in state}
        self.derived: dict[int, int] = {}  # storage -> bytes: low-precision copies made from state alone
        self.saved: dict[int, int] = {}  # storage -> bytes: activations saved for backward
        self.derived_saved: dict[int, int] = {}  # state-derived copies saved for backward (autocast weights)
        self.events: list[tuple[int, int]] = []  # (storage, +bytes on allocation / -bytes when freed)
        self._alive: dict[int, int] = {}  # storage -> allocation serial

    # -- dispatch ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is aten._grouped_mm and isinstance(args[0], FakeTensor):
            out = _grouped_mm_result(*args, **kwargs)  # its meta kernel takes bf16 only; the CPU kernel fp32 too
        elif func._overloadpacket is aten.bincount and isinstance(args[0], FakeTensor) and _minlength(args, kwargs):
            out = _bincount_result(args, kwargs)  # data-dependent length: priced at minlength (expert counts)
        else:
            out = func(*args, **kwargs)
        acc = self.passes[self.phase]
        packet = func._overloadpacket
        is_view = getattr(func, "is_view", False)
        if func.namespace != "prim" and not is_view and packet is not aten.detach:
            acc.ops += 1  # kernels only: views, detach and prim.device cost no launch
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if packet in flop_registry or packet in _EXTRA_FLOPS:
            f = _flops(packet, args, kwargs, out)
            acc.flops += f
            shapes = _gemms(packet, args, out if isinstance(out, torch.Tensor) else None)
            for g in shapes:
                acc.gemms[(g.m, g.n, g.k)] += g.count
            acc.unshaped_flops += f - sum(g.flops for g in shapes)
        elif not is_view:
            acc.other_bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        from_state = bool(ins) and not is_view and all(
            storage_key(t) in self.state or storage_key(t) in self.derived for t in ins)
        in_keys = {storage_key(t) for t in ins}
        for t in outs:
            self._track(t, from_state, in_keys)
        return out

    def _track(self, t: torch.Tensor, from_state: bool, in_keys: set[int]) -> None:
        key = storage_key(t)
        if key in in_keys or key in self.state or key in self._alive or key in self.derived:
            return  # a view / in-place result, or a storage already known
        st = t.untyped_storage()
        nbytes = st.nbytes()
        if from_state:
            self.derived[key] = nbytes
            weakref.finalize(st, self.derived.pop, key, None)  # the address may be reused by an activation
            return
        # storage addresses are reused after a free: events carry a serial number instead
        serial = len(self.events)
        self._alive[key] = serial
        self.events.append((serial, nbytes))
        weakref.finalize(st, self._freed, key, serial, nbytes)

    def _freed(self, key: int, serial: int, nbytes: int) -> None:
        if self._alive.get(key) == serial:
            del self._alive[key]
        self.events.append((serial, -nbytes))

    def alive_serials(self, tensors) -> set[int]:
        """Allocation serials of the (live) storages of ``tensors``, for :meth:`peak_allocated`'s ``exclude``."""
        keys = {storage_key(t) for t in tensors}
        return {s for k, s in self._alive.items() if k in keys}

    # -- saved tensors -----------------------------------------------------------------------------------
    def saving(self):
        """Context manager recording every tensor autograd saves for backward."""

        def pack(t):
            key = storage_key(t)
            if key in self.derived:
                self.derived_saved[key] = self.derived[key]
            elif key not in self.state and key not in self.derived and key not in self.saved:
                self.saved[key] = t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def peak_allocated(self, exclude: set[int]) -> float:
        """Highest sum of live op-allocated storages over the trace, ignoring the allocations ``exclude``
        (serials from :meth:`alive_serials`, e.g. the parameter gradients)."""
        live = peak = 0
        for serial, delta in self.events:
            if serial in exclude:
                continue
            live += delta
            peak = max(peak, live)
        return float(peak)

    def cost(self, phase: str) -> PassCost:
        return self.passes[phase].cost()

    def unshaped_flops(self) -> float:
        return sum(p.unshaped_flops for p in self.passes.values())
