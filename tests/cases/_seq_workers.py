"""Rank functions for cases C21-C25 (sequence splits: context parallel / Ulysses); see
tests/cases/test_c21_c25_sequence_split.py. Each returns picklable CPU data with its own single-process
reference computed in the rank (tiny models: cheaper than a second launch)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import torchloom
from tests.cases._workers import record_grads
from tests.models import tiny_llama, token_batches
from torchloom.parallel.context import SequenceSplitter, sequence_attention

SEQ = 16


def P(**d):
    return ("parallel_mode", d)


def _model(kind: str, seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        return tiny_llama(seed)
    if kind == "mistral_window4":
        return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, sliding_window=4))
    heads = {"qwen2_4_2": (4, 2), "qwen2_6_2": (6, 2)}[kind]
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=16 * heads[0], intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                                        head_dim=16, max_position_embeddings=64))


def _reference_grads(model_kind: str, batch: dict) -> tuple[float, dict]:
    net = _model(model_kind)
    out = net(**{**batch, "use_cache": False})
    out.loss.backward()
    return out.loss.item(), {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def train_grads(model_kind: str, strategy, batch: dict, micro: int | None = None) -> dict:
    """One step of ``strategy`` on this rank's share of ``batch`` (dp ranks split it by samples); the loss
    ``train_step`` reports, the gradients the optimizer sees (full, canonical names), this rank's raw local
    gradients (DDP: after its all-reduce), and the reference loss and gradients of the whole batch."""
    ref_loss, ref_grads = _reference_grads(model_kind, batch)
    b = batch["input_ids"].shape[0]
    res = torchloom.auto_accelerate(_model(model_kind), torch.optim.SGD, None, lambda bt, o: o.loss,
                                    strategy=strategy, optim_args={"lr": 0.0},
                                    dataloader_args={"batch_size": b, "micro_batch_size": micro or b // _dp(strategy)},
                                    model_input_format="unpack_dict")
    seen = record_grads(res.optimizer, res.model)
    local = {}
    res.optimizer.register_step_pre_hook(lambda o, a, k: local.update(
        {n: p.grad.detach().clone() for n, p in res.model.named_parameters() if p.grad is not None
         and not hasattr(p.grad, "full_tensor")}))
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    per = b // dp
    mine = {k: v[r * per:(r + 1) * per] for k, v in batch.items()}
    losses = []
    for k in range(res.grad_accum_steps):
        m = res.micro_batch_size
        losses.append(float(res.train_step({kk: vv[k * m:(k + 1) * m] for kk, vv in mine.items()})))
    t = torch.tensor(sum(losses) / len(losses))
    dist.all_reduce(t, group=res.mesh.group("dp"))
    return {"loss": t.item() / dp, "ref_loss": ref_loss, "grads": seen[-1], "ref_grads": ref_grads,
            "local": local, "notes": res.notes}


def _dp(strategy) -> int:
    dims = strategy[0][1] if strategy and isinstance(strategy[0], tuple) and strategy[0][0] == "parallel_mode" else {}
    return dims.get("dp_shard", 1) * dims.get("dp_replicate", 1)


def split_labels(cp: int, kind: str, seq: int = SEQ) -> list:
    """The shifted labels a rank's shard gets (C21), for ``labels = input_ids = arange(seq)``."""
    ids = torch.arange(seq)[None]
    sp = SequenceSplitter(group=None, cp=cp, rank=dist.get_rank() % cp, kind=kind, load_balance=kind == "ring",
                          model=_model("llama"))
    return sp({"input_ids": ids, "labels": ids.clone()})["labels"][0].tolist()


def split_logits(model_kind: str, batch: dict, cp: int, kind: str = "ring") -> dict:
    """Forward of the whole batch on one process (``use_cache=False``) and split over the cp ranks (C22); the
    rank's logits and the reference's at the same global positions."""
    net = _model(model_kind)
    with torch.no_grad():
        ref = net(**{**batch, "use_cache": False}).logits
        sp = SequenceSplitter(group=dist.group.WORLD, cp=cp, rank=dist.get_rank(), kind=kind,
                              load_balance=kind == "ring", model=net)
        sb = sp(batch)
        with sequence_attention(), sb.activate():
            got = net(**sb).logits
    return {"got": got, "want": sp.layout.shard(ref, 1)}


def cases_2() -> dict:
    """Every 2-rank check of C21-C25."""
    ids = token_batches(2, seq=SEQ)
    one = {"input_ids": ids[:1], "labels": ids[:1].clone()}
    prompt = ids[:1].clone()
    labels = prompt.clone()
    labels[:, :10] = -100  # C23: after the global shift the first 8-token shard has no target
    pos = torch.cat([torch.arange(8), torch.arange(8)])[None]
    packed = token_batches(1, seq=SEQ, seed=7)
    changed = packed.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 128  # a token of document 1
    out = {
        "c21_cp_labels": split_labels(2, "ring"), "c21_ul_labels": split_labels(2, "ulysses"),
        "c21_8_labels": split_labels(2, "ring", seq=8),
        "c21_cp": train_grads("llama", [P(cp=2), "context_parallel", "fsdp"], one),
        "c21_ul": train_grads("llama", [P(cp=2), "ulysses", "fsdp"], one),
        "c23_ul": train_grads("llama", [P(cp=2), "ulysses", "fsdp"], {"input_ids": prompt, "labels": labels}),
        "c23_cp": train_grads("llama", [P(cp=2), "context_parallel", "fsdp"], {"input_ids": prompt, "labels": labels}),
        "c24_ddp": train_grads("llama", [P(cp=2), "ulysses", "ddp"], {"input_ids": ids, "labels": ids.clone()}),
        "c24_none": train_grads("llama", [P(cp=2), "context_parallel"], {"input_ids": ids, "labels": ids.clone()}),
        "c24_fsdp": train_grads("llama", [P(cp=2), "ulysses", "fsdp"], {"input_ids": ids, "labels": ids.clone()}),
    }
    for name, x in (("c22_packed", packed), ("c22_changed", changed)):
        out[name] = split_logits("llama", {"input_ids": x, "position_ids": pos}, 2)
    out["c22_window"] = split_logits("mistral_window4", {"input_ids": packed}, 2)
    return out


def cases_4() -> dict:
    """Every 4-rank check of C21-C25."""
    ids = token_batches(2, seq=SEQ)
    one = {"input_ids": ids[:1], "labels": ids[:1].clone()}
    out = {
        "c21_cp_x_sp": train_grads("llama", [P(cp=4), ("context_parallel", {"ulysses": 2}), "fsdp"], one),
        "c21_cp_tp_sp": train_grads("llama", [P(cp=2, tp=2), "tensor_parallel", "sequence_parallel",
                                              "context_parallel", "fsdp"], one),
        "c24_dp_sp": train_grads("llama", [P(dp_shard=2, cp=2), "ulysses", "fsdp"], {"input_ids": ids,
                                                                                    "labels": ids.clone()}),
        "c25_replicated_kv": train_grads("qwen2_4_2", [P(cp=4), "ulysses", "fsdp"], one),
    }
    try:
        train_grads("qwen2_6_2", [P(cp=4), "ulysses", "fsdp"], one)
        out["c25_uneven_error"] = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        out["c25_uneven_error"] = f"{type(e).__name__}: {e}"
    return out
