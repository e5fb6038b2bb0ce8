"""How ``split`` scopes become a tensor-parallel plan (``{module FQN: style}``); docs/annotations.md, rule 2.

(a) Modules inside a Hugging Face model of a family ``tensor_parallel`` has a built-in plan for
    (``parallel.tensor.plans.auto_plan``: llama, mistral, qwen2, mixtral, gpt2, bert) get that plan's entries,
    restricted to the split scopes; the other modules there stay replicated, as in the built-in plan (norms,
    routers, poolers, classifiers). The built-in plan knows which layers read each other's sharded outputs
    (q/k/v -> o, gate/up -> down, c_attn -> c_proj), so such a group must lie whole in one split scope.
    ``tensor_parallel`` still applies the family's head-count adjustments and divisibility checks.
(b) Elsewhere a shape rule over the Linear (and Hugging Face ``Conv1D``) layers that are children of one
    module. In an ``nn.Sequential`` (children run in order) a Linear directly followed by one reading its
    width (only parameter-free modules between) is column-wise, that one row-wise. In other modules the
    siblings of one shape ``d -> w`` (``d != w``) form a column-wise group when exactly one sibling reads
    width ``w`` (the row-wise layer), no other sibling writes it, and the row-wise layer is registered after
    the group's first layer: gate/up -> down, fc1 -> fc2, Meta's w1/w3 -> w2 (registered w1, w2, w3). Every
    other layer is ``colwise_gather`` (its output is gathered, so it is correct whatever reads it); an
    ``nn.Embedding`` is ``vocab_embedding``. The rule assumes that what lies between a group and its
    row-wise layer works per feature (activations, the gating product), as in an MLP.
(c) What neither rule classifies safely is a StrategyError at plan time naming the modules: part of a
    built-in group, a column-wise group inside a module that counts heads (attention: the rule cannot change
    how it reshapes), ``nn.MultiheadAttention`` (its forward reads the weights directly), and a split scope
    that yields no plan entry at all.

Experts modules and the rest of their MoE block are not seen here: they are expert parallel
(:mod:`.split_experts`), and a split scope that holds experts needs no tensor-parallel entry.

Megatron-LM's layout (Shoeybi et al., 2019): a column-wise group followed by one row-wise layer needs one
all-reduce and never materialises the full intermediate activation on one rank.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import StrategyError
from ..parallel.blocks import shared_parameter_owners

_COLUMN = ("colwise", "fused_qkv")  # built-in styles whose sharded output a following 'rowwise' layer reads
_EXPLICIT = ("pass an explicit plan, which replaces the derived one: auto_accelerate(model, ..., strategy=[("
             "'tensor_parallel', {'plan': {'<module>': 'colwise', ...}})]) (styles: docs/methods/tensor_parallel.md)")


def split_plan(model: nn.Module, split_of: dict[str, Any], expert_scopes=()) -> dict[str, str]:
    """Tensor-parallel styles for the modules in ``split`` scopes (rules (a)-(c), module docstring).

    Args:
        model: the annotated model.
        split_of: every module FQN of ``model`` (module order) -> its split scope (an object with ``label``),
            or None outside every split scope (the modules of MoE blocks, :mod:`.split_experts`, are None).
        expert_scopes: split scopes that hold experts: they need no tensor-parallel entry (their experts are
            expert parallel), so rule (c)'s "no plan entry" error skips them.

    Returns:
        ``{module FQN: style name}`` in module order (styles of ``parallel.tensor.styles.STYLES``).

    Raises:
        StrategyError: rule (c).
    """
    mods = dict(model.named_modules())
    members = {n: s for n, s in split_of.items() if s is not None}
    plan: dict[str, str] = {}
    covered: dict[str, str] = {}  # member -> family of the built-in plan that decides it (rule a)
    for root, module in _family_roots(model, members).items():
        family, targets = _builtin_targets(module, root, mods)
        _check_whole_groups(targets, split_of, family)
        plan.update({n: s for n, s in targets.items() if n in members})
        covered.update({n: family for n in members if _inside(n, root)})
    plan.update(_shape_rule(mods, {n: s for n, s in members.items() if n not in covered}))
    _check_every_scope_used(mods, members, plan, covered, expert_scopes)
    _check_ties(model, plan)
    index = {n: i for i, n in enumerate(mods)}
    return dict(sorted(plan.items(), key=lambda kv: index[kv[0]]))


# -- (a) built-in family plans --------------------------------------------------------------------------
def _inside(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")


def _family_roots(model: nn.Module, members: dict[str, Any]) -> dict[str, nn.Module]:
    """Outermost Hugging Face models (``config.model_type`` of a supported family) holding split modules."""
    from ..parallel.tensor.plans import supported_families

    families = set(supported_families())
    roots: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if any(_inside(name, r) for r in roots):
            continue
        if getattr(getattr(module, "config", None), "model_type", None) in families:
            if any(_inside(n, name) for n in members):
                roots[name] = module
    return roots


def _builtin_targets(root: nn.Module, prefix: str, mods: dict[str, nn.Module]) -> tuple[str, dict[str, str]]:
    """The family name and the built-in plan's parameter-sharding entries under ``root`` (absolute names,
    module order). Sequence-parallel entries are left out: a partial split has no sharded residual stream."""
    from ..parallel.tensor.apply import resolve_plan
    from ..parallel.tensor.plans import auto_plan
    from ..parallel.tensor.styles import SHARDING_STYLES

    plan = auto_plan(root)
    head = f"{prefix}." if prefix else ""
    targets = {head + n: s for n, s in resolve_plan(root, plan).targets.items() if s in SHARDING_STYLES}
    index = {n: i for i, n in enumerate(mods)}
    return plan.family, dict(sorted(targets.items(), key=lambda kv: index[kv[0]]))


def _builtin_groups(targets: dict[str, str]) -> list[list[str]]:
    """Layers the built-in plan splits together: each column-wise run with the row-wise layer after it
    (module order: q, k, v, o; gate, up, down); every other sharded module alone."""
    groups: list[list[str]] = []
    column: list[str] = []
    for name, style in targets.items():
        if style in _COLUMN:
            column.append(name)
        elif style == "rowwise":
            groups.append(column + [name])
            column = []
        else:
            groups.append([name])
    return groups + ([column] if column else [])


def _check_whole_groups(targets: dict[str, str], split_of: dict[str, Any], family: str) -> None:
    for group in _builtin_groups(targets):
        scopes = {split_of[n] for n in group}
        if len(scopes) == 1:
            continue
        where = ", ".join(f"{n} ({targets[n]}, " + (f"split scope '{split_of[n].label}')" if split_of[n] else
                                                   "no split scope)") for n in group)
        parent = _common_parent(group)
        raise StrategyError(
            f"split scope: the built-in {family} tensor-parallel plan splits {where} together (the row-wise layer "
            f"reads the column-wise layers' sharded outputs), but they are not all in one split scope. Put them "
            f"in the same scope (e.g. torchloom.split({_where(parent)}, device_count=N)), or {_EXPLICIT}."
        )


def _where(name: str) -> str:
    return name or "the model root"


def _common_parent(names: list[str]) -> str:
    """The innermost module holding all of ``names`` (``layers.0.self_attn`` for its q/k/v/o)."""
    common: list[str] = []
    for atoms in zip(*(n.split(".")[:-1] for n in names)):
        if len(set(atoms)) > 1:
            break
        common.append(atoms[0])
    return ".".join(common)


# -- (b) the shape rule ---------------------------------------------------------------------------------
def _linear_like(m: nn.Module) -> bool:
    from ..parallel.tensor.conv1d import is_conv1d

    return isinstance(m, nn.Linear) or is_conv1d(m)


def _shape(m: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or a Conv1D (``nx``, ``nf``)."""
    return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else (m.nx, m.nf)


def _shape_rule(mods: dict[str, nn.Module], members: dict[str, Any]) -> dict[str, str]:
    plan = {n: "vocab_embedding" for n in members if isinstance(mods[n], nn.Embedding)}
    by_parent: dict[str, list[str]] = {}
    for n in members:
        if _linear_like(mods[n]):
            parent = n.rpartition(".")[0]
            if isinstance(mods[parent], nn.MultiheadAttention):
                raise StrategyError(
                    f"split scope '{members[n].label}': {parent} is an nn.MultiheadAttention, whose forward reads "
                    f"its projection weights directly, so tensor-parallel styles cannot shard {n}. Leave it out of "
                    f"the split scope, or use separate q/k/v/out Linear modules and {_EXPLICIT}."
                )
            by_parent.setdefault(parent, []).append(n)
    for parent, names in by_parent.items():
        rule = _sequential_styles if isinstance(mods[parent], nn.Sequential) else _sibling_styles
        plan.update(rule(mods, parent, names, members))
    return plan


def _sequential_styles(mods: dict[str, nn.Module], parent: str, names: list[str], members: dict[str, Any]):
    """In an ``nn.Sequential`` the children run in order, so a Linear whose next layer (past parameter-free
    modules such as activations) is a Linear of the same scope reading its width is column-wise, that one
    row-wise: Sequential(Linear(h, 4h), GELU(), Linear(4h, h)) pairs even when 4h == h."""
    styles: dict[str, str] = {}
    prev = None  # the last Linear-like child whose output reaches the next child unchanged in width
    for child, m in mods[parent].named_children():
        name = f"{parent}.{child}" if parent else child
        if _linear_like(m):
            if (prev in names and name in names and members[prev] == members[name] and prev not in styles
                    and _shape(mods[prev])[1] == _shape(m)[0]):
                styles[prev], styles[name] = "colwise", "rowwise"
            prev = name
        elif next(m.parameters(), None) is not None:
            prev = None
    return {n: styles.get(n, "colwise_gather") for n in names}


def _sibling_styles(mods: dict[str, nn.Module], parent: str, names: list[str], members: dict[str, Any]):
    """Styles for the split Linear-like children ``names`` of ``parent`` (rule (b))."""
    prefix = f"{parent}." if parent else ""
    siblings = [prefix + c for c, m in mods[parent].named_children() if _linear_like(m)]  # split or not
    shape = {n: _shape(mods[n]) for n in siblings}
    order = {n: i for i, n in enumerate(siblings)}
    groups: list[tuple[list[str], str]] = []
    for d, w in dict.fromkeys(shape[n] for n in names):
        cols = [n for n in siblings if shape[n] == (d, w)]
        readers = [n for n in siblings if shape[n][0] == w]
        writers = [n for n in siblings if shape[n][1] == w]
        scopes = {members.get(n) for n in cols + readers}  # one split scope holds the whole group
        # the row-wise layer follows the group's first layer: fc1 (h -> 4h), fc2 (4h -> h) is not fc2 -> fc1
        if (d != w and len(readers) == 1 and writers == cols and len(scopes) == 1 and None not in scopes
                and order[readers[0]] > order[cols[0]]):
            groups.append((cols, readers[0]))
    groups.sort(key=lambda g: order[g[0][0]])  # a chain h -> 4h -> 2h -> h pairs its first two layers
    styles: dict[str, str] = {}
    for cols, row in groups:
        if not styles.keys() & {*cols, row}:
            styles.update({c: "colwise" for c in cols})
            styles[row] = "rowwise"
    heads = sorted(k for k, v in vars(mods[parent]).items()
                   if "head" in k.lower() and isinstance(v, int) and not isinstance(v, bool))
    if styles and heads:
        raise StrategyError(
            f"split scope '{members[next(iter(styles))].label}': {_where(parent)} counts heads "
            f"({', '.join(heads)}), so it looks like attention; the shape rule would split "
            f"{', '.join(n for n, s in styles.items() if s == 'colwise')} column-wise and "
            f"{', '.join(n for n, s in styles.items() if s == 'rowwise')} row-wise but cannot change how "
            f"{_where(parent)} reshapes its heads. Leave the attention out of the split scope, or make its forward "
            f"take the head count from the tensor shapes (view(B, T, -1, head_dim)) and {_EXPLICIT}."
        )
    return {n: styles.get(n, "colwise_gather") for n in names}


# -- (c) every scope must split something --------------------------------------------------------------
def _check_every_scope_used(mods, members: dict[str, Any], plan: dict[str, str], covered: dict[str, str],
                            expert_scopes=()) -> None:
    scopes = list(dict.fromkeys(members.values()))
    for scope in scopes:
        if scope in expert_scopes or any(members[n] == scope for n in plan):
            continue
        held = [n for n, s in members.items() if s == scope and next(mods[n].parameters(recurse=False), None)
                is not None]
        kinds = ", ".join(f"{n} ({type(mods[n]).__name__})" for n in held[:6]) + (" ..." if len(held) > 6 else "")
        families = sorted({covered[n] for n in held if n in covered})
        why = (f"the built-in {'/'.join(families)} tensor-parallel plan keeps these replicated" if families else
               "the rule splits only nn.Linear, Conv1D and nn.Embedding modules")
        raise StrategyError(
            f"split scope '{scope.label}' gives no tensor-parallel plan entry: it holds "
            f"{kinds or 'no module with parameters'}, and {why}. Remove the scope, split other modules, or "
            f"{_EXPLICIT}."
        )


def _check_ties(model: nn.Module, plan: dict[str, str]) -> None:
    """Modules sharing a parameter (a tied embedding and head) are split together or not at all: a tied
    weight cannot be a DTensor in one module and a plain tensor in the other."""
    for owners in shared_parameter_owners(model):
        split = [n for n in owners if n in plan]
        if split and len(split) < len(owners):
            rest = [n for n in owners if n not in plan]
            raise StrategyError(
                f"split scope: {', '.join(split)} shares a parameter with {', '.join(rest)} (tied weights), which is "
                f"not split; put {', '.join(rest)} in the split scope too (a tied embedding and head are both split "
                "over the vocabulary), or leave both out."
            )
