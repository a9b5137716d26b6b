"""The application around the library: the ``nmcompile`` command (:mod:`.cli`), the demo
(:mod:`.demo`: a character GPT, :mod:`.chargpt`, on bundled data, :mod:`.datasets`), the training
loop it runs (:mod:`.run`, :mod:`.progress`), and run records with their plots (:mod:`.report`).

Nothing below this stage imports it; ``import nmcompile`` does not load it.
"""

__all__ = ["save_run"]


def __getattr__(name: str):
    if name == "save_run":  # imported at first use: the nmcompile command starts without torch
        from .report import save_run

        return save_run
    raise AttributeError(f"module 'nmcompile.app' has no attribute {name!r}")
