"""Rank functions for the sequence-split tests (context parallel ring attention, Ulysses): attention against a
single-process reference on the whole sequence, and training through ``tests.distributed._tp_workers``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from torchloom.parallel.context import SequenceInfo, SequenceLayout
from torchloom.parallel.context.ring import ring_attention
from torchloom.parallel.context.sequence import activate
from torchloom.parallel.context.ulysses import ulysses_attention


def _inputs(b=2, h=4, hkv=2, s=16, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64).to(dtype)
    do = torch.randn(b, h, s, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, do


def _facts(b, s, padded, docs):
    valid = document = None
    if padded:  # sample 0 right-padded by 3, sample 1 left-padded by 2 (rows with no visible key)
        valid = torch.ones(b, s, dtype=torch.bool)
        valid[0, -3:] = False
        valid[1, :2] = False
    if docs:  # packed: sample 0 has documents of 5, 7, 4 tokens; sample 1 one document
        document = torch.zeros(b, s, dtype=torch.long)
        document[0, 5:12], document[0, 12:] = 1, 2
    return valid, document


def reference_mask(b, s, causal, valid, document) -> torch.Tensor:
    """Bool [B, 1, S, S] (True: attend), built here independently of torchloom's SequenceInfo.mask."""
    m = torch.ones(b, 1, s, s, dtype=torch.bool)
    for i in range(b):
        for qi in range(s):
            for ki in range(s):
                ok = (not causal or ki <= qi)
                ok = ok and (valid is None or bool(valid[i, ki]))
                ok = ok and (document is None or int(document[i, qi]) == int(document[i, ki]))
                m[i, 0, qi, ki] = ok
    return m


def reference_attention(q, k, v, do, causal, valid, document):
    """Whole-sequence attention in float64 with the same masks (rows with no visible key: 0); output and input
    gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    b, _, s, d = q.shape
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    mask = reference_mask(b, s, causal, valid, document)
    scores = (q @ kk.transpose(-1, -2)) / d ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    seen = mask.any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~seen, 0.0), -1) * seen
    out = p @ vv
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


def attention_cases(cases: list[dict]) -> list[dict]:
    """Each case: kind ('ring' | 'ulysses'), causal, padded, docs, load_balance, dtype. Returns per case the max
    abs error of this rank's output and q/k/v gradient shards against the float64 reference."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    out = []
    for c in cases:
        dtype = c.get("dtype", torch.float32)
        q, k, v, do = _inputs(hkv=c.get("hkv", 2), dtype=dtype)
        b, s = q.shape[0], q.shape[2]
        valid, document = _facts(b, s, c.get("padded", False), c.get("docs", False))
        ref = reference_attention(q, k, v, do, c["causal"], valid, document)
        if c["kind"] == "hybrid":  # ring over cp/2 ranks x Ulysses over 2 adjacent ranks
            u = 2
            rings = [dist.new_group(list(range(i, cp, u))) for i in range(u)]
            ulys = [dist.new_group(list(range(i, i + u))) for i in range(0, cp, u)]
            lay = SequenceLayout(cp, rank, True, u)
            info = SequenceInfo(lay, s, b, document=document, valid=valid, kind="ring", group=group,
                                ring_group=rings[rank % u], ulysses_group=ulys[rank // u])
        else:
            u = cp if c["kind"] == "ulysses" else 1
            lay = SequenceLayout(cp, rank, c.get("load_balance", c["kind"] == "ring"), u)
            info = SequenceInfo(lay, s, b, document=document, valid=valid, kind=c["kind"], group=group)
        ql, kl, vl = (lay.shard(t, 2).detach().requires_grad_() for t in (q, k, v))
        fn = ring_attention if lay.ulysses == 1 else ulysses_attention
        with activate(info):
            o = fn(ql, kl, vl, info, causal=c["causal"])
            o.backward(lay.shard(do, 2))
        errs = {name: (got.double() - lay.shard(want, 2)).abs().max().item()
                for name, got, want in (("out", o.detach(), ref[0]), ("dq", ql.grad, ref[1]),
                                        ("dk", kl.grad, ref[2]), ("dv", vl.grad, ref[3]))}
        errs["finite"] = bool(torch.isfinite(o).all() and torch.isfinite(ql.grad).all())
        if dtype != torch.float32:  # the same inputs through PyTorch's SDPA on one process, for scale
            qb, kb, vb = (t.detach().requires_grad_() for t in (q, k, v))
            ob = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=c["causal"], enable_gqa=True)
            ob.backward(do)
            errs["sdpa"] = max((got.double() - want).abs().max().item()
                               for got, want in ((ob, ref[0]), (qb.grad, ref[1]), (kb.grad, ref[2]), (vb.grad, ref[3])))
        out.append(errs)
    return out


# ------------------------------------------------------------------------------------------------ training
def _batch(x: torch.Tensor, kind: str, first: int = 0) -> dict:
    """A causal-LM batch of token ids ``x`` [B, S] (samples ``first ...`` of the data): ``plain``; ``padded``
    (samples 0, 4, 8, ... right-padded by 4, samples 1, 5, ... left-padded by 2: attention_mask 0, labels -100); ``packed`` (HF DataCollatorWithFlattening style: position ids
    restart at every document, the first label of each document is -100)."""
    b, s = x.shape
    if kind == "plain":
        return {"input_ids": x, "labels": x.clone()}
    if kind == "padded":
        mask = torch.ones_like(x)
        for i in range(b):
            if (first + i) % 4 == 0:
                mask[i, -4:] = 0
            elif (first + i) % 4 == 1:
                mask[i, :2] = 0
        return {"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)}
    if kind == "packed":
        pos = torch.cat([torch.arange(5), torch.arange(s - 9), torch.arange(4)]).expand(b, s).clone()
        labels = x.clone().masked_fill(pos == 0, -100)
        # use_cache=False: with a cache HF's SDPA path does not mask documents (masking_utils only derives them
        # when no cache is passed), so the reference would attend across them; the split always masks them
        return {"input_ids": x, "position_ids": pos, "labels": labels, "use_cache": False}
    raise ValueError(kind)


def _sum_loss(batch, output):
    from torchloom import SumLoss

    return SumLoss.from_hf(output, batch["labels"])


def _model(name: str, seed: int = 0):
    from tests.distributed._tp_workers import MODELS

    if name == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(seed)
        return Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            max_position_embeddings=64))
    return MODELS[name](seed)


def _reference(model: str, kind: str, loss: str, steps: int, gb: int, seq: int, amp: bool):
    from tests.models import token_batches

    net = _model(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    data = token_batches(steps * gb, seq=seq)
    losses = []
    for s in range(steps):
        batch = _batch(data[s * gb:(s + 1) * gb], kind, s * gb)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = net(**batch)
            if loss == "sum":
                total, count = _sum_loss(batch, out).total, (batch["labels"][:, 1:] != -100).sum()
                value = total / count
            else:
                value = out.loss
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return losses, {k: v.detach().float().clone() for k, v in net.state_dict().items()}


def train_cases(cases: list[dict]) -> list[dict]:
    """Each case: strategy, model ('llama'), kind ('plain'), loss ('hf' | 'sum'), micro_batch (4), amp (False).
    Trains 3 steps of global batch 8, sequence 16 with SGD + momentum beside a single-process reference run in
    this rank; returns the max |loss difference|, max |parameter difference| and the notes."""
    import torchloom
    from tests.models import full_params, token_batches

    steps, gb, seq = 3, 8, 16
    out = []
    for c in cases:
        model, kind, loss = c.get("model", "llama"), c.get("kind", "plain"), c.get("loss", "hf")
        amp = c.get("amp", False)
        ref_losses, ref_params = _reference(model, kind, loss, steps, gb, seq, amp)
        res = torchloom.auto_accelerate(
            _model(model), torch.optim.SGD, None, _sum_loss if loss == "sum" else (lambda b, o: o.loss),
            strategy=c["strategy"], optim_args={"lr": 0.1, "momentum": 0.9},
            dataloader_args={"batch_size": gb, "micro_batch_size": c.get("micro_batch", 4)},
            model_input_format="unpack_dict")
        dp, r, micro = res.mesh.dp_size, res.mesh.dp_rank, res.micro_batch_size
        data = token_batches(steps * gb, seq=seq)
        losses = []
        for s in range(steps):
            mine = data[s * gb:(s + 1) * gb][r * (gb // dp):(r + 1) * (gb // dp)]
            num = den = 0.0
            for k in range(res.grad_accum_steps):
                first = s * gb + r * (gb // dp) + k * micro
                got = res.train_step(_batch(mine[k * micro:(k + 1) * micro], kind, first))
                stat = res.train_step.last_loss_stat  # [numerator, denominator] over dp x cp
                num, den = (num + stat[0].item(), den + stat[1].item()) if loss == "sum" else (num + got.item(), den + 1)
            losses.append(num / den)
        params = full_params(res.model)
        out.append({"dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                    # a pipeline rank holds its stages' parameters only (the test takes the max over ranks)
                    "dparam": max((params[k] - ref_params[k]).abs().max().item() for k in ref_params if k in params),
                    "losses": losses, "ref_losses": ref_losses, "notes": res.notes})
    return out


def suite(attn: list[dict], training: list[dict]) -> dict:
    """Attention cases and training cases in one launch (a launch costs seconds)."""
    return {"attention": attention_cases(attn), "training": train_cases(training)}
