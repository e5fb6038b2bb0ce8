"""Per-model-family stage runners: run a contiguous run of an *unmodified* model's units the way the model's
own ``forward`` does (transformers 5.24), so that chaining every stage reproduces ``model(...)`` exactly.

Supported:
  * ``decoder``: Hugging Face causal LMs laid out as ``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head`` whose model forward adds nothing else (model types in
    :data:`DECODER_MODEL_TYPES`: Llama, Mistral, Mixtral, Qwen2, Qwen3).
  * ``gpt2``: ``GPT2LMHeadModel`` (``transformer.wte/wpe/drop/h/ln_f``, ``lm_head``).
  * ``sequential``: ``nn.Sequential`` (one positional input, each child a unit).

Each stage recomputes what every layer needs from the batch's keyword inputs (rotary embeddings, the causal /
padding mask via ``transformers.masking_utils``, default ``position_ids``), so only hidden states travel
between stages.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import StrategyError
from ..context.sequence import active_sequence, labels_preshifted
from .split import StageSpec, Unit
from .stage import child

#: Hugging Face ``config.model_type`` values whose model forward the ``decoder`` runner reproduces
DECODER_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")

#: model inputs a runner may ignore when they hold these values (the model's defaults for training)
_IGNORABLE = {
    "use_cache": (None, False),
    "return_dict": (None, True, False),
    "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "output_router_logits": (None, False),
    "logits_to_keep": (None, 0),
    "cache": (None,),
    "past_key_values": (None,),
    "inputs_embeds": (None,),
    "cache_position": (None,),
}


class Family:
    """A stage runner for one model layout.

    Class attributes:
        name: short name used in notes and errors.
        primary: the model input the first stage takes positionally (``input_ids``).
        stage_inputs: keyword inputs every stage reads from its micro-batch (masks and rotary need them).
        first_stage_inputs: keyword inputs only the first stage reads.
        loss_inputs: inputs only the loss on the last stage reads (``labels``).
        always_kept: parameterless modules every stage keeps (``model.rotary_emb``).
    """

    name = ""
    primary = "input_ids"
    stage_inputs: tuple[str, ...] = ()
    first_stage_inputs: tuple[str, ...] = ()
    loss_inputs: tuple[str, ...] = ()
    always_kept: tuple[str, ...] = ()

    @classmethod
    def matches(cls, root: nn.Module) -> bool:
        raise NotImplementedError

    def units(self, root: nn.Module) -> list[Unit]:
        """The model's cuttable pieces in execution order."""
        raise NotImplementedError

    def forward(self, part: nn.Module, spec: StageSpec, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Run ``spec``'s units of ``part`` on ``x`` (token ids on the first stage, hidden states later)."""
        raise NotImplementedError

    def output(self, part: nn.Module, logits: torch.Tensor, inputs: dict[str, Any]) -> Any:
        """What the user's ``loss_func(batch, output)`` sees for the last stage's ``logits`` (an HF output
        with ``loss`` computed from ``labels`` as the model would, or the tensor itself)."""
        return logits

    def example_inputs(self, root: nn.Module, seq_len: int) -> dict[str, Any]:
        """A synthetic one-sequence batch for profiling."""
        vocab = int(getattr(getattr(root, "config", None), "vocab_size", 128))
        g = torch.Generator().manual_seed(0)
        return {self.primary: torch.randint(0, vocab, (1, seq_len), generator=g)}

    # ------------------------------------------------------------------------------------------------
    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        return (self.primary, *self.first_stage_inputs, *self.stage_inputs, *self.loss_inputs)

    def inputs_for(self, spec: StageSpec) -> tuple[str, ...]:
        """Keyword inputs stage ``spec`` reads from the batch (the routing table, without the primary)."""
        return (*(self.first_stage_inputs if spec.is_first else ()), *self.stage_inputs)

    def bind_inputs(self, signature: inspect.Signature, batch: Any, model_input_format: str | None) -> dict[str, Any]:
        """The model call ``train_step`` would make (``model(batch)``, ``model(*batch)`` or ``model(**batch)``)
        as ``{input name: value}``, checked against what this runner supports.

        Raises:
            ValueError: an input the runner cannot route (``inputs_embeds``, a cache, ...) is set.
            TypeError: the batch does not fit the model's signature or the input format.
        """
        if model_input_format == "unpack_dict":
            if not isinstance(batch, Mapping):
                raise TypeError(f"model_input_format='unpack_dict' needs a mapping batch, got {type(batch).__name__}")
            args, kwargs = (), dict(batch)
        elif model_input_format == "unpack_sequence":
            args, kwargs = tuple(batch), {}
        else:
            args, kwargs = (batch,), {}
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"pipeline_parallel: the batch does not fit the model's forward{signature}: {e}") from e
        inputs: dict[str, Any] = {}
        for k, v in bound.items():
            if signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD:
                inputs.update(v)
            elif signature.parameters[k].kind is inspect.Parameter.VAR_POSITIONAL:
                if v:
                    raise TypeError(f"pipeline_parallel: extra positional inputs {len(v)} are not supported")
            else:
                inputs[k] = v
        for k, v in list(inputs.items()):
            if k in self.accepted_inputs:
                continue
            if k in _IGNORABLE and any(v is d or (not isinstance(v, torch.Tensor) and v == d) for d in _IGNORABLE[k]):
                del inputs[k]
                continue
            raise ValueError(
                f"pipeline_parallel: the {self.name} stage runner cannot route the model input {k!r}={_short(v)}; "
                f"supported inputs: {', '.join(self.accepted_inputs)}. Remove it from the batch (or compute it in "
                f"loss_func, which sees the whole micro-batch)."
            )
        if inputs.get(self.primary) is None:
            raise ValueError(f"pipeline_parallel: the batch has no {self.primary!r} for the first stage.")
        return {k: v for k, v in inputs.items() if v is not None}


def _short(v: Any) -> str:
    return f"<tensor {tuple(v.shape)}>" if isinstance(v, torch.Tensor) else repr(v)[:40]


def _hf_causal_output(part: nn.Module, logits: torch.Tensor, inputs: dict[str, Any]) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = inputs.get("labels")
    loss = None
    if labels is not None and labels_preshifted(labels):
        # a sequence split shifted the labels over the whole sequence: no second shift, and each cp rank's sum
        # divided by the micro-batch's target count over the cp group / cp, so the gradient average over cp gives
        # the micro-batch's per-token mean, as the model's forward would
        info = active_sequence()
        count = (labels != -100).sum().double()
        dist.all_reduce(count, group=info.group)
        loss = part.loss_function(logits=logits, labels=labels, vocab_size=part.config.vocab_size,
                                  shift_labels=labels, num_items_in_batch=count.clamp(min=1).float() / info.layout.cp)
    elif labels is not None:  # the same call the model's forward makes
        loss = part.loss_function(logits=logits, labels=labels, vocab_size=part.config.vocab_size)
    return CausalLMOutputWithPast(loss=loss, logits=logits)


class DecoderFamily(Family):
    """Llama-layout causal LMs (see :data:`DECODER_MODEL_TYPES`)."""

    name = "decoder"
    stage_inputs = ("attention_mask", "position_ids")
    loss_inputs = ("labels",)
    always_kept = ("model.rotary_emb",)

    @classmethod
    def matches(cls, root: nn.Module) -> bool:
        base = getattr(root, "model", None)
        return (getattr(getattr(root, "config", None), "model_type", None) in DECODER_MODEL_TYPES
                and isinstance(getattr(root, "lm_head", None), nn.Module)
                and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")))

    def units(self, root: nn.Module) -> list[Unit]:
        if getattr(root.config, "output_router_logits", False):
            raise StrategyError(
                "pipeline_parallel: config.output_router_logits=True (MoE auxiliary loss) is not supported by the "
                "pipeline stage runner; set it to False."
            )
        layers = [Unit(f"model.layers.{i}", (f"model.layers.{i}",), "block", i) for i in range(len(root.model.layers))]
        return [Unit("model.embed_tokens", ("model.embed_tokens",), "embed"), *layers,
                Unit("model.norm", ("model.norm",), "norm"), Unit("lm_head", ("lm_head",), "head")]

    def forward(self, part, spec, x, attention_mask=None, position_ids=None):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        base = part.model
        kinds = {u.kind for u in spec.units}
        h = base.embed_tokens(x) if "embed" in kinds else x
        blocks = [u.index for u in spec.units if u.kind == "block"]
        if blocks:
            if position_ids is None:  # the model's default
                position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            config = base.config
            layer_types = getattr(config, "layer_types", None)
            default = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
            types = {i: (layer_types[i] if layer_types else default) for i in blocks}
            make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            masks = {t: make[t](config=config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                                position_ids=position_ids) for t in set(types.values())}
            rotary = base.rotary_emb(h, position_ids=position_ids)
            for i in blocks:
                h = child(base.layers, str(i))(h, attention_mask=masks[types[i]], position_embeddings=rotary,
                                   position_ids=position_ids)
        if "norm" in kinds:
            h = base.norm(h)
        if "head" in kinds:
            h = part.lm_head(h)
        return h

    def output(self, part, logits, inputs):
        return _hf_causal_output(part, logits, inputs)


class GPT2Family(Family):
    """``GPT2LMHeadModel``."""

    name = "gpt2"
    first_stage_inputs = ("token_type_ids",)
    stage_inputs = ("attention_mask", "position_ids")
    loss_inputs = ("labels",)

    @classmethod
    def matches(cls, root: nn.Module) -> bool:
        t = getattr(root, "transformer", None)
        return (getattr(getattr(root, "config", None), "model_type", None) == "gpt2"
                and isinstance(getattr(root, "lm_head", None), nn.Module)
                and all(hasattr(t, a) for a in ("wte", "wpe", "drop", "h", "ln_f")))

    def units(self, root):
        if getattr(root.config, "add_cross_attention", False):
            raise StrategyError("pipeline_parallel: GPT-2 with cross-attention is not supported by the stage runner.")
        blocks = [Unit(f"transformer.h.{i}", (f"transformer.h.{i}",), "block", i)
                  for i in range(len(root.transformer.h))]
        return [Unit("transformer.wte", ("transformer.wte", "transformer.wpe", "transformer.drop"), "embed"), *blocks,
                Unit("transformer.ln_f", ("transformer.ln_f",), "norm"), Unit("lm_head", ("lm_head",), "head")]

    def forward(self, part, spec, x, attention_mask=None, position_ids=None, token_type_ids=None):
        from transformers.masking_utils import create_causal_mask

        t = part.transformer
        kinds = {u.kind for u in spec.units}
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if "embed" in kinds:
            h = t.wte(x)
            h = h + t.wpe(position_ids).to(h.device)
            if token_type_ids is not None:
                h = h + t.wte(token_type_ids)
            h = t.drop(h)
        else:
            h = x
        blocks = [u.index for u in spec.units if u.kind == "block"]
        if blocks:
            if attention_mask is not None and attention_mask.ndim < 4:
                attention_mask = attention_mask.view(h.shape[0], -1)
            mask = create_causal_mask(config=t.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                                      position_ids=position_ids)
            for i in blocks:
                # positional (hidden, cache, mask, encoder_hidden_states) as GPT2Model.forward passes them
                h = child(t.h, str(i))(h, None, mask, None, use_cache=False, position_ids=position_ids)
        if "norm" in kinds:
            h = t.ln_f(h)
        if "head" in kinds:
            h = part.lm_head(h)
        return h

    def output(self, part, logits, inputs):
        return _hf_causal_output(part, logits, inputs)


class SequentialFamily(Family):
    """``nn.Sequential``: every child is a unit; one positional input."""

    name = "sequential"
    primary = "input"

    @classmethod
    def matches(cls, root):
        return isinstance(root, nn.Sequential)

    def units(self, root):
        return [Unit(name, (name,), "block", i) for i, (name, _) in enumerate(root.named_children())]

    def forward(self, part, spec, x, **kwargs):
        for u in spec.units:
            x = child(part, u.name)(x)
        return x

    def example_inputs(self, root, seq_len):
        raise StrategyError("pipeline_parallel: balance='profile' needs a token model; use balance='params' for "
                            "nn.Sequential.")


FAMILIES: tuple[type[Family], ...] = (DecoderFamily, GPT2Family, SequentialFamily)


def detect_family(root: nn.Module) -> Family:
    """The runner for ``root``.

    Raises:
        StrategyError: no runner fits; the message names the supported families and the way out.
    """
    for cls in FAMILIES:
        if cls.matches(root):
            return cls()
    model_type = getattr(getattr(root, "config", None), "model_type", None)
    raise StrategyError(
        f"pipeline_parallel: no stage runner for {type(root).__name__}"
        + (f" (model_type={model_type!r})" if model_type else "")
        + ". Supported: Hugging Face causal LMs of model types "
        f"{', '.join(DECODER_MODEL_TYPES)} (model.embed_tokens/layers/norm/rotary_emb + lm_head), GPT2LMHeadModel, "
        "and nn.Sequential. Express the model as an nn.Sequential of its stages' pieces, or leave pipeline_parallel "
        "out of the strategy. (The tracer-based torch.distributed.pipelining.pipeline() split is not used: it "
        "only runs at the exact micro-batch shape it was traced with.)"
    )
