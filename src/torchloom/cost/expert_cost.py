"""What expert parallelism costs per rank: the ``estimate`` of the ``expert_parallel`` method.

``expert_parallel.estimate`` calls :func:`estimate_expert_parallel`; the cost model composes the result with
the other methods' effects (:mod:`torchloom.cost.effects`). The layout is the mesh's: ``ep`` carved out of
the data-parallel ranks (``dp = edp x ep``), experts ``Shard(0)`` over ``ep``, dense layers over all ``dp``.
"""
from __future__ import annotations

from .effects import Collective, Effects, GROUPED, dtype_bytes, moe_layers_per_rank

#: dispatched ops one MoE layer's expert-parallel forward adds (count exchange, split sizes to the host,
#: sort/permute of the routed tokens, the two all-to-alls, unpermute, the local-index remap); backward twice
#: that (effects convention). A planning assumption of the same order as FSDP's per-unit count.
EP_OPS_PER_LAYER = 12

#: bytes per expert of the token-count exchange before each dispatch (one int64 per expert)
_COUNT_BYTES = 8


def routed_bytes(info, step) -> float:
    """Bytes one rank sends in one dispatch (or one combine) of one MoE layer for one micro-batch:
    ``tokens x top_k x hidden x compute-dtype bytes`` (``tokens = micro_batch x seq_len``). The wire share
    ``(ep - 1) / ep`` of it (what leaves the rank) is applied by ``Hardware.collective_time`` for
    ``all_to_all``, as for every collective: ``nbytes`` is the tensor sent."""
    ex = info.experts
    h = ex.hidden_size or info.dims.get("hidden_size", 0)
    return step.micro_batch * step.seq_len * ex.top_k * h * dtype_bytes(step.compute_dtype)


def estimate_expert_parallel(config, info, dims, hw, step) -> Effects | None:
    """Expert parallelism over ``ep`` ranks, per rank per optimizer step:

    * expert parameters, gradients and Adam state ``1/ep`` (``group_memory_scale["expert"]``); the data-
      parallel method then shards that share (FSDP: its experts units on the whole ``edp``,
      ``experts / (ep x edp)``; DDP: ``experts / ep``), dense parameters as before;
    * per MoE layer per micro-batch, on the ``ep`` view (across nodes when the ``ep`` group spans nodes):
      2 all-to-alls in forward (dispatch, combine) and 2 in backward (their gradients), each
      :func:`routed_bytes`, on the critical path (the experts need the dispatched tokens; the next layer
      needs the combined ones): ``overlap="none"``; plus the token-count exchange (``E`` int64) before each
      dispatch;
    * transient: the send and receive buffers of one layer's dispatch (2 x :func:`routed_bytes`);
    * compute: unchanged. Balanced routing (the planner's assumption, ``ModelInfo.experts``): each rank
      receives as many routed tokens as it sends, so its experts run ``tokens x top_k`` rows, in ``E/ep``
      groups ``ep`` times larger (their better GEMM efficiency is not credited: a conservative price).

    Args:
        config: the method's config (not read: the layout is the mesh's).
        info / dims / hw / step: as every ``estimate`` hook gets them.

    Returns:
        None for ``ep == 1`` or a model without experts (nothing changes); else the :class:`Effects`.
    """
    ex = getattr(info, "experts", None)
    if ex is None or dims.ep <= 1:
        return None
    ep = dims.ep
    e = Effects("expert_parallel", group_memory_scale={"expert": {k: 1.0 / ep for k in GROUPED}})
    layers = moe_layers_per_rank(info, dims)
    nbytes = routed_bytes(info, step)
    e.ops_add = EP_OPS_PER_LAYER * layers / max(info.num_blocks, 1)
    e.memory_add["temporary"] = 2.0 * nbytes
    calls = step.grad_accum * layers
    if nbytes > 0 and calls > 0:
        e.collectives.append(Collective("all_to_all", nbytes, "ep", calls=2 * calls, overlap="none",
                                        label="expert_parallel.all_to_all_fwd"))
        e.collectives.append(Collective("all_to_all", nbytes, "ep", calls=2 * calls, overlap="none",
                                        label="expert_parallel.all_to_all_bwd"))
        e.collectives.append(Collective("all_to_all", _COUNT_BYTES * ex.num_experts, "ep", calls=calls,
                                        overlap="none", label="expert_parallel.counts"))
    e.notes.append(f"ep={ep}: {ex.num_experts // ep if ex.num_experts % ep == 0 else ex.num_experts / ep:g} of "
                   f"{ex.num_experts} experts per rank; balanced routing assumed (each rank receives as many "
                   "routed tokens as it sends)")
    if dims.tp > 1:
        e.notes.append("under tensor parallelism every tp rank dispatches the full tokens "
                       "(no sequence split of the all-to-all assumed)")
    return e
