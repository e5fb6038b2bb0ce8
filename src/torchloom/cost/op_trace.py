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
from torch.overrides import TorchFunctionMode
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

#: ops that launch no kernel and move no bytes (still dispatched: counted in ``PassCost.ops``): views not flagged
#: ``is_view`` (``_unsafe_view`` of a fresh tensor, ``alias``), allocations that write nothing (``empty``: the bytes
#: are written by the op that fills them, counted there)
_NO_KERNEL = {aten.detach, aten._unsafe_view, aten.alias, aten.lift_fresh, aten.empty, aten.empty_like,
              aten.empty_strided, aten.new_empty, aten.new_empty_strided}

#: the query/key tile a flash kernel steps over (FlashAttention-2, Dao 2023, sec. 3.1: with a causal mask the
#: blocks whose every entry is masked are skipped, about half of them; 128 is the tile of its forward kernel
#: for head dimension 128, and PyTorch's CPU flash kernel's q split for long sequences)
FLASH_TILE = 128


def causal_share(lq: int, lk: int) -> float:
    """Fraction of the ``lq x lk`` score entries a causal mask keeps (PyTorch's ``is_causal``: top-left
    aligned, query ``i`` sees keys ``0..i``): the model FLOPs of causal attention, exactly."""
    if lq <= 0 or lk <= 0:
        return 1.0
    full = min(lq, lk)  # rows i < lk see i + 1 keys; rows past lk see all lk
    kept = full * (full + 1) // 2 + max(0, lq - lk) * lk
    return kept / (lq * lk)


def causal_tile_share(lq: int, lk: int, tile: int = FLASH_TILE) -> float:
    """Fraction of the score tiles a causal flash kernel computes (the diagonal tiles whole): what it costs."""
    nq, nk = -(-lq // tile), -(-lk // tile)
    if nq <= 0 or nk <= 0:
        return 1.0
    full = min(nq, nk)
    kept = full * (full + 1) // 2 + max(0, nq - nk) * nk
    return kept / (nq * nk)


def _sdpa_causal(packet, args, kwargs) -> bool:
    """The ``is_causal`` argument of an SDPA forward/backward op (positional or keyword), found by name in the
    op's schema (its position differs between the flash, efficient and cuDNN kernels and their backwards)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in packet.default._schema.arguments]
    i = names.index("is_causal") if "is_causal" in names else -1
    return 0 <= i < len(args) and bool(args[i])


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (views share it)."""
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gemms(packet, args, out, kwargs=None) -> list[Matmul]:
    """GEMM shapes ``C[m,n] = A[m,k] @ B[k,n]`` of one matrix-product op (m = rows = tokens for linears)."""
    kwargs = kwargs or {}
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
        sh = causal_tile_share(lq, lk) if _sdpa_causal(packet, args, kwargs) else 1.0
        # scores = Q K^T, out = P V
        return [Matmul(lq, lk, e, bh, True, sh), Matmul(lq, ev, lk, bh, True, sh)]
    if packet in _SDPA_BWD:
        q, k, v = args[1:4]
        bh, lq, lk, e, ev = q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]
        sh = causal_tile_share(lq, lk) if _sdpa_causal(packet, args, kwargs) else 1.0
        # recomputed scores, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q (as flop_counter counts them)
        return [Matmul(lq, lk, e, bh, True, sh), Matmul(lq, lk, ev, bh, True, sh), Matmul(lk, ev, lq, bh, True, sh),
                Matmul(lq, e, lk, bh, True, sh), Matmul(e, lk, lq, bh, True, sh)]
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


def _model_flops(packet, args, kwargs, flops: float) -> float:
    """The model FLOPs of one matrix-product op of ``flops`` (full-square) FLOPs: an attention kernel's causal
    half exactly, and in backward without the recomputed scores (4 of flop_counter's 5 products)."""
    if packet in _SDPA_FWD or packet in _SDPA_BWD:
        q, k = (args[0], args[1]) if packet in _SDPA_FWD else (args[1], args[2])
        if _sdpa_causal(packet, args, kwargs):
            flops *= causal_share(q.shape[2], k.shape[2])
        if packet in _SDPA_BWD:
            flops *= 4.0 / 5.0
    return flops


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
    model_flops: float = 0.0
    gemms: dict[tuple[int, int, int, bool, float], int] = field(default_factory=lambda: defaultdict(int))
    other_bytes: float = 0.0
    ops: int = 0
    unshaped_flops: float = 0.0
    fusion: "_Fusion" = field(default_factory=lambda: _Fusion())

    def cost(self, escaping: set | None = None) -> PassCost:
        mm = [Matmul(m, n, k, c, a, sh) for (m, n, k, a, sh), c in
              sorted(self.gemms.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1] * kv[0][4])]
        fused, chains = self.fusion.result(escaping or set())
        kernels = chains + self.fusion.chain  # one kernel per fused chain, one per matrix product
        return PassCost(matmul_flops=self.flops, matmuls=mm, other_bytes=self.other_bytes, ops=self.ops,
                        model_flops=self.model_flops, fused_bytes=fused, fused_kernels=kernels)


class _Fusion:
    """Memory traffic of one pass with every chain of non-matmul ops between two matrix products fused into
    one kernel (what ``torch.compile``'s Inductor does for elementwise and reduction chains, and what hand-fused
    kernels do for norms, RoPE and SwiGLU): a chain reads each tensor made outside it once and writes each
    tensor it makes that is used outside it (by a matmul, a later chain, saved for backward, or still alive at
    the end of the pass). Tensors are identified by allocation, so a reused address is a new tensor."""

    def __init__(self):
        self.chain = 0  # current chain; a matrix product ends it
        self.chain_ops: dict[int, int] = defaultdict(int)
        self.reads: dict[int, dict] = defaultdict(dict)  # chain -> {tensor id: bytes} read from outside
        self.made: dict = {}  # tensor id -> (chain, bytes) for tensors a chain made
        self.escaping: set = set()  # tensors a chain made that something outside it reads

    def boundary(self, ins: list) -> None:
        for tid, _ in ins:
            if tid in self.made:
                self.escaping.add(tid)
        self.chain += 1

    def fusable(self, ins: list, outs: list) -> None:
        c = self.chain
        self.chain_ops[c] += 1
        for tid, nbytes in ins:
            made = self.made.get(tid)
            if made is None:
                self.reads[c].setdefault(tid, nbytes)
            elif made[0] != c:
                self.escaping.add(tid)
                self.reads[c].setdefault(tid, nbytes)
        for tid, nbytes in outs:
            if tid not in self.made:
                self.made[tid] = (c, nbytes)

    def result(self, escaping: set) -> tuple[float, int]:
        """``(bytes, kernels)``: ``escaping`` adds the tensors known to leave the pass (saved for backward,
        alive at its end)."""
        out = self.escaping | (escaping & self.made.keys())
        written = sum(self.made[t][1] for t in out)
        read = sum(sum(r.values()) for r in self.reads.values())
        return float(read + written), len(self.chain_ops)


class OpRecorder(TorchDispatchMode):
    """Counts ops, FLOPs, GEMM shapes and bytes per phase (``"fwd"``/``"bwd"``; set :attr:`phase`), tracks
    saved tensors (use :meth:`saving` around the forward) and the storages ops allocate.

    Args:
        state: tensors that are model state (parameters and buffers): saved copies of them are not activations.
    """

    def __init__(self, state: list[torch.Tensor]):
        super().__init__()
        self._phase = "fwd"
        self.passes = {"fwd": _Pass(), "bwd": _Pass()}
        self.leaving: dict[str, set] = {}  # phase -> tensors that leave it (its outputs, for fusion)
        self.saved_ids: dict = {}  # tensor -> bytes of the tensors saved for backward
        self.state = {storage_key(t) for t in state}
        self.derived: dict[int, int] = {}  # storage -> bytes: low-precision copies made from state alone
        self.saved: dict[int, int] = {}  # storage -> bytes: activations saved for backward
        self.derived_saved: dict[int, int] = {}  # state-derived copies saved for backward (autocast weights)
        self.events: list[tuple[int, int]] = []  # (storage, +bytes on allocation / -bytes when freed)
        self._alive: dict[int, int] = {}  # storage -> allocation serial

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value != self._phase and self._phase not in self.leaving:
            self.leaving[self._phase] = set(self._alive.values())
        self._phase = value

    def end_forward(self, outputs) -> None:
        """Record the forward's outputs (what leaves its last fused chain) before backward starts; without it
        every tensor alive at the end counts as leaving (saved activations included)."""
        self.leaving["fwd"] = {self._tid(t) for t in outputs if isinstance(t, torch.Tensor)}

    def _tid(self, t: torch.Tensor):
        """Identity of the tensor's allocation (its serial; state and inputs by storage)."""
        key = storage_key(t)
        serial = self._alive.get(key)
        return serial if serial is not None else ("storage", key)

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
        # views, detach and prim.device cost nothing; _unsafe_view, alias, empty and the like launch no kernel and
        # move no bytes but still go through the dispatcher (host time per op)
        dispatched = func.namespace != "prim" and not is_view and packet is not aten.detach
        kernel = dispatched and packet not in _NO_KERNEL
        if dispatched:
            acc.ops += 1
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_ids = [(self._tid(t), _nbytes(t)) for t in ins] if kernel else []
        matrix = packet in flop_registry or packet in _EXTRA_FLOPS
        if matrix:
            full = _flops(packet, args, kwargs, out)
            shapes = _gemms(packet, args, out if isinstance(out, torch.Tensor) else None, kwargs)
            shaped_full = sum(2.0 * g.m * g.n * g.k * g.count for g in shapes)
            f = full - shaped_full + sum(g.flops for g in shapes)  # the causal share of attention products
            acc.flops += f
            acc.model_flops += _model_flops(packet, args, kwargs, full)
            for g in shapes:
                acc.gemms[(g.m, g.n, g.k, g.attention, g.share)] += g.count
            acc.unshaped_flops += f - sum(g.flops for g in shapes)
            acc.fusion.boundary(in_ids)
        elif kernel:
            acc.other_bytes += sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
        from_state = bool(ins) and not is_view and all(
            storage_key(t) in self.state or storage_key(t) in self.derived for t in ins)
        in_keys = {storage_key(t) for t in ins}
        for t in outs:
            self._track(t, from_state, in_keys)
        if kernel and not matrix:
            acc.fusion.fusable(in_ids, [(self._tid(t), t.untyped_storage().nbytes()) for t in outs])
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
            if key not in self.state and key not in self.derived:
                self.saved_ids.setdefault(self._tid(t), t.untyped_storage().nbytes())
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

    def live_curve(self, exclude: set[int]) -> list[int]:
        """Live op-allocated bytes after each allocation event (ignoring the allocations ``exclude``): the
        timeline :meth:`peak_allocated` takes the maximum of; two traces of the same ops at different batch
        sizes give each moment's bytes as a line in the batch size (``analysis._peak_lines``)."""
        live, out = 0, []
        for serial, delta in self.events:
            if serial not in exclude:
                live += delta
            out.append(live)
        return out

    def cost(self, phase: str) -> PassCost:
        """What ``phase`` (``"fwd"``/``"bwd"``) costs; call after the trace (fusion needs the tensors that
        left each pass)."""
        leaving = self.leaving.get(phase)
        if leaving is None:  # the last phase traced: what is alive now
            leaving = set(self._alive.values())
        return self.passes[phase].cost(leaving)

    def chain_internal_saved_bytes(self) -> float:
        """Bytes of the saved activations that a fused forward never materialises: tensors made inside one
        chain of non-matmul ops and used only there (not by a matmul, another chain, or as an output). A
        fusing compiler recomputes them from the chain's inputs in backward instead of saving them
        (Inductor's min-cut partitioner recomputes pointwise intermediates), so they leave the activations."""
        f = self.passes["fwd"].fusion
        out = self.leaving.get("fwd", set())
        return float(sum(b for tid, b in self.saved_ids.items()
                         if tid in f.made and tid not in f.escaping and tid not in out))

    def weight_gemm_input_saving(self, outputs) -> float:
        """Bytes the forward's saved activations shrink by when every weight GEMM keeps its activation input
        in FP8 (1 byte per element) instead of the traced dtype: Transformer Engine's ``Linear`` /
        ``LayerNormLinear`` / ``LayerNormMLP`` save the quantized input for the weight-gradient GEMM
        (``transformer_engine/pytorch/module/linear.py``, ``saved_inputmat``), so an input saved only by weight
        GEMMs (a norm's output feeding the QKV projections, the MLP's product feeding the down projection) is
        kept in FP8 and its bf16 original is freed; an input another op saves too (flash attention's output,
        which the output projection reads) stays and gains the FP8 copy. Walks the autograd graph of
        ``outputs`` (call before backward): each node's ``_saved_*`` tensors name who saved what. A weight GEMM
        is a matrix-product node with an operand made from the model state (a weight or its autocast copy).
        Negative when shared inputs dominate (the FP8 copies add memory)."""
        gemm_nodes = {"MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0"}
        savers: dict[int, set[bool]] = defaultdict(set)
        elems: dict[int, int] = {}
        seen, stack = set(), [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions)
            values = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
            tensors = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
            keys = [storage_key(t) for t in tensors]
            weight = node.name() in gemm_nodes and any(k in self.state or k in self.derived for k in keys)
            for t, k in zip(tensors, keys):
                if k in self.saved:
                    savers[k].add(weight)
                    elems[k] = max(elems.get(k, 0), t.untyped_storage().nbytes() // max(t.element_size(), 1))
        saving = 0.0
        for k, who in savers.items():
            if True not in who:
                continue
            if who == {True}:
                saving += self.saved[k] - elems[k]  # the traced copy freed, the FP8 one kept
            else:
                saving -= elems[k]  # kept by another op too: the FP8 copy comes on top
        return saving

    def unshaped_flops(self) -> float:
        return sum(p.unshaped_flops for p in self.passes.values())


#: how the analysis traces ``F.scaled_dot_product_attention``: ``"native"`` as the tracing machine (CPU)
#: dispatches it (its math fallback materialises the scores under dropout or some masks), ``"flash"`` as a
#: flash kernel (what a GPU runs: FlashAttention / cuDNN support dropout and causal masks without
#: materialising the scores; Dao et al. 2022, 2023)
ATTENTION_TRACES = ("native", "flash")


class FlashAttentionMode(TorchFunctionMode):
    """Trace every ``F.scaled_dot_product_attention`` call as one flash-attention kernel (forward and
    backward ops with the kernel's own inputs and outputs: no materialised scores, no dropout mask tensor).

    Args:
        causal_lm: the traced model is a causal language model traced without padding: an explicit mask over
            a square score matrix is its causal mask, priced as ``is_causal`` (Hugging Face models that build
            the mask themselves, e.g. GPT-2, run the same kernel work on a GPU with ``is_causal``).
        notes: where to say what was assumed (once).
    """

    def __init__(self, causal_lm: bool, notes: list[str]):
        super().__init__()
        self.causal_lm, self.notes = causal_lm, notes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask, causal = a.get("attn_mask"), bool(a.get("is_causal", False))
        if mask is not None and self.causal_lm and q.shape[-2] == k.shape[-2]:
            mask, causal = None, True
            note = ("attention priced as a causal flash kernel: the model's explicit mask is its causal mask "
                    "(planned without padding)")
            if note not in self.notes:
                self.notes.append(note)
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                  scale=a.get("scale"))
        return out
