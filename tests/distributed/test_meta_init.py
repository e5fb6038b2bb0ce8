"""Meta-device initialisation under sharding equals the plain CPU build, shard for shard.

A tiny Llama (and a tied GPT-2 under pipelining) is built on the meta device and handed to ``auto_accelerate``
(seed 0); the sharding methods materialise it. Every rank's gathered parameters must equal those of
``tiny_llama(seed=0)`` built on the CPU **bit for bit** (tolerance 0: the same initialisers run in the same
order on plain full-size tensors, and each rank keeps its slice), its rotary buffers too. Any wrong
initialisation is far from that: a build from another seed differs by ~0.1 in every weight, and the
duplicated-shard fault below changed half of every matrix. The fault this
catches: DTensor random ops on CPU draw the same local values on every rank, so row blocks of every weight
came out identical (``q_proj.weight`` rows 0-15 == rows 16-31 on 2 ranks), and the initial model depended on
the layout. ``distinct_halves`` checks that symptom directly.

Layouts: fsdp on Llama, tied Llama and two plain torch models (one whose init reads an earlier init's
value, one with a model-level ``init_weights()``) and ddp on Llama and tied Llama (every rank materialises
the whole model) on 2 ranks; fsdp, HSDP 2x2, TP 2 x FSDP 2 (Llama, and
GPT-2 whose fused ``c_attn`` is ``_StridedShard``), PP 2 x FSDP 2 (1F1B, and interleaved with 2 stages per
rank) and tied GPT-2 under PP 2 x FSDP 2 on 4 ranks. Each group runs in one launch.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchloom
import torchloom.parallel.materialize as materialize
from tests.models import lm_loss, tiny_gpt2, tiny_llama, tiny_t5
from torchloom.parallel import full_init
from torchloom.testing import run_ranks

LAYERS = 4
FSDP_TP = [("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"]
PP_FSDP = [("parallel_mode", {"pp": 2, "dp_shard": 2}), "pipeline_parallel", "fsdp"]
PP_V_FSDP = [("parallel_mode", {"pp": 2, "dp_shard": 2}), ("pipeline_parallel", {"schedule": "interleaved_1f1b"}),
             "fsdp"]
TWO = {"fsdp": ("llama", ["fsdp"]), "fsdp_tied": ("llama_tied", ["fsdp"]),
       "fsdp_reads_earlier_init": ("scaled_mlp", ["fsdp"]), "fsdp_init_weights": ("init_weights", ["fsdp"]),
       "ddp": ("llama", ["ddp"]), "ddp_tied": ("llama_tied", ["ddp"])}
FOUR = {
    "fsdp": ("llama", ["fsdp"]),
    "hsdp": ("llama", [("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"]),
    "tp_fsdp": ("llama", FSDP_TP),
    "tp_fsdp_gpt2_fused": ("gpt2", FSDP_TP),
    "pp_fsdp": ("llama", PP_FSDP),
    "pp_virtual_fsdp": ("llama", PP_V_FSDP),
    "pp_fsdp_gpt2_tied": ("gpt2", PP_FSDP),
}


class ScaledMLP(nn.Module):
    """Plain torch modules whose parent's ``reset_parameters`` rescales a child's weight after the child drew
    it: that call needs the earlier call's full value (an all-gather), not a fresh tensor."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.gain = nn.Parameter(torch.empty(16))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.down.weight.mul_(0.5)
        nn.init.uniform_(self.gain)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.gain


class WithInitWeights(nn.Module):
    """torchtitan style: a model-level ``init_weights()`` (depth-scaled std, a non-persistent buffer) and an
    output head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("pos", torch.arange(8.0), persistent=False)

    def init_weights(self):
        nn.init.normal_(self.emb.weight, std=0.02)
        for i, b in enumerate(self.blocks):
            nn.init.trunc_normal_(b.weight, std=0.02 / (i + 1))
            nn.init.zeros_(b.bias)
        self.pos.copy_(torch.arange(8.0))

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[-1], None]
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _seeded(build):
    def make():
        torch.manual_seed(0)
        model = build()
        if hasattr(model, "init_weights") and not hasattr(model, "config"):  # the plain recipe for that model
            model.init_weights()
        return model
    return make


BUILD = {"llama": lambda: tiny_llama(layers=LAYERS), "llama_tied": lambda: tiny_llama(layers=LAYERS, tie=True),
         "gpt2": lambda: tiny_gpt2(layers=LAYERS), "t5": tiny_t5, "scaled_mlp": _seeded(ScaledMLP),
         "init_weights": _seeded(WithInitWeights)}


def materialise_many(configs: dict[str, tuple[str, list]]) -> dict[str, dict]:
    """Rank function: for each config, ``auto_accelerate`` a meta-built model; return this rank's full
    parameters (gathered over their mesh), its buffers, the RNG's next draw and what :class:`_MeasureCalls`
    counted during materialisation."""
    out = {}
    for tag, (model_name, strategy) in configs.items():
        with torch.device("meta"):
            model = BUILD[model_name]()
        with _MeasureCalls() as measured:
            res = torchloom.auto_accelerate(model, torch.optim.SGD, None, lm_loss, strategy=strategy,
                                            optim_args={"lr": 0.1}, model_input_format="unpack_dict", seed=0)
        next_draw = torch.rand(3)
        params = {}
        model = res.model.module if isinstance(res.model, DistributedDataParallel) else res.model
        for name, p in model.named_parameters():
            params[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        out[tag] = {"params": params, "buffers": buffers, "rank": dist.get_rank(), "next_draw": next_draw,
                    "peak_call_numel": measured.peak, "gathers": measured.gathers, "calls": measured.calls}
    return out


class _MeasureCalls:
    """Counts, while active, the initialisation calls, the largest number of full-tensor elements one call
    allocates (the extra memory) and the all-gathers of earlier values."""

    def __enter__(self):
        self.peak, self.gathers, self.calls, self._now = 0, 0, 0, 0
        self._run, self._start = materialize.run_call, full_init._start_value

        def run_call(call, *a, **kw):
            self.calls += 1
            self._now = 0
            self._run(call, *a, **kw)
            if getattr(call.run, "__name__", "") != "init_weights":  # a model-level init is whole-model by design
                self.peak = max(self.peak, self._now)

        def start_value(s, needs_prior, written, device, fill):
            full = self._start(s, needs_prior, written, device, fill)
            self._now += full.numel()
            self.gathers += int(not s.scratch and needs_prior and id(s.tensor) in written)
            return full

        materialize.run_call, full_init._start_value = run_call, start_value
        return self

    def __exit__(self, *exc):
        materialize.run_call, full_init._start_value = self._run, self._start
        return False


def _reference(model_name: str) -> tuple[dict, dict, set, torch.Tensor, int]:
    """The plain CPU build: parameters by every name, buffers, the tied aliases (later names of one
    tensor), the RNG's next draw after the build, and the largest module's own parameter count."""
    model = BUILD[model_name]()
    next_draw = torch.rand(3)
    params = dict(model.named_parameters(remove_duplicate=False))
    first = dict(model.named_parameters())
    aliases = set(params) - set(first)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return ({n: p.detach() for n, p in params.items()}, dict(model.named_buffers()), aliases, next_draw,
            largest)


def _check(tag: str, model_name: str, ranks: list[dict]) -> None:
    ref_params, ref_buffers, aliases, _, largest = _reference(model_name)
    seen = set()
    for r in ranks:
        got = r[tag]
        for n, v in got["params"].items():
            assert n in ref_params, f"{tag}: unexpected parameter {n}"
            assert torch.equal(v, ref_params[n]), \
                f"{tag} rank {got['rank']}: {n} differs from the CPU build (max |diff| " \
                f"{(v - ref_params[n]).abs().max().item():.3g})"
            assert distinct_halves(v), f"{tag}: {n} has identical halves (duplicated shards)"
            seen.add(n)
        for n, b in got["buffers"].items():
            assert torch.equal(b, ref_buffers[n]), f"{tag} rank {got['rank']}: buffer {n} differs"
    # every parameter of the model is held by some rank (pipeline stages split them; a tied tensor is
    # reported under its first name only)
    missing = set(ref_params) - seen - aliases
    assert not missing, f"{tag}: no rank holds {sorted(missing)}"
    for r in ranks:  # extra memory: one module's full tensors at a time
        assert 0 < r[tag]["calls"] and r[tag]["peak_call_numel"] <= largest, (tag, r[tag]["peak_call_numel"], largest)


def distinct_halves(t: torch.Tensor) -> bool:
    """False when the two halves along dim 0 (and dim 1) of a matrix are equal: the duplicated-shard
    symptom. Norm weights (all ones) and zero biases are exempt."""
    if t.dim() < 1 or t.shape[0] < 2 or t.unique().numel() <= 1:
        return True
    halves = [t.chunk(2, 0)] + ([t.chunk(2, 1)] if t.dim() == 2 else [])
    return not any(a.shape == b.shape and torch.equal(a, b) for a, b in halves)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(materialise_many, 4, FOUR, timeout=900)


@pytest.mark.distributed
def test_meta_init_fsdp_equals_cpu_build_2ranks():
    ranks = run_ranks(materialise_many, 2, TWO, timeout=600)
    for tag, (model_name, _) in TWO.items():
        _check(tag, model_name, ranks)
        # the RNG is left where the plain build leaves it (dropout after init does not depend on the layout)
        assert torch.equal(ranks[0][tag]["next_draw"], _reference(model_name)[3]), tag
    # Llama's initialisers overwrite whole tensors: no all-gather; ScaledMLP reads its child's weight: one
    assert [r["fsdp"]["gathers"] for r in ranks] == [0, 0]
    assert [r["fsdp_reads_earlier_init"]["gathers"] for r in ranks] == [1, 1]


@pytest.mark.distributed
@pytest.mark.parametrize("tag", list(FOUR))
def test_meta_init_equals_cpu_build_4ranks(four_ranks, tag):
    _check(tag, FOUR[tag][0], four_ranks)


def test_distinct_halves_catches_duplicated_shards():
    """The check can fail: a weight whose row blocks repeat (what the bug produced) is caught."""
    w = torch.randn(4, 8)
    assert distinct_halves(w)
    assert not distinct_halves(torch.cat([w, w]))
    assert distinct_halves(torch.ones(8))


@pytest.mark.parametrize("model_name", ["llama_tied", "gpt2", "t5", "scaled_mlp", "init_weights"])
def test_unsharded_meta_build_equals_cpu_build(model_name):
    """Without sharding (the path ``auto_accelerate`` takes without fsdp) the replay equals the CPU build bit
    for bit too: T5's three-way tied embedding, GPT-2's Conv1D construction draws, nested PreTrainedModels."""
    ref_params, ref_buffers, _, ref_next, _ = _reference(model_name)
    with torch.device("meta"):
        model = BUILD[model_name]()
    torch.manual_seed(0)
    materialize.materialize_meta_model(model, torch.device("cpu"))
    assert torch.equal(torch.rand(3), ref_next)  # and the RNG is where the plain build leaves it
    for n, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, ref_params[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[n]), n
