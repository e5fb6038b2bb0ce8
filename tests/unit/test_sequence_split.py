"""The sequence split's pieces without processes: layouts, batch splitting (labels shifted over the whole
sequence, global position ids, padding and documents moved into the SequenceInfo), masks, the loom train
config and the ATorch mapping. Ring/Ulysses numerics: tests/distributed/test_context_parallel.py."""
import pytest
import torch

from torchloom.errors import StrategyError
from torchloom.parallel.context import SequenceInfo, SequenceLayout, SequenceSplitter, labels_preshifted
from torchloom.parallel.context.sequence import activate


def test_zigzag_layout_balances_causal_work_and_unshards():
    lay = [SequenceLayout(2, r) for r in range(2)]
    assert lay[0].indices(8).tolist() == [0, 1, 6, 7] and lay[1].indices(8).tolist() == [2, 3, 4, 5]
    # causal work (keys visible per query, summed) is equal on every rank
    work = [int((lay[r].indices(16) + 1).sum()) for r in range(2)]
    assert work[0] == work[1]
    x = torch.arange(24).view(2, 12)
    shards = [SequenceLayout(3, r).shard(x) for r in range(3)]
    assert torch.equal(SequenceLayout(3, 0).unshard(shards), x)
    assert SequenceLayout(2, 1, load_balance=False).indices(8).tolist() == [4, 5, 6, 7]
    with pytest.raises(StrategyError, match="not a multiple of 8"):
        SequenceLayout(4, 0).indices(12)


class _HF(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, **kwargs):
        return None


class _NoPositions(torch.nn.Module):
    def forward(self, input_ids, labels=None):
        return None


def test_split_batch_shifts_labels_globally_and_keeps_positions_global():
    ids = torch.arange(16).view(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0
    split = SequenceSplitter(group=None, cp=2, rank=1, model=_HF())
    b = split({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), "n": 3})
    assert "attention_mask" not in b and b["n"] == 3
    assert b["input_ids"][0].tolist() == [2, 3, 4, 5] and b["position_ids"][0].tolist() == [2, 3, 4, 5]
    # labels[t] = the token after t over the whole sequence (rank 1's last token's target is token 6)
    assert b["labels"][0].tolist() == [3, 4, 5, 6] and b["shift_labels"] is b["labels"]
    # the HF loss divides by (valid targets of the whole sample batch) / cp: 7 + 5 targets
    assert float(b["num_items_in_batch"]) == pytest.approx(12 / 2)
    info = b.sequence
    assert info.valid is not None and info.valid[1].tolist() == [True] * 6 + [False] * 2
    with activate(info):
        assert labels_preshifted(b["labels"]) and not labels_preshifted(b["labels"].clone())
    assert not labels_preshifted(b["labels"])


def test_packed_position_ids_become_documents_and_masks_follow_them():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    b = SequenceSplitter(group=None, cp=2, rank=0, model=_HF())({"input_ids": torch.zeros(1, 8, dtype=torch.long),
                                                                 "position_ids": pos})
    info = b.sequence
    assert info.document[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert b["position_ids"][0].tolist() == [0, 1, 1, 2]  # global tokens 0, 1, 6, 7
    idx = torch.arange(8)
    m = info.mask(idx, idx, causal=True, batch=1)[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]
    with pytest.raises(ValueError, match="per-sample masks"):
        info.mask(idx, idx, causal=True, batch=2)


def test_sliding_window_mask():
    info = SequenceInfo(SequenceLayout(1, 0), 6, 1, window=2)
    m = info.mask(torch.arange(6), torch.arange(6), causal=True, batch=1)[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False]


def test_split_refusals_name_the_fix():
    split = SequenceSplitter(group=None, cp=2, rank=0, model=_HF())
    with pytest.raises(TypeError, match="mapping batches"):
        split(torch.zeros(2, 8))
    with pytest.raises(StrategyError, match="multiple of 4"):
        split({"input_ids": torch.zeros(2, 6, dtype=torch.long)})
    with pytest.raises(ValueError, match="padding mask"):
        split({"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 1, 8, 8)})
    with pytest.raises(ValueError, match="position_ids"):
        SequenceSplitter(group=None, cp=2, rank=0, model=_NoPositions())({"input_ids": torch.zeros(1, 8).long()})
    windowed = SequenceSplitter(group=None, cp=2, rank=0, model=_HF(), window=4, window_every_layer=False)
    with pytest.raises(ValueError, match="sliding window"):
        windowed({"input_ids": torch.zeros(1, 8, dtype=torch.long)})


def test_model_without_routed_attention_is_refused_after_forward():
    b = SequenceSplitter(group=None, cp=2, rank=0, model=_HF())({"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    with pytest.raises(RuntimeError, match="no attention call"):
        with b.activate():
            pass


def test_loom_train_config_adds_the_split_and_refuses_bad_degrees():
    from torchloom.train.config import ConfigError, TrainConfig

    def cfg(**parallel):
        c = TrainConfig()
        c.model.seq_len, c.model.num_heads, c.model.num_kv_heads = 64, 4, 2
        for k, v in parallel.items():
            setattr(c.parallel, k, v)
        return c

    s = cfg(cp=2).full_strategy()
    assert s == [{"parallel_mode": {"cp": 2}}, "context_parallel", "ddp"]  # ddp reduces over dp x cp
    assert "ulysses" in cfg(ulysses=4).full_strategy()  # 2 kv heads: replicated for 4 ranks
    hybrid = cfg(cp=2, ulysses=2).full_strategy()  # ring 2 x Ulysses 2 on 4 ranks
    assert hybrid[0] == {"parallel_mode": {"cp": 4}} and {"context_parallel": {"ulysses": 2}} in hybrid
    # ring rank 0 (cp ranks 0, 1) holds chunks 0 and 3 of 4, ring rank 1 (cp ranks 2, 3) chunks 1 and 2; its
    # Ulysses members one each
    assert [SequenceLayout(4, r, True, 2).indices(16).tolist()[0] for r in range(4)] == [0, 12, 4, 8]
    for bad, match in ((dict(cp=3), "multiple of 2 x cp"), (dict(ulysses=8), "num_heads"),
                       (dict(cp=3, ulysses=2), "multiple of 2 x 6")):
        with pytest.raises(ConfigError, match=match):
            cfg(**bad).full_strategy()


def test_atorch_sequence_parallel_is_ulysses():
    from torchloom.compat.atorch.strategy_map import translate

    t = translate([("parallel_mode", None, False), ("fsdp", None, False),
                   ("sequence_parallel", {"sp_size": 2, "batch_sp_processing_fn": lambda b: b}, False)], 2)
    assert ("ulysses", {"size": 2, "causal": True}) in t.methods
    assert any("batch_sp_processing_fn is not called" in n for n in t.notes)
    with pytest.raises(StrategyError, match="not supported"):
        translate([("sequence_parallel", {"ring": True}, False)], 2)


def test_sequence_level_labels_and_heads_are_refused():
    from torchloom.parallel.context.install import check_model

    split = SequenceSplitter(group=None, cp=2, rank=0, model=_HF())
    with pytest.raises(ValueError, match="next-token targets"):
        split({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)})

    class LlamaForSequenceClassification(torch.nn.Module):
        config = object()

    with pytest.raises(StrategyError, match="not a causal language model"):
        check_model(LlamaForSequenceClassification(), "context_parallel")


def test_packed_documents_warn_once_unless_use_cache_is_off():
    import warnings

    import torchloom.parallel.context.split as split_mod

    split_mod._WARNED.clear()
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    split = SequenceSplitter(group=None, cp=2, rank=0, model=_HF())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": pos, "use_cache": False})
        assert not caught
        split({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": pos})
        split({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": pos})
    assert len([w for w in caught if "use_cache=False" in str(w.message)]) == 1


def test_masks_the_split_cannot_express_are_refused_at_setup():
    """C22: never silent full-causal attention: mixed sliding/full layers and chunked attention name the mask kind
    when the method is applied."""
    from types import SimpleNamespace

    from torchloom.parallel.context.install import attention_window, check_model

    mixed = SimpleNamespace(config=SimpleNamespace(sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    assert attention_window(mixed) == (4, False)
    every = SimpleNamespace(config=SimpleNamespace(sliding_window=4, layer_types=["sliding_attention"] * 2))
    assert attention_window(every) == (4, True)
    assert attention_window(SimpleNamespace(config=SimpleNamespace(sliding_window=4, use_sliding_window=False))) == (
        None, True)

    class Llama4ForCausalLM(torch.nn.Module):
        config = SimpleNamespace(attention_chunk_size=8192)

    with pytest.raises(StrategyError, match="chunked attention"):
        check_model(Llama4ForCausalLM(), "context_parallel")
