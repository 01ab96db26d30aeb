"""Drop-in entry points of tplogp for the training stacks people use; each is an optional import.

* :mod:`tplogp.integrations.hf`: per-token log-probs and a fused RL loss of a Hugging Face causal LM
  (``causal_lm_logprobs``, ``causal_lm_loss``), without materializing its
  ``[batch, sequence, vocab]`` logits. Needs ``transformers`` (the ``hf`` extra:
  ``pip install ".[hf]"`` from the repository).
* :mod:`tplogp.integrations.trl`: TRL's ``GRPOTrainer`` with its log-probs and entropies from tplogp
  (``TplogpGRPOTrainer``, ``patch(trainer)``). Needs ``trl`` 1.16 (the ``trl`` extra).
* :mod:`tplogp.integrations.verl`: ``linear_cross_entropy`` with the call and the meaning of verl's
  fused kernel. Needs nothing beyond tplogp.

Importing this package imports neither; a missing package is named by
:class:`MissingDependencyError` when the integration that needs it is imported.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependencyError(ImportError):
    """An integration needs a package that is not installed; the message names it and the extra that
    brings it."""


def require(package: str, integration: str, extra: str) -> ModuleType:
    """Import ``package`` for ``integration``, or raise :class:`MissingDependencyError` naming it
    and the extra."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name != package and not (err.name or "").startswith(package + "."):
            raise
        raise MissingDependencyError(
            f"{integration} needs the package {package!r}, which is not installed: "
            f"pip install \".[{extra}]\" from a clone of the tplogp repository (the {extra!r} extra), or "
            f"pip install {package}", name=package) from err


__all__ = ["MissingDependencyError", "require"]
