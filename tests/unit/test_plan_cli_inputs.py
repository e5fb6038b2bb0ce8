"""``loom plan`` on bad input, in-process (click's CliRunner): every config field the analysis reads is checked
before anything is traced (exit 2 naming the field, its value and the rule, never a traceback), sizes above the
sanity bounds are refused, ``--json`` has the text form's exit codes and a ``fits`` field, and a long plan says
what it is doing. Nothing is launched; the configs are tiny."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from torchloom.cli import main

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
MOE = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
ONE_GPU = ["--gpu", "h100", "--gpus", "1", "--strategy", "ddp", "--seq-len", "128"]


def _plan_config(tmp_path, cfg, *args):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return CliRunner().invoke(main, ["plan", str(p), *args])


def _named_error(r):
    """exit 2, one ``error:`` line on stderr, no traceback (a SystemExit, not an exception, ended the run)."""
    assert r.exit_code == 2, (r.exit_code, r.output, repr(r.exception))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stderr.startswith("error: ") and "Traceback" not in r.output, r.output
    return r.stderr


# (config, the words the message must hold); the case first
BAD_FIELDS = [
    ({**TINY, "hidden_size": 896, "num_attention_heads": 28, "num_key_value_heads": 5},
     ["num_attention_heads 28 is not divisible by num_key_value_heads 5"]),
    ({**TINY, "num_key_value_heads": 8}, ["num_attention_heads 4 is not divisible by num_key_value_heads 8"]),
    ({**TINY, "num_key_value_heads": 0}, ["num_key_value_heads 0", ">= 1"]),
    ({**TINY, "num_attention_heads": 0}, ["num_attention_heads 0", ">= 1"]),
    ({**TINY, "hidden_size": 65}, ["hidden size (65)", "attention heads (4)"]),  # transformers' own rule, named
    ({**TINY, "hidden_size": -64}, ["hidden_size -64", ">= 1"]),
    ({**TINY, "hidden_size": "64"}, ["hidden_size '64'", "positive integer", "string"]),
    ({**TINY, "hidden_size": 64.5}, ["hidden_size 64.5", "positive integer", "float"]),
    ({**TINY, "hidden_size": True}, ["hidden_size True", "positive integer", "bool"]),
    ({**TINY, "head_dim": 0}, ["head_dim 0", ">= 1"]),
    ({**TINY, "head_dim": -1}, ["head_dim -1", ">= 1"]),
    ({**TINY, "head_dim": 15}, ["head_dim", "15", "even"]),  # RoPE (transformers' rule, named)
    ({**TINY, "num_hidden_layers": 0}, ["num_hidden_layers 0", ">= 1"]),
    ({**TINY, "num_hidden_layers": -1}, ["num_hidden_layers -1", ">= 1"]),
    ({**TINY, "num_hidden_layers": 2.0}, ["num_hidden_layers", "expected int", "2.0"]),
    ({**TINY, "vocab_size": 0}, ["vocab_size 0", ">= 1"]),
    ({**TINY, "vocab_size": None}, ["vocab_size is null", "positive integer"]),
    ({**TINY, "intermediate_size": 0}, ["intermediate_size 0", ">= 1"]),
    ({**TINY, "intermediate_size": -5}, ["intermediate_size -5", ">= 1"]),
    ({**TINY, "max_position_embeddings": 0}, ["max_position_embeddings 0", ">= 1"]),
    ({**TINY, "max_position_embeddings": -1}, ["max_position_embeddings -1", ">= 1"]),
    ({**TINY, "torch_dtype": "float13"}, ["torch_dtype 'float13'", "dtype"]),
    ({**TINY, "dtype": "float13"}, ["dtype 'float13'", "dtype"]),
    ({**TINY, "hidden_act": "swishy"}, ["hidden_act 'swishy'", "activation"]),
    ({**MOE, "num_experts_per_tok": 5}, ["num_experts_per_tok 5 is more than num_local_experts 4"]),
    ({**MOE, "num_local_experts": 0}, ["num_local_experts 0", ">= 1"]),
    ({**MOE, "num_experts_per_tok": 0}, ["num_experts_per_tok 0", ">= 1"]),
    ({**GPT2, "n_embd": 65}, ["embed_dim", "65", "divisible", "num_heads", "4"]),
    ({**GPT2, "n_positions": 64}, ["sequence length 128 is longer than n_positions 64", "transformer.wpe"]),
    ({**GPT2, "activation_function": "nope"}, ["activation_function 'nope'"]),
]


@pytest.mark.parametrize("cfg, words", BAD_FIELDS, ids=[" ".join(w[0].split()[:2]) for _, w in BAD_FIELDS])
def test_a_bad_config_field_is_named_with_exit_2_not_a_traceback(tmp_path, cfg, words):
    err = _named_error(_plan_config(tmp_path, cfg, *ONE_GPU))
    assert str(tmp_path / "config.json") in err  # which file
    for w in words:
        assert w in err, (w, err)


def test_the_checks_pass_valid_configs(tmp_path):
    """No false refusal: the tiny configs plan, and the built-in checks accept transformers' own defaults of
    the architectures people plan (GLM-4-MoE's 96 heads over 4,096 hidden: it sets its own head size)."""
    from transformers import CONFIG_MAPPING

    from torchloom.cost.config_checks import check_config

    for cfg in (TINY, MOE, GPT2):
        r = _plan_config(tmp_path, cfg, *ONE_GPU)
        assert r.exit_code == 0, r.output
    for mt in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gpt2", "glm4_moe", "gemma3n_text",
               "xlnet", "swin", "t5"):
        check_config(CONFIG_MAPPING[mt](), mt)


# ------------------------------------------------------------------------------------------- sanity bounds
@pytest.mark.parametrize("args, words", [
    (["--gpu", "h100", "--gpus", "1000000", "--gpus-per-node", "8"], ["--gpus 1,000,000", "131,072", "MAX_GPUS"]),
    (["--gpu", "h100", "--gpus", "4096", "--gpus-per-node", "4096"], ["--gpus-per-node 4,096", "1,024"]),
    (["--local", "--nproc", "5000"], ["--nproc 5,000", "256", "MAX_LOCAL_PROCESSES"]),
    (["--gpu", "h100", "--gpus", "8", "--seq-len", "100000000000"], ["--seq-len 100,000,000,000", "16,777,216"]),
    (["--gpu", "h100", "--gpus", "8", "--global-batch", "1000000000000"], ["--global-batch", "MAX_GLOBAL_BATCH"]),
    (["--gpu", "h100", "--gpus", "8", "--global-batch", "8", "--micro-batch", "16"],
     ["--micro-batch 16 is more than the global batch 8"]),
    (["--gpu", "h100", "--gpus", "8", "--micro-batch", "0"], ["--micro-batch must be >= 1, got 0"]),
])
def test_sizes_above_the_sanity_bounds_are_refused_at_once(args, words):
    r = CliRunner().invoke(main, ["plan", "default", *args])
    err = _named_error(r)
    for w in words:
        assert w in err, (w, err)


# ------------------------------------------------------------------------------------ --json = text form
BIG = {**TINY, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
       "num_key_value_heads": 8, "vocab_size": 128256}  # ~4 B parameters: DDP's 16 B/parameter overflow 40 GB


def test_json_has_the_text_forms_exit_code_and_a_fits_field(tmp_path):
    """A given strategy that does not fit is exit 1 in both forms; ``fits`` is in the JSON (top level and per
    candidate); a fitting one is exit 0 with ``fits: true``."""
    args = ["--gpu", "a100-40gb", "--gpus", "2", "--seq-len", "512", "--global-batch", "2"]
    text = _plan_config(tmp_path, BIG, *args, "--strategy", "ddp")
    assert text.exit_code == 1 and "DOES NOT FIT" in text.stdout, text.output
    r = _plan_config(tmp_path, BIG, *args, "--strategy", "ddp", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["fits"] is False and d["candidates"][0]["fits"] is False
    r = _plan_config(tmp_path, TINY, *args, "--strategy", "ddp", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["candidates"][0]["fits"] is True


def test_json_when_nothing_fits_is_exit_1_with_fits_false(tmp_path):
    r = _plan_config(tmp_path, BIG, "--gpu", "a100-40gb", "--gpus", "1", "--seq-len", "512", "--exclude",
                     "cpu_offload", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.stdout)
    assert d["fits"] is False and d["candidates"] == [] and "fits no candidate" in d["no_fit"]
    assert r.stderr.startswith("no fit: ")


# ------------------------------------------------------------------------------------------------ progress
def test_a_long_plan_says_what_it_is_doing(monkeypatch):
    from torchloom.search import plan_cli

    monkeypatch.setattr(plan_cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(plan_cli, "PROGRESS_EVERY_S", 0.0)
    r = CliRunner().invoke(main, ["plan", "default", "--gpu", "a100", "--gpus", "4", "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # progress goes to stderr: stdout stays one JSON object
    for phase in ("loom plan: resolving the model default", "loom plan: analysing default on the meta device",
                  "loom plan: searching the plans for 4 ranks", "loom plan: predicting candidate 1 of "):
        assert phase in r.stderr, (phase, r.stderr[:2000])


def test_progress_is_quiet_for_a_short_plan_and_throttled():
    from torchloom.search.plan_cli import Progress

    lines = []
    with Progress(lines.append, after_s=60.0, every_s=1.0) as p:
        p.update("searching")
    assert lines == []
    with Progress(lines.append, after_s=0.0, every_s=60.0) as p:
        p.update("analysing")
        p.update("searching")  # within every_s of the last line: not printed
    assert len(lines) == 1 and lines[0].startswith("loom plan: analysing (")


# ------------------------------------------------------------------------------ missing or misspelled sizes
def _without(cfg: dict, *keys: str, **extra) -> dict:
    return {**{k: v for k, v in cfg.items() if k not in keys}, **extra}


MISSING = [  # (config, the words the message must hold); the case first
    (_without(TINY, "hidden_size", hidden_dim=64),
     ["hidden_size is not set", "llama default (hidden_size=4096)", "'hidden_dim' is not a llama config field: did "
      "you mean hidden_size?"]),
    (_without(TINY, "hidden_size", "num_attention_heads", "num_key_value_heads"),
     ["hidden_size, num_attention_heads are not set", "hidden_size=4096, num_attention_heads=32", "set them"]),
    (_without(TINY, "vocab_size"), ["vocab_size is not set", "vocab_size=32000"]),
    (_without(TINY, "num_hidden_layers", num_layer=2), ["num_hidden_layers is not set", "'num_layer'"]),
    (_without(TINY, "intermediate_size", intermediate=128), ["intermediate_size is not set", "'intermediate'"]),
    (_without(MOE, "num_local_experts"), ["num_local_experts is not set", "mixtral default (num_local_experts=8)"]),
    (_without(MOE, "num_key_value_heads"), ["num_key_value_heads is not set", "num_key_value_heads=8"]),
    (_without(GPT2, "n_embd", hidden=64), ["n_embd is not set", "gpt2 default (n_embd=768)"]),
]


@pytest.mark.parametrize("cfg, words", MISSING, ids=[w[0].split(" is")[0].split(" are")[0] for _, w in MISSING])
def test_a_missing_or_misspelled_size_is_named_with_exit_2(tmp_path, cfg, words):
    """transformers would fill a size the config leaves out with another model's number (Llama's 4,096 hidden):
    exit 2 naming it, the default it would have been, and the unknown key that looks like it."""
    err = _named_error(_plan_config(tmp_path, cfg, *ONE_GPU))
    assert str(tmp_path / "config.json") in err
    for w in words:
        assert w in err, (w, err)


def test_a_size_transformers_derives_is_kept_with_a_note(tmp_path):
    """num_key_value_heads unset in a Llama config is num_attention_heads in transformers (its default is None,
    not a number): planned, with a note; GPT-2's n_inner (4 x n_embd) needs none."""
    r = _plan_config(tmp_path, _without(TINY, "num_key_value_heads"), *ONE_GPU)
    assert r.exit_code == 0, r.output
    assert "note     num_key_value_heads not set: transformers uses num_attention_heads" in r.stdout, r.stdout
    r = _plan_config(tmp_path, GPT2, *ONE_GPU)
    assert r.exit_code == 0 and "num_key_value_heads" not in r.stdout, r.output


def test_json_on_bad_input_is_an_object_with_exit_code_2(tmp_path):
    """A script reading ``--json`` gets one object in every case: bad input is ``fits: false`` with the error
    and ``exit_code: 2`` (the ``error:`` line stays on stderr); a usage error click finds too."""
    r = _plan_config(tmp_path, _without(TINY, "hidden_size"), *ONE_GPU, "--json")
    err = _named_error(r)
    d = json.loads(r.stdout)
    assert d == {"schema": 1, "fits": False, "error": err[len("error: "):].strip(), "exit_code": 2}
    r = CliRunner().invoke(main, ["plan", "default", "--gpus", "many", "--json"])
    assert r.exit_code == 2
    d = json.loads(r.stdout)
    assert d["fits"] is False and d["exit_code"] == 2 and "--gpus" in d["error"] and "many" in d["error"]
    r = _plan_config(tmp_path, TINY, *ONE_GPU, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["exit_code"] == 0


def test_a_small_model_is_counted_in_k_or_m_not_0_00_b():
    from torchloom.search.plan_cli import count

    assert [count(n) for n in (70_553_706_496, 4_460_000, 107_136, 512)] == ["70.55 B", "4.46 M", "107.14 K", "512"]
    r = CliRunner().invoke(main, ["plan", "default", *ONE_GPU])
    assert r.exit_code == 0, r.output
    assert re.search(r"model    default \(\d+\.\d\d M parameters;", r.stdout), r.stdout[:300]


def test_analyze_config_refuses_a_dict_missing_a_size_too():
    from torchloom.cost.analysis import analyze_config

    with pytest.raises(ValueError, match=r"the llama config: hidden_size is not set.*'hidden_dim'.*hidden_size\?"):
        analyze_config(_without(TINY, "hidden_size", hidden_dim=64), seq_len=8)


def test_a_misspelled_model_type_gets_a_suggestion(tmp_path):
    err = _named_error(_plan_config(tmp_path, {**TINY, "model_type": "llamma"}, *ONE_GPU))
    assert "model_type 'llamma' is not known to transformers. Did you mean 'llama'" in err, err
