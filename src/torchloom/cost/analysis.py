"""Model analysis for planning: parameters, repeated blocks, FLOPs, GEMM shapes and activation memory of a
model, traced with fake tensors so that nothing the size of the model is allocated and the model is not
changed (a meta-device model works the same as a CPU one).

How: every parameter and buffer gets a fake CPU stand-in (``FakeTensorMode``; only shapes and dtypes), and
``torch.func.functional_call`` runs the model on them. One forward of the whole model, with every
repeated block replaced for the duration of the call by a pass-through, captures each block class's real
call (``args``/``kwargs``: position embeddings, masks, ...) and traces the "rest" (embeddings, final norm,
head, loss); ONE instance per block class is then traced forward + backward on those inputs and multiplied
by the number of instances. Each trace runs twice: in fp32 and under ``torch.autocast("cpu", bfloat16)``
(activation bytes of both precisions). See :mod:`torchloom.cost.op_trace` for what is counted.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
from collections import Counter, OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..parallel.blocks import detect_block_classes, find_blocks
from .experts_analysis import experts_info, moe_trace
from .hf_config import build_meta_model, hf_config_of, load_config, model_dims, model_family
from .model_info import ModelInfo, PartInfo
from .op_trace import ATTENTION_TRACES, FlashAttentionMode, OpRecorder, storage_key

_FORMATS = (None, "unpack_sequence", "unpack_dict")
_CACHE: "OrderedDict[tuple, ModelInfo]" = OrderedDict()
_CACHE_SIZE = 8


def analyze_model(model: nn.Module, *, seq_len: int, sample_input: Any = None, input_format: str | None = None,
                  loss_func: Callable[[Any, Any], torch.Tensor] | None = None,
                  block_classes: list[str] | None = None, name: str | None = None,
                  attention: str = "native") -> ModelInfo:
    """Analyse ``model`` for the planner without allocating it or changing it.

    Args:
        model: the single-device model, on any device (``meta`` included). Its parameters, buffers,
            hooks, dtype, device and train/eval flags are the same afterwards.
        seq_len: tokens per sample. For a Hugging Face model taking ``input_ids`` and ``labels`` (causal
            LMs, T5) the trace input is ``input_ids`` and ``labels`` of shape ``(1, seq_len)``; for other
            models ``sample_input`` defines the shapes and ``seq_len`` is recorded as given.
        sample_input: one batch at micro-batch 1 (tensors on any device; only shapes and dtypes are read).
            A batch whose tensors share a leading dimension B > 1 is cut to its first sample (noted).
        input_format: how the batch is passed, as in ``auto_accelerate``: None -> ``model(batch)``,
            ``"unpack_sequence"`` -> ``model(*batch)``, ``"unpack_dict"`` -> ``model(**batch)``.
        loss_func: ``loss_func(batch, output) -> scalar``; default ``output.loss`` when the output has one,
            else ``output.sum()`` as a stand-in (noted in ``info.notes``).
        block_classes: class names of the repeated blocks; default: auto-detected
            (:func:`torchloom.parallel.blocks.detect_block_classes`).
        name: label of the result (default the class name).
        attention: how attention is traced (:data:`~torchloom.cost.op_trace.ATTENTION_TRACES`): ``"native"``
            as this machine runs it, ``"flash"`` as a GPU's flash kernel (what ``loom plan --gpu`` prices).

    Returns:
        :class:`ModelInfo` with one :class:`PartInfo` per block class (per instance; ``count`` instances)
        and ``"rest"``; every quantity at micro-batch 1 (activations and FLOPs scale linearly with it).

    Raises:
        ValueError: bad ``seq_len``/``input_format``, no ``sample_input`` for a model that needs one, or a
            model whose forward cannot run on fake tensors (the message names the failing op/module).
        StrategyError: a requested block class does not occur in the model.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}.")
    if input_format not in _FORMATS:
        raise ValueError(f"input_format={input_format!r} is not valid; use None, 'unpack_sequence' or 'unpack_dict'.")
    if attention not in ATTENTION_TRACES:
        raise ValueError(f"attention={attention!r} is not valid; use one of {ATTENTION_TRACES}.")
    sig = signature(model, seq_len, sample_input)
    key = (sig, tuple(block_classes) if block_classes is not None else None, input_format, name, attention)
    # cache meta models only (``loom plan`` re-analyses built-in configs; a CPU model would be kept alive)
    cacheable = loss_func is None and sample_input is None and all(p.is_meta for p in model.parameters())
    if cacheable and key in _CACHE and _CACHE[key].module is model:
        _CACHE.move_to_end(key)
        return _copy_info(_CACHE[key])
    info = _Analysis(model, seq_len, sample_input, input_format, loss_func, block_classes, attention).run()
    info.name = name or type(model).__name__
    info.signature = sig
    if cacheable:
        _CACHE[key] = info
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
        return _copy_info(info)
    return info


def analyze_config(hf_config: Any, *, seq_len: int | None = None, name: str | None = None,
                   where: str | None = None, attention: str = "native") -> ModelInfo:
    """Build a Hugging Face model from its config on the meta device (no memory) and analyse it.

    Args:
        hf_config: a ``transformers.PretrainedConfig``, a ``config.json`` dict (with ``model_type``) or a
            path to such a JSON file.
        seq_len: tokens per sample; default ``config.max_position_embeddings`` (a warning says so).
        name: label (default ``config.model_type``).
        where: what to call the config in error messages (default: its ``model_type``).
        attention: as in :func:`analyze_model`.

    The model is built with fp32 parameters (the planner's master weights, whatever ``torch_dtype`` the
    config names) via ``AutoModelForCausalLM.from_config``, else the seq2seq or base auto class. The config's
    architecture fields are checked first (:func:`torchloom.cost.config_checks.check_config`), and a
    ``seq_len`` longer than a learned position table (GPT-2's ``n_positions``) is refused: the real run would
    index past it, the fake-tensor trace would not notice.

    Raises:
        ValueError: the config has no ``model_type`` transformers knows, no ``seq_len`` can be found, a bad
            architecture field (``ModelSpecError``, a ``ValueError``: the field, its value and the rule), a dict
            leaving out a size transformers would fill with another model's default (named), a config
            transformers cannot build a model from, or ``seq_len`` above a learned position table.
    """
    import warnings

    from .config_checks import check_config
    from .presets import ModelSpecError, transformers_reason

    cfg = load_config(hf_config)
    where = where or f"the {cfg.model_type} config"
    check_config(cfg, where)
    if seq_len is None:
        seq_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if not seq_len:
            raise ValueError(f"pass seq_len: the {cfg.model_type} config has no max_position_embeddings.")
        warnings.warn(f"analyze_config: no seq_len given; using the config's max_position_embeddings={seq_len}.",
                      stacklevel=2)
    try:
        model = build_meta_model(cfg)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001  (an unknown activation or rope type: KeyError, ...)
        raise ModelSpecError(f"{where}: transformers cannot build the {cfg.model_type} model: "
                             f"{type(e).__name__}: {transformers_reason(e)}") from e
    _check_positions(model, cfg, int(seq_len), where)
    info = analyze_model(model, seq_len=int(seq_len), name=name or cfg.model_type, attention=attention)
    return info


def _check_positions(model: nn.Module, cfg: Any, seq_len: int, where: str) -> None:
    """Refuse ``seq_len`` above a learned absolute position table (an embedding other than the token one with
    as many rows as the config's position limit): the real model indexes it per position, so a longer
    sequence fails at the first step; rotary/relative models have no such table and are not limited here.

    Raises:
        ModelSpecError: ``seq_len`` above the table, naming the config field and the module.
    """
    from .presets import ModelSpecError

    key = next((k for k in ("n_positions", "max_position_embeddings") if isinstance(getattr(cfg, k, None), int)), None)
    if key is None or seq_len <= getattr(cfg, key):
        return
    limit = getattr(cfg, key)
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for qual, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m is not tokens and m.num_embeddings == limit:
            raise ModelSpecError(f"{where}: sequence length {seq_len} is longer than {key} {limit}: the model "
                                 f"learns one position embedding per position ({qual}, {limit} rows), so a real "
                                 f"run fails past {limit}; pass --seq-len <= {limit} (or raise {key}).")


def sample_seq_len(sample: Any) -> int | None:
    """Tokens per sample of a batch, or None when its input has no sequence dimension.

    The first tensor with at least 2 dims decides: integer token ids ``(B, S)`` / ``(B, S, K)`` or a float
    ``(B, S, H)`` (embeddings, time series) -> its dim 1; a float ``(B, F)`` (feature vectors), anything with 4
    or more dims ``(B, C, H, W...)`` (images, volumes) or a ``uint8`` image ``(B, H, W)`` -> None: dim 1 holds
    features, channels or rows, not tokens. A float ``(B, C, L)`` (a 1-D convolution's input) reads as a
    sequence of C; give the length explicitly there (``search={'seq_len': L}``).

    Raises:
        ValueError: no tensor with at least 2 dims.
    """
    for t in tree_flatten(sample)[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            if t.dim() >= 4 or (t.dtype == torch.uint8 and t.dim() == 3):
                return None
            if t.is_floating_point() or t.is_complex():
                return int(t.shape[1]) if t.dim() == 3 else None
            return int(t.shape[1])
    raise ValueError("the sample batch has no tensor with a batch and a sample dimension.")


def signature(model: nn.Module, seq_len: int, sample_input: Any = None) -> str:
    """Stable hash (16 hex digits) of the class name, every parameter's and buffer's name, shape and dtype,
    ``seq_len`` and the sample input's tensor shapes/dtypes: the plan-cache key."""
    h = hashlib.sha256()
    h.update(type(model).__qualname__.encode())
    for n, p in model.named_parameters(remove_duplicate=False):
        h.update(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    for n, b in model.named_buffers(remove_duplicate=False):
        h.update(f"{n}:{tuple(b.shape)}:{b.dtype};".encode())
    h.update(f"seq={seq_len}".encode())
    if sample_input is not None:
        leaves, spec = tree_flatten(sample_input)
        h.update(str(spec).encode())
        h.update(str([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                      for t in leaves]).encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------
@dataclass
class _Group:
    """Instances of one block class with identical parameter shapes."""

    name: str
    modules: list[nn.Module]
    prefixes: list[str]
    call: tuple | None = None  # captured (args, kwargs) of the first instance
    template: Any = None  # (leaves, spec) of the first instance's output
    traced: dict[str, Any] = field(default_factory=dict)


class _Analysis:
    def __init__(self, model, seq_len, sample_input, input_format, loss_func, block_classes, attention="native"):
        self.model, self.seq_len = model, seq_len
        self.attention = attention
        self.sample_input, self.input_format, self.loss_func = sample_input, input_format, loss_func
        self.block_classes = block_classes
        self.notes: list[str] = []
        self.samples = 1  # samples per traced batch (the rest is also traced at 2 and 3: see _trace_rest)
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def _kernels(self):
        """The attention kernel the trace stands for (a no-op for ``"native"``)."""
        if self.attention != "flash":
            return nullcontext()
        cfg = hf_config_of(self.model)
        causal_lm = type(self.model).__name__.endswith("ForCausalLM") or bool(getattr(cfg, "is_decoder", False))
        return FlashAttentionMode(causal_lm, self.notes)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # -- parameters ---------------------------------------------------------------------------------------
    def run(self) -> ModelInfo:
        model = self.model
        classes = list(self.block_classes) if self.block_classes is not None else detect_block_classes(model)
        groups = self._groups(find_blocks(model, classes) if classes else [])
        params = dict(model.named_parameters())  # tied: first name only
        block_ids = {id(p) for g in groups for m in g.modules for p in m.parameters()}
        rest_params = [p for p in params.values() if id(p) not in block_ids]
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            self._note("the model has gradient checkpointing enabled: the traced activations are what "
                       "checkpointing keeps, not the full ones (disable it before planning).")
        with self._train_mode(), moe_trace(model, self.notes), self.mode:
            self.fake = self._fake_state()
            self._capture(groups)
            parts = [self._trace_block(g) for g in groups]
            parts.append(self._trace_rest(groups, rest_params))
        cfg = hf_config_of(model)
        uniq = list(params.values())
        dtypes = Counter()
        for p in uniq:
            dtypes[str(p.dtype).replace("torch.", "")] += p.numel()
        dims = model_dims(cfg)
        n_params = sum(p.numel() for p in uniq)
        experts = experts_info(model, n_params, self.seq_len, dims.get("hidden_size"), self.notes)
        return ModelInfo(
            name=type(model).__name__, seq_len=self.seq_len, parts=parts,
            block_classes=list(dict.fromkeys(type(g.modules[0]).__name__ for g in groups)),
            num_blocks=sum(len(g.modules) for g in groups),
            n_params=n_params, n_trainable=sum(p.numel() for p in uniq if p.requires_grad),
            param_dtype=dtypes.most_common(1)[0][0] if dtypes else "float32",
            tied=_tied_names(model), dims=dims, family=model_family(model, cfg), module=model,
            notes=self.notes, experts=experts, eager_code=eager_code_style(model),
        )

    def _groups(self, blocks: list[tuple[str, nn.Module]]) -> list[_Group]:
        groups: dict[tuple, _Group] = {}
        seen: set[int] = set()
        for qual, mod in blocks:
            if id(mod) in seen:  # the same module listed twice (a shared layer) counts once
                continue
            seen.add(id(mod))
            shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in mod.named_parameters())
            key = (type(mod).__name__, shapes)
            if key not in groups:
                same_class = sum(1 for k in groups if k[0] == key[0])
                label = key[0] if same_class == 0 else f"{key[0]}[{same_class + 1}]"
                groups[key] = _Group(label, [], [])
            groups[key].modules.append(mod)
            groups[key].prefixes.append(qual)
        return list(groups.values())

    @contextmanager
    def _train_mode(self):
        """Trace as training runs (dropout on); every module's flag is restored after."""
        flags = [(m, m.training) for m in self.model.modules()]
        self.model.train()
        try:
            yield
        finally:
            for m, f in flags:
                m.training = f

    def _fake_state(self) -> dict[str, torch.Tensor]:
        """Fake CPU tensor per parameter/buffer name (tied names share one)."""
        out, by_id = {}, {}
        for n, t in [*self.model.named_parameters(remove_duplicate=False),
                     *self.model.named_buffers(remove_duplicate=False)]:
            if id(t) not in by_id:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                by_id[id(t)] = f.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else f
            out[n] = by_id[id(t)]
        return out

    # -- inputs -------------------------------------------------------------------------------------------
    def _batch(self):
        """The fake batch and how to call the model with it: (batch, args, kwargs)."""
        if self.sample_input is None:
            fwd = inspect.signature(self.model.forward).parameters
            if hf_config_of(self.model) is None or "input_ids" not in fwd or "labels" not in fwd:
                raise ValueError(
                    f"{type(self.model).__name__} is not a Hugging Face model taking input_ids and labels: pass "
                    "sample_input (one batch at micro-batch 1), input_format (None, 'unpack_sequence' or "
                    "'unpack_dict', as the model is called) and loss_func(batch, output) to analyse it.")
            # called as a training loop calls it (use_cache left at its default: with use_cache=False
            # transformers sees fake tensors as tracing and builds an explicit causal mask, which the real run
            # does not; the blocks are traced without the cache object)
            ids = torch.zeros(self.samples, self.seq_len, dtype=torch.long)
            batch = {"input_ids": ids, "labels": ids}
            return batch, (), batch
        batch = self._fake_batch(self.sample_input)
        if self.input_format is None:
            return batch, (batch,), {}
        if self.input_format == "unpack_sequence":
            if not isinstance(batch, (list, tuple)):
                raise ValueError(f"input_format='unpack_sequence' needs a list/tuple sample_input, got "
                                 f"{type(batch).__name__}.")
            return batch, tuple(batch), {}
        if not isinstance(batch, dict):
            raise ValueError(f"input_format='unpack_dict' needs a mapping sample_input, got {type(batch).__name__}.")
        return batch, (), dict(batch)

    def _fake_batch(self, batch):
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        sizes = {t.shape[0] for t in leaves}
        cut = len(sizes) == 1 and next(iter(sizes)) > 1
        if cut:
            self._note(f"sample_input has batch size {next(iter(sizes))}: analysed its first sample "
                       "(every quantity is per sample).")

        batched = len(sizes) == 1  # one leading size: the batch dimension

        def fake(t):
            if not isinstance(t, torch.Tensor):
                return t
            shape = (self.samples, *t.shape[1:]) if batched and t.dim() > 0 else t.shape
            f = torch.empty(shape, dtype=t.dtype, device="cpu")
            return f.requires_grad_(t.requires_grad) if t.requires_grad else f

        return tree_map(fake, batch)

    def _loss(self, batch, output):
        if self.loss_func is not None:
            # the forms auto_accelerate accepts: a scalar, a tuple led by it, or SumLoss (its summed total:
            # the same graph whatever the normalisation)
            from ..train_step import SumLoss

            loss = self.loss_func(batch, output)
            if isinstance(loss, SumLoss):
                return loss.total
            if isinstance(loss, (tuple, list)) and loss and isinstance(loss[0], torch.Tensor):
                return loss[0]
            return loss
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
        first = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()),
                     None)
        if first is None:
            raise ValueError(f"{type(self.model).__name__}'s output has no loss and no floating tensor; pass "
                             "loss_func(batch, output).")
        self._note("no loss_func and no output.loss: the loss is output.sum() (a stand-in; pass loss_func for "
                   "the real one).")
        return first.float().sum()

    def _run_model(self, stubs: dict[int, Callable]):
        """One forward of the whole model on the fake state, blocks replaced by ``stubs`` for the call."""
        from torch.func import functional_call

        batch, args, kwargs = self._batch()
        saved = {}
        for mid, (mod, fn) in stubs.items():
            saved[mid] = mod.__dict__.get("forward", _MISSING)
            mod.forward = fn
        try:
            out = functional_call(self.model, self.fake, args, kwargs, tie_weights=True, strict=False)
            return batch, out
        except Exception as e:  # noqa: BLE001  (name what failed and how to proceed)
            if isinstance(e, TypeError) and self.input_format is not None:
                from ..train_step import _raise_if_batch_does_not_fit

                try:  # the batch does not bind to forward: the same message train_step gives for it
                    _raise_if_batch_does_not_fit(e, self.model, args, kwargs, self.input_format)
                except TypeError as named:
                    raise ValueError(f"cannot analyse {type(self.model).__name__}: the sample batch does not fit "
                                     f"its forward: {named}") from e
            raise ValueError(
                f"cannot trace {type(self.model).__name__} on fake tensors: {type(e).__name__}: {e}. The analysis "
                "needs a forward whose shapes do not depend on tensor values; check sample_input/input_format, "
                "or pass block_classes to trace the blocks separately.") from e
        finally:
            for mid, (mod, _) in stubs.items():
                if saved[mid] is _MISSING:
                    del mod.forward
                else:
                    mod.forward = saved[mid]

    # -- capture --------------------------------------------------------------------------------------------
    def _capture(self, groups: list[_Group]) -> None:
        """Record each group's first call (inputs, output structure); later instances pass through."""
        stubs = {}
        for g in groups:
            for i, mod in enumerate(g.modules):
                stubs[id(mod)] = (mod, self._capturing(g, mod) if i == 0 else self._passthrough(g))
        if groups:
            with OpRecorder([]), self._kernels():  # discarded: supplies shapes fake kernels lack (grouped GEMMs)
                self._run_model(stubs)
        for g in groups:
            if g.call is None:
                raise ValueError(f"block {g.prefixes[0]} ({g.name}) was not called by the model's forward; pass "
                                 "block_classes naming the blocks the forward runs.")

    def _capturing(self, g: _Group, mod: nn.Module):
        original = mod.forward  # bound before the stub replaces it

        def forward(*args, **kwargs):
            if g.call is None:
                # a KV cache is recorded empty (as every block finds its own slot) and copied per trace
                g.call = ([_empty_cache(v) for v in args], {k: _empty_cache(v) for k, v in kwargs.items()})
                out = original(*args, **kwargs)
                g.template = tree_flatten(out)
                return out
            return self._passthrough(g)(*args, **kwargs)

        return forward

    def _passthrough(self, g: _Group):
        def forward(*args, **kwargs):
            if g.template is None:
                raise ValueError(f"{g.name} instance called before its first instance {g.prefixes[0]}.")
            leaves, spec = g.template
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            out = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    out.append(leaf)
                    continue
                # the template was recorded on one sample: a batch of several gives outputs of that many
                shape = (self.samples, *leaf.shape[1:]) if leaf.dim() and leaf.shape[0] == 1 else leaf.shape
                match = next((t for t in inputs if t.shape == shape and t.dtype == leaf.dtype), None)
                out.append(match if match is not None else torch.zeros(shape, dtype=leaf.dtype))
            return tree_unflatten(out, spec)

        return forward

    # -- traces ---------------------------------------------------------------------------------------------
    def _trace_block(self, g: _Group) -> PartInfo:
        from torch.func import functional_call

        mod, prefix = g.modules[0], g.prefixes[0] + "."
        state = {n[len(prefix):]: t for n, t in self.fake.items() if n.startswith(prefix)}
        state_list = list({id(t): t for t in self.fake.values()}.values())
        res = {}
        low_state = None

        def trace(precision):  # one forward + backward of the block, parameters as ``precision`` says
            nonlocal low_state
            leaf = _fresh_leaf
            if precision == PARAMS_BF16:
                # the parameters themselves in bf16 (fsdp's mixed precision, half): no autocast, the residual
                # stream and the norms' inputs in bf16 too
                if low_state is None:
                    low_state = {n: _low(t) for n, t in state.items()}
                leaf = _low_leaf
            args = tuple(copy.deepcopy(v) if _is_kv_cache(v) else tree_map(leaf, v) for v in g.call[0])
            kwargs = {k: (copy.deepcopy(v) if _is_kv_cache(v) else tree_map(leaf, v))
                      for k, v in g.call[1].items()}
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            grad_in = {storage_key(t): t.untyped_storage().nbytes() for t in inputs if t.requires_grad}
            other_in = {storage_key(t) for t in inputs if not t.requires_grad}
            run_state = low_state if precision == PARAMS_BF16 else state
            rec = OpRecorder(state_list + (list(low_state.values()) if precision == PARAMS_BF16 else []))
            with rec, rec.saving(), _autocast(precision), self._kernels():
                out = functional_call(mod, run_state, args, kwargs, tie_weights=True, strict=False)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            out_bytes = sum(t.untyped_storage().nbytes() for t in outs if storage_key(t) not in rec.saved)
            rec.end_forward(tree_flatten(out)[0])
            fused_drop = rec.chain_internal_saved_bytes()
            fp8_drop = rec.weight_gemm_input_saving(outs)
            self._backward(rec, outs)
            del out, outs
            shared = sum(b for k, b in rec.saved.items() if k in other_in)  # e.g. rotary cos/sin of every block
            act = sum(b for k, b in rec.saved.items() if k not in other_in)
            created_saved = sum(b for k, b in rec.saved.items() if k not in other_in and k not in grad_in)
            grads = rec.alive_serials(t.grad for t in run_state.values()
                                      if isinstance(t, torch.Tensor) and t.grad is not None)
            peak = rec.peak_allocated(grads) - created_saved - out_bytes
            _clear_grads(run_state.values())
            return dict(rec=rec, act=act, shared=shared, peak=max(0.0, peak), input=float(sum(grad_in.values())),
                        weights=sum(rec.derived_saved.values()), act_fused=max(0.0, act - fused_drop),
                        fp8_drop=fp8_drop)

        for precision in ("float32", "bfloat16", PARAMS_BF16):
            if precision != PARAMS_BF16:
                res[precision] = trace(precision)
                continue
            try:  # parameters cast to bf16: a model that mixes in fp32 tensors of its own cannot run it
                res[precision] = trace(precision)
            except Exception as e:  # noqa: BLE001  (the autocast trace stands in, noted)
                self._note(f"{g.name}: no trace with bf16 parameters ({type(e).__name__}); fsdp/half activations "
                           "are estimated from the autocast trace")
        g.traced = res
        fp = res["float32"]
        rec = fp["rec"]
        params = list({id(p): p for p in mod.parameters()}.values())
        return PartInfo(
            name=g.name, count=len(g.modules), params=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            fwd=rec.cost("fwd"), bwd=rec.cost("bwd"),
            act_bytes={k: float(v["act"]) for k, v in res.items()}, input_bytes=fp["input"],
            peak_extra_bytes=fp["peak"], autocast_weight_bytes=float(res["bfloat16"]["weights"]),
            act_bytes_fused={k: float(v["act_fused"]) for k, v in res.items()},
            fp8_input_saving={k: float(v["fp8_drop"]) for k, v in res.items()},
            peak_extra={k: float(v["peak"]) for k, v in res.items()},
            tensors=sum(1 for p in params if p.requires_grad),
        )

    def _trace_rest(self, groups: list[_Group], rest_params: list[nn.Parameter]) -> PartInfo:
        stubs = {id(m): (m, self._passthrough(g)) for g in groups for m in g.modules}
        state_list = list({id(t): t for t in self.fake.values()}.values())
        res, fused = {}, {}
        fusable = self._fusable_loss()

        def trace(precision, fused_loss=False, samples=1):
            self.samples = samples
            rec = OpRecorder(state_list)
            try:
                with rec, rec.saving(), _autocast(precision), self._kernels(), _loss_kernel(self.model, fused_loss):
                    batch, out = self._run_model(stubs)
                    loss = self._loss(batch, out)
            finally:
                self.samples = 1
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"the loss must be a scalar tensor, got {type(loss).__name__}"
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.")
            del out
            self._backward(rec, [loss] if loss.requires_grad else [])
            del loss, batch
            grads = rec.alive_serials(t.grad for t in state_list if t.grad is not None)
            # block inputs every instance saves but the rest computes once (rotary cos/sin, masks)
            shared = max((g.traced[precision]["shared"] for g in groups), default=0)
            act = sum(rec.saved.values()) + shared * samples
            peak = rec.peak_allocated(grads) - sum(rec.saved.values())
            _clear_grads(state_list)
            return dict(rec=rec, act=act, peak=max(0.0, peak), weights=sum(rec.derived_saved.values()),
                        curve=rec.live_curve(grads), saved=sum(rec.saved.values()))

        def traced(precision, fused_loss=False, need_one=False):
            """The trace's activations and transient at one sample, and the transient's lines in the batch
            size: the rest's transient mixes per-token tensors (logits and their gradient) with state-sized
            ones (the head's and the tied embedding's weight gradients before they accumulate), and which
            moment is the peak depends on the micro-batch. Traced at 2 and 3 samples, every moment's live bytes
            is a line in the batch size; the one-sample values follow from the lines (a one-sample trace runs
            too where its op costs are needed, ``need_one``, or the lines cannot be had)."""
            nonlocal two_point
            two = three = None
            if two_point:
                try:
                    two, three = trace(precision, fused_loss, samples=2), trace(precision, fused_loss, samples=3)
                except Exception as e:  # noqa: BLE001  (a model that runs one sample only: priced as before)
                    two_point = False
                    self._note(f"the rest could not be traced at 2 samples ({type(e).__name__}): its transient is "
                               "priced as the one-sample trace's times the micro-batch")
            lines = _peak_lines(two, three) if two is not None else []
            if need_one or not lines:
                one = trace(precision, fused_loss)
            else:
                one = dict(rec=None, act=three["act"] - two["act"], weights=two["weights"],
                           peak=max(0.0, max(a + b for a, b in lines)))
            one["lines"] = lines
            return one

        two_point = self._batched()
        for precision in ("float32", "bfloat16"):
            res[precision] = traced(precision, need_one=precision == "float32")  # its op costs price the rest
        if fusable:
            try:
                fused = {precision: traced(precision, fused_loss=True) for precision in ("float32", "bfloat16")}
            except Exception as e:  # noqa: BLE001  (a loss_function the stand-in cannot replace: priced eager)
                fused = {}
                self._note(f"the loss could not be traced as a fused kernel ({type(e).__name__}: {e}); compile's "
                           "'loss' component is priced eager")
        rec = res["float32"]["rec"]
        if rec.unshaped_flops() or any(g.traced["float32"]["rec"].unshaped_flops() for g in groups):
            self._note("some FLOPs come from ops without a GEMM shape rule (counted in matmul_flops only).")
        tokens_in = self._input_bytes()
        return PartInfo(
            name="rest", count=1, params=sum(p.numel() for p in rest_params),
            trainable=sum(p.numel() for p in rest_params if p.requires_grad),
            param_bytes=sum(p.numel() * p.element_size() for p in rest_params),
            fwd=rec.cost("fwd"), bwd=rec.cost("bwd"),
            act_bytes={k: float(v["act"]) for k, v in res.items()}, input_bytes=tokens_in,
            peak_extra_bytes=res["float32"]["peak"], autocast_weight_bytes=float(res["bfloat16"]["weights"]),
            peak_extra={k: float(v["peak"]) for k, v in res.items()},
            peak_lines={k: v["lines"] for k, v in res.items() if v["lines"]},
            act_bytes_fused={k: float(v["act"]) for k, v in fused.items()},
            peak_extra_fused={k: float(v["peak"]) for k, v in fused.items()},
            peak_lines_fused={k: v["lines"] for k, v in fused.items() if v["lines"]},
            tensors=sum(1 for p in rest_params if p.requires_grad),
        )

    def _batched(self) -> bool:
        """The batch has a batch dimension the analysis can grow (the default Hugging Face batch, or a
        ``sample_input`` whose tensors share their leading size)."""
        if self.sample_input is None:
            return True
        leaves = [t for t in tree_flatten(self.sample_input)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        return bool(leaves) and len({t.shape[0] for t in leaves}) == 1

    def _fusable_loss(self) -> bool:
        """The loss is a Hugging Face model's own ``loss_function`` on its logits (no ``loss_func``, the default
        batch): the analysis can trace it as a fused cross-entropy kernel (:func:`_loss_kernel`)."""
        return (self.loss_func is None and self.sample_input is None
                and isinstance(getattr(type(self.model), "loss_function", None), property))

    def _input_bytes(self) -> float:
        batch, _, _ = self._batch()
        return float(sum(t.numel() * t.element_size() for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)))

    @staticmethod
    def _backward(rec: OpRecorder, outs: list[torch.Tensor]) -> None:
        if not outs:
            return
        grads = [torch.ones_like(t) for t in outs]
        rec.phase = "bwd"
        with rec:
            torch.autograd.backward(outs, grads)


_MISSING = object()


#: the analysis' trace with bf16 parameters (``act_bytes`` key; StepShape.activation_key selects it)
PARAMS_BF16 = "bfloat16:params"


def _low(t):
    """A bf16 fake copy of a floating state tensor (same requires_grad); others as they are."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.bfloat16).requires_grad_(t.requires_grad)
    return t


def _low_leaf(t):
    """:func:`_fresh_leaf` in bf16 for floating tensors."""
    return _fresh_leaf(_low(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)


def _fresh_leaf(t):
    """A new leaf with the same shape/dtype/requires_grad (the trace starts at the block)."""
    if isinstance(t, torch.Tensor):
        return t.detach().clone().requires_grad_(t.requires_grad) if t.requires_grad else t.detach()
    return t


def _is_kv_cache(v) -> bool:
    """A transformers KV cache object (blocks append their keys/values to it)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(v).__mro__)


def _empty_cache(v):
    """A copy of a KV cache before the first block wrote to it (the real call's cache is unchanged); None
    (the block then runs without a cache) for a cache that cannot be copied (it holds non-leaf tensors)."""
    if not _is_kv_cache(v):
        return v
    try:
        return copy.deepcopy(v)
    except RuntimeError:
        return None


def _clear_grads(tensors) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t.grad = None


#: micro-batches (in analysed samples) at which a moment of the transient must be the peak to be kept
_PEAK_SAMPLES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def _peak_lines(two: dict, three: dict) -> list[tuple[float, float]]:
    """``[(fixed, per_sample), ...]``: the transient above the saved activations at each moment of a trace,
    as a line in the batch size ``b`` (``fixed + b * per_sample``), from the same ops traced at 2 and 3
    samples (at 1 some reshapes are views that copy at 2 or more, so the allocations differ); only the lines
    that are the peak at some micro-batch of :data:`_PEAK_SAMPLES` are kept. Empty when the two traces ran
    different ops (then the one-sample peak scales with the micro-batch)."""
    c2, c3 = two["curve"], three["curve"]
    if len(c2) != len(c3) or not c2:
        return []
    d_saved = three["saved"] - two["saved"]  # the saved activations' growth per sample (in act_bytes)
    lines = [(a - 2.0 * (b - a) - (two["saved"] - 2.0 * d_saved), (b - a) - d_saved) for a, b in zip(c2, c3)]
    keep = {max(range(len(lines)), key=lambda i: lines[i][0] + n * lines[i][1]) for n in _PEAK_SAMPLES}
    return [lines[i] for i in sorted(keep)]


class _FusedCrossEntropy(torch.autograd.Function):
    """What a fused cross-entropy kernel allocates (Inductor's compiled loss, flash-attn's ``CrossEntropyLoss``,
    Liger's): forward reads the logits once and keeps them plus one fp32 log-sum-exp per row (no fp32 copy, no
    log-softmax tensor); backward writes the logits' gradient once, in the logits' dtype. Shapes only: the
    analysis runs it on fake tensors."""

    @staticmethod
    def forward(ctx, logits):
        rows = logits.numel() // max(logits.shape[-1], 1)
        lse = logits.new_empty(rows, dtype=torch.float32)
        ctx.save_for_backward(logits, lse)
        return logits.new_empty((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        logits, _ = ctx.saved_tensors
        return torch.empty_like(logits)


def _fused_loss_function(logits, labels=None, vocab_size=None, **_):
    return _FusedCrossEntropy.apply(logits)


@contextmanager
def _loss_kernel(model: nn.Module, fused: bool):
    """Within: ``model``'s Hugging Face ``loss_function`` is the fused cross-entropy stand-in (``fused``)."""
    if not fused:
        yield
        return
    had = "_loss_function" in model.__dict__
    before = model.__dict__.get("_loss_function")
    model._loss_function = _fused_loss_function
    try:
        yield
    finally:
        if had:
            model._loss_function = before
        else:
            del model._loss_function


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bfloat16" else nullcontext()


def eager_code_style(model: nn.Module) -> str:
    """``"transformers"`` for a Hugging Face model (a class from the ``transformers`` package in its MRO), else
    ``"modules"``: which host cost per op of eager code applies (:mod:`torchloom.cost.eager_overhead`)."""
    return "transformers" if any(c.__module__.startswith("transformers.") for c in type(model).__mro__) \
        else "modules"


def _copy_info(info: ModelInfo) -> ModelInfo:
    out = copy.copy(info)
    out.parts = copy.deepcopy(info.parts)
    out.tied = copy.deepcopy(info.tied)
    out.dims = dict(info.dims)
    out.notes = list(info.notes)
    out.experts = copy.deepcopy(info.experts)
    return out


def _tied_names(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    return [names for names in by_id.values() if len(names) > 1]
