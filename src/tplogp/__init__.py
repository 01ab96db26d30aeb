"""tplogp: fused, tensor-parallel per-token log-probabilities through an LM head.

``linear_logp(hidden, weight, target_ids, bias=None, *, tp_group=None, vocab_start_index=0,
global_vocab_size=None, temperature=1.0, softcap=None, return_entropy=False, return_lse=False,
return_argmax=False, ignore_index=None, deterministic=False, workspace_bytes=None)`` returns
``log_softmax(cap(hidden @ weight.T + bias) / temperature)[target]`` (``cap``: the optional
final-logit softcap) over the whole (vocab-sharded) vocabulary without materializing the
``[tokens, vocab]`` logits; ``linear_logp_loss`` is the fused RL loss over the same path
(:mod:`tplogp.fused_loss.loop`). Sources are chosen by :mod:`tplogp.backends.kernel_registry`.
Importing this package does no device work.
"""

from . import losses
from .api import get_op, linear_logp, linear_logp_loss
from .budgets import keep_logits_budget, loss_chunk_budget
from .op.verdicts import check_errors
from .support.shards import ShardLayoutError
from .outputs import (LogpArgmax, LogpEntropy, LogpEntropyArgmax, LogpEntropyLse,
                      LogpEntropyLseArgmax, LogpLse, LogpLseArgmax)
from .op.validation import LinearLogpInputError
from .backends.kernel_registry import SourceUnavailableError

__all__ = [
    "linear_logp",
    "linear_logp_loss",
    "losses",
    "keep_logits_budget",
    "loss_chunk_budget",
    "check_errors",
    "get_op",
    "LogpEntropy",
    "LogpLse",
    "LogpEntropyLse",
    "LogpArgmax",
    "LogpEntropyArgmax",
    "LogpLseArgmax",
    "LogpEntropyLseArgmax",
    "LinearLogpInputError",
    "ShardLayoutError",
    "SourceUnavailableError",
]
__version__ = "0.1.0"
