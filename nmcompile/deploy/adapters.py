"""Merge LoRA adapters into an N:M model without breaking the pattern.

A ``peft`` LoRA trained on a model whose base weights are declared N:M (any recipe; ``asp:2:4,permute=0`` keeps the
mask) and compiled with ``backend="nmsparse"`` learns a masked update: the backend multiplies each adapter's
``B A`` by its base layer's mask (:mod:`nmcompile.passes.mask_adapter_updates`). :func:`merge_adapters` merges
exactly that, ``W + mask * scaling * B A`` (``peft``'s ``get_delta_weight``, GPT-2's ``Conv1D`` orientation
included), and unloads the adapters: the merged model computes what the trained one did, and every declared weight
stays N:M. ``peft``'s own ``merge_and_unload`` adds the dense update instead, which fills the pruned positions.
"""

from __future__ import annotations

import torch
from torch import nn

from ..state.records import annotation_of, deployed_of
from .inspection import effective_weights

__all__ = ["merge_adapters"]


def _lora_layers(model: nn.Module):
    """``(name, layer)`` of each peft LoRA layer (a module with ``base_layer``, ``lora_A`` and ``get_delta_weight``)."""
    for name, module in model.named_modules():
        if all(hasattr(module, key) for key in ("base_layer", "lora_A", "lora_B", "get_delta_weight")):
            yield name, module


def merge_adapters(model: nn.Module) -> nn.Module:
    """Merge every active LoRA adapter of ``model`` (a ``peft`` model) into its base weight, masked by that
    weight's N:M mask where it has one (declared or finalized), and return the base model without the adapters
    (``peft``'s ``unload()``). A layer whose base weight is neither declared nor finalized N:M merges its dense
    update, as ``peft`` does. An adapter merged before (``merge_adapter``) is refused by name: its dense update is
    already in the weight."""
    layers = list(_lora_layers(model))
    if not layers:
        raise ValueError(f"merge_adapters: {type(model).__name__} has no peft LoRA layer (a module with base_layer, "
                         "lora_A, lora_B); make it with peft.get_peft_model(model, LoraConfig(...))")
    merged = [name for name, layer in layers if getattr(layer, "merged", False)]
    if merged:
        raise ValueError(f"merge_adapters: {merged[0]} was merged already (peft's merge_adapter added its dense "
                         "update); unmerge_adapter() first, then merge_adapters(model)")
    dora = [name for name, layer in layers if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.lora_A)]
    if dora:
        raise ValueError(f"merge_adapters: {dora[0]} is a DoRA adapter (use_dora=True), whose magnitude rescales the "
                         "whole weight: its merge cannot keep the N:M mask the backend trained it under; train plain "
                         "LoRA (use_dora=False) on an N:M model")
    effective = {}
    for name, layer in layers:
        base = layer.base_layer
        weight = base.weight
        declared = annotation_of(base, "weight") is not None or deployed_of(base, "weight") is not None
        if declared and not effective:
            effective = effective_weights(model)
        current = effective.get(f"{name}.base_layer.weight") if declared else None
        mask = None if not declared else (current if current is not None else weight).detach() != 0
        with torch.no_grad():
            for adapter in layer.active_adapters:
                if adapter not in layer.lora_A:
                    continue
                delta = layer.get_delta_weight(adapter).to(weight.dtype)
                weight.add_(delta if mask is None else delta * mask)
    return model.unload() if hasattr(model, "unload") else model
