"""Rank functions for tests/distributed/test_hf_save.py (imported by qualified name in spawned ranks)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import torchloom
from tests.models import lm_loss, tiny_llama

SGD = (torch.optim.SGD, {"lr": 0.5})
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def tokenizer():
    """A tiny word-level fast tokenizer built in memory (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(30)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(seed, tie=True), LoraConfig(**LORA))


def _train_one_step(res) -> None:
    """One optimizer step on fixed data (same on tensor-parallel peers), so saved weights are not the init."""
    g = torch.Generator().manual_seed(res.mesh.dp_rank)
    for _ in range(res.grad_accum_steps):
        ids = torch.randint(0, 128, (res.micro_batch_size, 16), generator=g)
        res.train_step({"input_ids": ids, "labels": ids})


def _live_params(model) -> dict[str, torch.Tensor]:
    """This rank's full (unsharded) tensors by plain-model name (a pipeline rank: its stages only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torchloom.checkpoint.state import canonical_key, wrapper_components

    comps = wrapper_components(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {canonical_key(k, comps): v.detach().cpu().clone() for k, v in sd.items()}


def _accelerate(model, strategy):
    return torchloom.auto_accelerate(model, SGD[0], None, lm_loss, strategy=strategy, optim_args=SGD[1],
                                     dataloader_args={"batch_size": 4, "micro_batch_size": 2},
                                     model_input_format="unpack_dict")


CASES = {  # tag -> (strategy, tied embeddings)
    "fsdp": (["fsdp", "checkpoint"], True),
    "ddp": (["ddp", "checkpoint"], False),
    "tp": ([("parallel_mode", {"tp": 2}), "tensor_parallel"], False),
    "pp": ([("pipeline_parallel", {"size": 2})], True),
}


def save_rank(tmp: str) -> dict:
    """Every strategy of CASES trains one step and saves; fsdp also with small shards, a tokenizer, a custom
    generation config and through ``res.model.save_pretrained``; then a LoRA model under fsdp saves its
    adapter and its merged model (and is refused an adapter save over the merged one). Returns per case this
    rank's live full tensors and the returned paths."""
    from torchloom.hf import save_pretrained

    root = Path(tmp)
    out: dict = {"rank": dist.get_rank()}
    for tag, (strategy, tie) in CASES.items():
        model = tiny_llama(0, tie=tie)
        model.generation_config.max_new_tokens = 7  # a non-default value that must reach generation_config.json
        res = _accelerate(model, strategy)
        _train_one_step(res)
        rec = {"params": _live_params(res.model), "notes": res.notes}
        if tag == "fsdp":
            rec["path"] = str(save_pretrained(res.model, root / tag, tokenizer=tokenizer(), max_shard_size="60KB"))
            try:  # refused before anything is gathered or written
                res.model.save_pretrained(root / "refused", push_to_hub=True)
            except TypeError as e:
                rec["refused"] = str(e)
            res.model.save_pretrained(root / "routed")  # HF's method on the sharded model: routed to ours
        elif tag == "pp":  # a PipelinedModel is no HF module: its own save_pretrained is ours
            rec["path"] = str(res.model.save_pretrained(root / tag))
        else:
            rec["path"] = str(save_pretrained(res.model, root / tag))
        out[tag] = rec
        dist.barrier()

    res = _accelerate(lora_model(0), ["fsdp"])
    _train_one_step(res)
    out["lora"] = {"params": _live_params(res.model), "type": type(res.model).__name__,
                   "path": str(save_pretrained(res.model, root / "lora")),
                   "merged": str(save_pretrained(res.model, root / "merged", merge=True))}
    try:  # the adapter into the merged model's folder: refused on every rank before gathering
        res.model.save_pretrained(root / "merged")
    except Exception as e:  # noqa: BLE001 - the test checks the type and message of every rank
        out["lora"]["refused"] = f"{type(e).__name__}: {e}"
    res.model.save_pretrained(root / "lora_routed")
    out["lora"]["after"] = _live_params(res.model)  # merging used a copy: the live adapter is unchanged
    return out
