"""The application around the library: the ``nmcompile`` command (:mod:`.cli`), the demo
(:mod:`.demo`: a character GPT, :mod:`.chargpt`, on bundled data, :mod:`.datasets`), the training
loop it runs (:mod:`.run`, :mod:`.progress`), and run records with their plots (:mod:`.report`).

Nothing below this stage imports it; ``import nmcompile`` does not load it.
"""

from .report import save_run

__all__ = ["save_run"]
