"""The mesh example of docs/plugin.md, run as the test file it is (4 gloo ranks, mesh dp2 x tp2),
and FSDP2 + tensor parallel with a vocab-parallel head against one device in float64 (values, every
gradient, the parameters after an optimizer step).

The MLP is tensor parallel over ``mesh["tp"]`` (column-wise up, row-wise down), the LM head weight
is sharded over the vocabulary on ``mesh["tp"]`` and read out through ``tplogp.linear_logp``, and
FSDP2 (``fully_shard``) shards every parameter over ``mesh["dp"]``, which also splits the batch. SGD
with momentum is linear in the gradient, so the tolerance carries over to the parameters. On CPU,
FSDP2 runs on gloo (all-gather and reduce-scatter over ``mesh["dp"]``)."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tplogp import linear_logp
from tplogp.tolerances import RUNBOOK_TOLERANCES

from tests.support.doc_examples import define_example

define_example("mesh", globals())

D, F, V, TOKENS = 16, 32, 37, 6   # 37: an odd vocabulary, uneven head shards over tp (19 + 18 rows)
TOL = RUNBOOK_TOLERANCES[torch.float32]._asdict()


def full_vocab_logp(h, weight, targets):
    """The single-device readout: materialized logits, log_softmax, the targets' entries."""
    return torch.log_softmax(h @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


class TinyLM(nn.Module):
    """A residual MLP block and an LM head, read out as per-token log-probabilities."""

    def __init__(self, readout=linear_logp):
        super().__init__()
        self.up, self.down = nn.Linear(D, F), nn.Linear(F, D)
        self.head = nn.Linear(D, V, bias=False)
        self.readout = readout

    def forward(self, x, targets):
        h = x + self.down(torch.relu(self.up(x)))
        # linear_logp: vocab-parallel on a sharded head
        return self.readout(h, self.head.weight, targets)


@pytest.mark.tp(mesh={"dp": 2, "tp": 2}, backend="gloo", timeout=120)   # 4 ranks on CPU
def test_fsdp2_tp_lm_matches_one_device(tp, mesh):
    # seeded from the node id: the same weights everywhere
    reference = TinyLM(readout=full_vocab_logp).double()
    model = TinyLM()
    model.load_state_dict(reference.state_dict())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                           # head.weight: Shard(0), the vocabulary
                                           "head": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)

    # the global batch, the same on every rank
    x = torch.randn(2 * TOKENS, D)
    targets = torch.randint(0, V, (2 * TOKENS,))
    dp = mesh.get_local_rank("dp")
    # this data-parallel rank's half of the batch
    mine = slice(dp * TOKENS, (dp + 1) * TOKENS)

    logp = model(x[mine], targets[mine])
    (-logp.mean()).backward()                              # FSDP2 averages the gradients over dp
    ref_logp = reference(x.double(), targets)
    (-ref_logp.mean()).backward()
    tp.assert_close(logp, ref_logp[mine].float(), **TOL)                     # values
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():            # DTensors on the (dp, tp) mesh
        tp.assert_close(param.grad, ref_params[name].grad.float(), **TOL)    # gradients
    optimizer.step()
    ref_optimizer.step()
    for name, param in model.named_parameters():
        # parameters after the step
        tp.assert_close(param, ref_params[name].float(), **TOL)
