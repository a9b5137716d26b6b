"""Weights a declaration keeps dense unless it names them: output heads, MoE routers and LoRA adapters.

An output head is a small share of a model's weights and writes every logit; a router ([experts,
hidden], a handful of rows) saves almost nothing when pruned while it decides where every token
goes. Leaving both dense is the usual practice of one-shot and sparse-training tools. So a catch-all declaration (``"sr_ste:2:4"``, a ``"*"`` rule,
``"*.weight"``) leaves them dense, and says so in every report. A rule or an ``include`` glob that
spells the layer's own name (``"lm_head"``, ``"*.mlp.gate"``, ``"model.head.weight"``: no wildcard
in the last name) sparsifies it; ``default_dense=[]`` turns the defaults off, and
``default_dense=[globs]`` replaces them.

The built-in globs match module names:

- output heads: ``lm_head``, ``head``, ``classifier`` (and anything inside a ``classifier``),
  ``score``, a top-level ``output``;
- MoE routers: ``gate`` and ``shared_expert_gate`` with fewer rows than columns (a gated MLP's
  ``gate`` projection is wider than its input and is not a router), and anything inside a ``router``;
- LoRA adapters (``peft``'s ``lora_A`` / ``lora_B``): low-rank factors, whose product the backend masks by the
  base layer's mask instead (:mod:`nmcompile.passes.mask_adapter_updates`).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

__all__ = ["HEAD_GLOBS", "ROUTER_GLOBS", "ADAPTER_GLOBS", "DEFAULT_DENSE", "names_explicitly", "default_reason"]

HEAD_GLOBS = (
    "lm_head", "*.lm_head", "head", "*.head", "classifier", "*.classifier", "classifier.*", "*.classifier.*",
    "score", "*.score", "output",
)
ROUTER_GLOBS = ("gate", "*.gate", "*.shared_expert_gate", "router", "*.router", "router.*", "*.router.*")
ADAPTER_GLOBS = ("*.lora_A.*", "*.lora_B.*", "lora_A.*", "lora_B.*")
DEFAULT_DENSE = HEAD_GLOBS + ROUTER_GLOBS + ADAPTER_GLOBS
_WILDCARDS = set("*?[")
_PARAM_SUFFIXES = ("weight", "weight_orig", "original")


def _last_name(glob: str) -> str:
    parts = glob.split(".")
    if len(parts) > 1 and parts[-1] in _PARAM_SUFFIXES:
        parts = parts[:-1]
    return parts[-1]


def names_explicitly(glob: str, param_name: str) -> bool:
    """Whether ``glob`` matches ``param_name`` (or its module) by spelling the layer's own name:
    no wildcard in its last name, a trailing ``.weight`` aside."""
    module = param_name.rpartition(".")[0]
    if not (fnmatchcase(param_name, glob) or fnmatchcase(module, glob)):
        return False
    return not (_WILDCARDS & set(_last_name(glob)))


def _is_router_shape(shape) -> bool:
    return shape is None or (len(shape) == 2 and shape[0] < shape[1])


def default_reason(param_name: str, shape=None, globs=DEFAULT_DENSE) -> str | None:
    """Why ``param_name`` (of ``shape``, where known) is kept dense by default, or None."""
    module = param_name.rpartition(".")[0]
    for glob in globs:
        if not fnmatchcase(module, glob):
            continue
        if globs is DEFAULT_DENSE and glob in ROUTER_GLOBS and "router" not in glob and not _is_router_shape(shape):
            continue  # a gated MLP's `gate` projection, not a router
        kind = ("an output head" if glob in HEAD_GLOBS else "a LoRA adapter" if glob in ADAPTER_GLOBS else "a MoE router") \
            if globs is DEFAULT_DENSE else "default_dense"
        return (
            f"kept dense by default: {kind} (matches {glob!r}); output heads, MoE routers and LoRA adapters stay "
            "dense unless "
            f"a rule or include names them, e.g. {{{module!r}: <recipe>, '*': <recipe>}} or include=[{module!r}, '*'], "
            "or default_dense=[] to let catch-all rules reach them"
        )
    return None
