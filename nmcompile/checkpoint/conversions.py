"""Weights that transformers writes under other names and shapes than the model holds them.

transformers 5 converts some checkpoints as it loads them and converts them back as it saves (its
``conversion_mapping``): a Mixtral holds each layer's experts fused, ``mlp.experts.gate_up_proj``
``[experts, 2 * intermediate, hidden]`` and ``mlp.experts.down_proj``, and ``save_pretrained`` writes
them as the Hub's checkpoints hold them, one ``Linear`` weight per expert
(``block_sparse_moe.experts.{e}.w1.weight``, ``w3``, ``w2``); the router ``mlp.gate`` is renamed back to
``block_sparse_moe.gate``. Qwen2-MoE, OLMoE and the other fused-expert models do the same.

:func:`groups` finds, for a model and the names of the tensors its weights files hold, which file
tensors make which of the model's weights, with transformers' own rules (the ones ``from_pretrained``
applies); :meth:`Group.convert` builds the model's weights from the file tensors as ``from_pretrained``
does. ``save_pretrained`` records the file names of each N:M weight in the layout record (so that
``nmcompile check DIR`` checks the tensors the files hold, without a model), and ``load_pretrained
(packed=True)`` builds the converted weights from them. Nothing here runs for a model whose files hold
its weights under its own names.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Group", "groups", "part_dim"]


@dataclass
class Group:
    """File tensors that transformers turns into one or more weights of the model."""

    sources: list[str]  # the file tensors, in the order transformers reads them
    targets: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model name -> shape
    _first: str = ""  # the name transformers keys the conversion by
    _patterns: list[str] = field(default_factory=list)  # the source pattern each source matched (a renaming: itself)
    _template: object = None  # a transformers WeightConverter (None: a renaming, one tensor under another name)
    _model: nn.Module | None = None
    problem: str = ""  # why the weights it makes are not known (then ``targets`` is empty)

    @property
    def renaming(self) -> bool:
        """One file tensor that is the model's weight under another name (no conversion of its values)."""
        return self._template is None

    def convert(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{model name: tensor}``, built from the file tensors that ``read(name)`` gives, as
        ``from_pretrained`` builds them."""
        if self._template is None:
            (source,), (target,) = self.sources, self.targets
            return {target: read(source)}
        converter = copy.deepcopy(self._template)
        for source, pattern in zip(self.sources, self._patterns):
            converter.add_tensor(self._first, source, pattern, (lambda s=source: read(s)))
        made = converter.convert(self._first, model=self._model, config=getattr(self._model, "config", None))
        return {name: (value[0] if isinstance(value, list) else value) for name, value in made.items()}


def _transformers_rules():
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:  # no transformers, or one without checkpoint conversions (before 5)
        return None
    return get_model_conversion_mapping, WeightConverter, dot_natural_key, rename_source_key


def groups(model: nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[Group]:
    """The file tensors (``shapes``: name -> (shape, dtype), as the weights files hold them) that
    transformers loads into ``model`` under other names or shapes, grouped by the weights they make.

    A file tensor the model holds under its own name is in no group; so is one that transformers would
    leave unused. Each group's ``targets`` (names and shapes) come from converting empty (meta) tensors; a
    conversion that does not run on them leaves ``targets`` empty and says why in ``problem``. ``[]`` for a
    model that is not a transformers one, or without transformers. ValueError when transformers' rules
    cannot be read (an internal API of transformers that changed).
    """
    rules = _transformers_rules()
    if rules is None or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return []
    get_model_conversion_mapping, WeightConverter, dot_natural_key, rename_source_key = rules
    found: dict[str, Group] = {}
    try:
        mapping = get_model_conversion_mapping(model)
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        renamings = [t for t in mapping if not isinstance(t, WeightConverter)]
        by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        state = {name: True for name in model.state_dict(keep_vars=True)}
        for key in sorted(shapes, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
            if renamed not in state and key in state:  # as from_pretrained: a key the model holds is not renamed
                continue
            if renamed not in state or (renamed == key and pattern is None):
                continue  # unused by the model, or held under its own name
            group = found.setdefault(renamed, Group([], _first=renamed, _model=model,
                                                    _template=None if pattern is None else by_pattern[pattern]))
            group.sources.append(key)
            group._patterns.append(pattern or key)
    except Exception as err:  # transformers' internals, read where its own loader reads them
        import transformers

        raise ValueError(f"nmcompile cannot read the checkpoint conversions of transformers {transformers.__version__} "
                         f"for {type(model).__name__} ({type(err).__name__}: {err}); save with "
                         "save_original_format=False, which writes the weights under the model's own names") from err
    out = []
    for group in found.values():
        if group.renaming and len(group.sources) > 1:
            group.problem = f"transformers renames each of {', '.join(group.sources[:3])} to {group._first}"
        elif group.renaming:
            group.targets = {group._first: tuple(shapes[group.sources[0]][0])}
        else:
            try:
                made = group.convert(lambda name: torch.empty(shapes[name][0], dtype=shapes[name][1], device="meta"))
                group.targets = {name: tuple(t.shape) for name, t in made.items()}
            except Exception as err:  # transformers' ops raise what they raise; named
                group.problem = (f"transformers' conversion of {', '.join(group.sources[:3])} ... into {group._first} "
                                 f"does not run on empty (meta) tensors ({type(err).__name__}: {err})")
        out.append(group)
    return out


def part_dim(whole: tuple[int, ...], dim: int, part: tuple[int, ...]) -> int | None:
    """The grouping dim of a file tensor ``part`` of a weight of shape ``whole`` grouped along ``dim``
    (counted from the end: transformers stacks and concatenates expert weights along leading dims), or
    None when the part does not keep that dim whole (then it cannot be checked on its own)."""
    from_end = dim - len(whole) if dim >= 0 else dim
    along = len(part) + from_end
    if not 0 <= along < len(part) or -from_end > len(whole) or part[along] != whole[from_end]:
        return None
    return along
