"""Declaring recipes: on weights by name (:func:`annotate`), by rules (:class:`Plan`: objects,
strings, TOML files, ``NMSPARSE_RECIPE``), or on code regions (:func:`region`).

What a declaration writes is a record in the owning module's table (:mod:`nmcompile.state.records`);
the ``nmsparse`` backend reads it, or applies a plan itself when no record exists.
"""

from .annotate import AnnotationReport, annotate
from .plan import Plan
from .region import region

__all__ = ["annotate", "AnnotationReport", "Plan", "region"]
