"""The published-runs validation set (benchmarks/published_runs.yaml): its parser refuses malformed rows by name,
turns a row into the planner's inputs (model config, hardware, candidate), converts published TFLOP/s with the
source's own FLOP count, and the shipped set has the breadth issue [12] asks for."""
import copy
from pathlib import Path

import pytest
import yaml

from benchmarks import published as P

SAMPLE = Path(__file__).resolve().parent / "data" / "published_runs_sample.yaml"


def _rows():
    return yaml.safe_load(SAMPLE.read_text())["runs"]


def test_the_sample_parses_into_planner_inputs():
    tt, gpt = P.load_runs(SAMPLE)
    assert tt.degrees == {"tp": 1, "pp": 1, "cp": 1, "dp": 8, "ep": 1} and not tt.fused
    c = P.candidate(tt)
    assert (c.dims.dp_shard, c.micro_batch, c.grad_accum, c.seq_len) == (8, 2, 1, 8192)
    assert dict(c.methods)["checkpoint"] == {"mode": "selective"} and "compile" not in dict(c.methods)
    hw = P.hardware(tt)
    assert hw.memory_bytes == pytest.approx(89.4 * 2 ** 30) and hw.mem_bw == pytest.approx(2.4e12 * 0.9)
    assert hw.attention_kernel == "flash2"
    # Megatron: TP 8 without sequence parallel, PP 12, DDP over 16, fp16, full AC, fused kernels
    assert gpt.fused and P.hardware(gpt).attention_kernel == "flash3"
    c = P.candidate(gpt)
    names = [n for n, _ in c.methods]
    assert (c.dims.tp, c.dims.pp, c.dims.dp_replicate, c.grad_accum) == (8, 12, 16, 96)
    assert "sequence_parallel" not in names and {"ddp", "checkpoint", "compile"} <= set(names)
    assert dict(c.methods)["amp"] == {"dtype": "float16"}
    cfg = P.model_config(gpt)
    assert cfg["model_type"] == "gpt2" and cfg["n_embd"] == 12288 and cfg["n_positions"] == 2048


def test_megatron_tflops_convert_with_their_own_flop_count():
    """Narayanan et al. 2021 eq. 3 (with recomputation): 96 l h^2 (1 + s/6h + V/16lh) FLOPs per token; 153 TFLOP/s
    per GPU on GPT-3 175B is ~107 tokens/s per GPU."""
    from benchmarks.plan_published import source_flops_per_token

    _, gpt = P.load_runs(SAMPLE)
    fpt = source_flops_per_token(gpt, info=type("I", (), {"dims": {}, "n_params": 0})())
    l, h, s, v = 96, 12288, 2048, 51200
    assert fpt == pytest.approx(96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))
    assert 153e12 / fpt == pytest.approx(107, abs=1)


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.pop("precision"), "missing 'precision'"),
    (lambda r: r.update(precision="int8"), "precision 'int8'"),
    (lambda r: r.update(extra=1), r"unknown field\(s\) \['extra'\]"),
    (lambda r: r["plan"].update(tp=3), "does not divide 8 GPUs"),
    (lambda r: r["batch"].update(global_batch=17), "not a multiple"),
    (lambda r: r.update(published={"memory_gib": 80}), "no published throughput"),
    (lambda r: r.update(source={"name": "x"}), "needs a url"),
    (lambda r: r.update(activation_checkpointing="some"), "activation_checkpointing 'some'"),
    (lambda r: r.update(loss_kernel="chunked"), "loss_kernel 'chunked'"),
])
def test_a_malformed_row_is_refused_by_name(tmp_path, mutate, match):
    rows = _rows()
    bad = copy.deepcopy(rows[0])
    mutate(bad)
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"runs": [bad, rows[1]]}))
    with pytest.raises(P.PublishedRunError, match=match) as e:
        P.load_runs(path)
    assert "torchtitan-llama3.1-8b-8xh100" in str(e.value)


def test_duplicate_ids_are_refused(tmp_path):
    rows = _rows()
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"runs": [rows[0], rows[0]]}))
    with pytest.raises(P.PublishedRunError, match="duplicate ids"):
        P.load_runs(path)


def test_the_shipped_set_is_broad_enough():
    """>= 15 rows, >= 3 accelerator types, dense models from ~1B to >= 175B, >= 2 MoE rows, >= 4 sources."""
    runs = P.load_runs()
    assert len(runs) >= 15
    assert len({r.hardware["gpu"].split("-")[0] for r in runs}) >= 3
    assert sum(1 for r in runs if r.model.get("moe")) >= 2
    sizes = [float(r.model.get("params_b") or 0) for r in runs if not r.model.get("moe")]
    assert min(sizes) <= 3 and max(sizes) >= 175
    assert len({r.source["name"] for r in runs}) >= 4


def test_each_framework_prices_the_kernels_it_ran():
    """Transformer Engine FP8 rows (Megatron-Bridge) keep FP8 GEMM inputs and gather FP8 weights
    (fp8_param_gather); torchtitan's float8 is torchao (bf16 inputs); torchtitan's 2025 rows compiled the loss
    with the model, its 2024 rows did not; llm-foundry's MPT runs flash-attn's fused cross-entropy with eager
    blocks."""
    runs = {r.id: r for r in P.load_runs()}

    def methods(rid):
        return dict(P.candidate(runs[rid]).methods)

    mb = methods("mbridge2511-llama3-70b-64xh100-fp8cs")["float8"]
    assert mb["save_fp8_inputs"] and mb["fsdp_float8_all_gather"]
    assert "save_fp8_inputs" not in methods("tt-llama31-8b-fsdp-compile-float8-8xh100")["float8"]
    assert methods("tt-trainy-llama31-8b-fsdp-32xh200-float8")["compile"] == {"components": ["model", "loss"]}
    assert methods("tt-llama31-8b-fsdp-compile-8xh100-bf16")["compile"] == {}
    assert methods("mpt-7b-a100-40gb-128gpu")["compile"] == {"components": ["loss"]}
