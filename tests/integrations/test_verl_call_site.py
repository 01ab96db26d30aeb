"""tplogp's verl drop-in from verl's own call site: the fused-kernel forward of verl 0.9.1's actor.

In verl 0.9.1 the actor's log-probs and entropy come from its FSDP engine
(``FSDPEngineWithLMHead``). With ``use_fused_kernels`` the engine patches the model's forward
through ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` and calls the model
with the packed layout (``input_ids`` ``[1, total_nnz]``, per-sequence ``position_ids``,
``shift_labels`` the ids rolled over the packed row, a float ``temperature``, ``return_dict=True``),
then reads ``output.log_probs.squeeze(0)`` and ``output.entropy.squeeze(0)``. For a dense decoder
that forward is ``dense_common.forward_with_torch_backend`` (verl's ``FusedLinearForPPO``, backend
``torch``) or ``forward_with_triton_backend``, which imports ``linear_cross_entropy`` from
``verl.utils.kernel.linear_cross_entropy`` at every call (backend ``triton``). A user routes the
latter to tplogp by setting that module attribute to
``tplogp.integrations.verl.linear_cross_entropy`` (docs/integrations.md).

A tiny random Llama runs verl's own forward twice on the same packed batch: backend ``torch``
(verl's ``FusedLinearForPPO``, the same-dtype reference) and backend ``triton`` routed to tplogp.
Log-probs, entropy and the gradients of the final hidden states and of the LM-head weight are
checked with the three-way rule of ``tplogp.tolerances`` against float64 truth computed from the
same hidden states and weight.

verl is loaded from its installed files without the package's ``__init__``, which imports ray,
tensordict and the whole framework (``pip install verl==0.9.1 --no-deps`` brings none of them):
empty parent packages pointing at verl's folders stand in ``sys.modules`` during a test and are
removed after it. The engine module itself needs tensordict and a CUDA or NPU device, so its model
call is reproduced from its source (the layout above).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tplogp.integrations.verl import linear_cross_entropy
from tplogp.tolerances import assert_no_worse

VERL_INSTALL = "pip install verl==0.9.1 --no-deps"
VERL_PARENTS = ("verl", "verl.utils", "verl.utils.experimental", "verl.utils.kernel",
                "verl.models", "verl.models.transformers", "verl.plugin")
VERL_MODULES = ("verl.models.transformers.monkey_patch", "verl.utils.experimental.torch_functional",
                "verl.utils.kernel.linear_cross_entropy")

T = 0.7
SEQUENCE_LENGTHS = (5, 9, 3)  # one packed micro-batch of three sequences, 17 tokens
_DECODER = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
# verl's own Triton kernel (GPU test) asserts a hidden size that is a multiple of 128
_DECODER_128 = dict(_DECODER, vocab_size=2048, hidden_size=128, intermediate_size=256)


def _verl_folder() -> str:
    try:
        spec = importlib.util.find_spec("verl")  # located, not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"verl is not installed ({VERL_INSTALL})")
    folder = list(spec.submodule_search_locations)[0]
    with open(os.path.join(folder, "version", "version")) as f:
        version = f.read().strip()
    if not version.startswith("0.9."):
        pytest.skip(f"the call site is verl 0.9's (FSDP engine, dense_common); found {version}")
    return folder


@pytest.fixture
def verl():
    """verl's fused-forward modules, imported from the installed files under their own names;
    every ``verl.*`` entry of ``sys.modules`` is as before once the test ends."""
    folder = _verl_folder()
    before = {n: m for n, m in sys.modules.items() if n == "verl" or n.startswith("verl.")}
    if "verl" not in before:
        for name in VERL_PARENTS:
            parent = types.ModuleType(name)
            parent.__path__ = [os.path.join(folder, *name.split(".")[1:])]
            sys.modules[name] = parent
    try:
        yield types.SimpleNamespace(**{name.rsplit(".", 1)[1]: importlib.import_module(name)
                                       for name in VERL_MODULES})
    finally:
        ours = [n for n in sys.modules if n == "verl" or n.startswith("verl.")]
        for name in [n for n in ours if n not in before]:
            del sys.modules[name]
        sys.modules.update(before)


def _engine_inputs(seed: int, vocab_size: int = _DECODER["vocab_size"]) -> dict:
    """What ``FSDPEngineWithLMHead.prepare_model_inputs`` passes to the patched forward
    (remove-padding layout, no sequence parallelism): the packed ids, positions restarting per
    sequence, and the ids rolled by one over the whole packed row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (1, sum(SEQUENCE_LENGTHS)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in SEQUENCE_LENGTHS])[None]
    return dict(input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                temperature=T, return_dict=True,
                shift_labels=torch.roll(input_ids, shifts=-1, dims=1))


def _tiny_llama(dtype: torch.dtype, config: dict = _DECODER):
    """A random Llama of a class of its own: verl's patch replaces ``model.__class__.forward``."""
    cls = type("VerlCallSiteLlama", (transformers.LlamaForCausalLM,), {})
    torch.manual_seed(0)
    return cls(transformers.LlamaConfig(**config)).to(dtype).eval()


def _actor_forward(verl, model, backend: str, inputs: dict, g_logp, g_ent):
    """verl's patched forward on ``inputs``, read as the engine reads it, then the upstream
    gradients; returns (log_probs, entropy, d_hidden, d_weight) and the final hidden states that
    the head saw."""
    verl.monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True,
                                                  fused_kernels_backend=backend)
    model.zero_grad(set_to_none=True)
    seen = []

    def keep_hidden(module, args, output):
        output[0].retain_grad()
        seen.append(output[0])

    handle = model.model.register_forward_hook(keep_hidden)
    try:
        output = model(**inputs)
    finally:
        handle.remove()
    log_probs, entropy = output.log_probs.squeeze(0), output.entropy.squeeze(0)
    ((log_probs * g_logp).sum() + (entropy * g_ent).sum()).backward()
    (hidden,) = seen
    grads = (hidden.grad[0], model.lm_head.weight.grad)
    return (log_probs.detach(), entropy.detach(), *grads), hidden.detach()


def _float64_truth(hidden, weight, labels, g_logp, g_ent):
    """log_softmax(hidden @ W.T / T) at the labels, its entropy, and their gradients, in float64."""
    h = hidden[0].cpu().double().requires_grad_()
    w = weight.detach().cpu().double().requires_grad_()
    logsm = torch.log_softmax(h @ w.T / T, dim=-1)
    log_probs = logsm.gather(1, labels.cpu()[:, None])[:, 0]
    entropy = -(logsm.exp() * logsm).sum(-1)
    ((log_probs * g_logp.cpu().double()).sum() + (entropy * g_ent.cpu().double()).sum()).backward()
    return log_probs.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_backend_through_tplogp_matches_verls_fused_forward(verl, monkeypatch, dtype):
    model = _tiny_llama(dtype)
    inputs = _engine_inputs(1)
    g_logp, g_ent = torch.randn(2, inputs["input_ids"].numel(),
                                generator=torch.Generator().manual_seed(2))

    verls, verl_hidden = _actor_forward(verl, model, "torch", inputs, g_logp, g_ent)
    # the user's switch: verl's triton-backend forward imports this attribute at every call
    monkeypatch.setattr(verl.linear_cross_entropy, "linear_cross_entropy", linear_cross_entropy)
    ours, our_hidden = _actor_forward(verl, model, "triton", inputs, g_logp, g_ent)

    assert torch.equal(our_hidden, verl_hidden), "the same body on the same inputs"
    labels = inputs["shift_labels"][0]
    truth = _float64_truth(our_hidden, model.lm_head.weight, labels, g_logp, g_ent)
    n = labels.numel()
    assert ours[0].shape == ours[1].shape == (n,)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert ours[2].dtype == ours[3].dtype == dtype
    for name, o, r, t in zip(("log_probs", "entropy", "d_hidden", "d_weight"), ours, verls, truth):
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert_no_worse(name, o, r, t, dtype)


def test_the_switch_reaches_verls_forward(verl, monkeypatch):
    """The attribute is what verl's triton-backend forward calls (on a GPU too, where verl's own
    kernel would otherwise run): a wrapper set there receives verl's arguments."""
    calls = []

    def recording(*args):
        calls.append(args)
        return linear_cross_entropy(*args)

    monkeypatch.setattr(verl.linear_cross_entropy, "linear_cross_entropy", recording)
    model = _tiny_llama(torch.float32)
    inputs = _engine_inputs(3)
    verl.monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True,
                                                  fused_kernels_backend="triton")
    with torch.no_grad():
        model(**inputs)
    ((hidden, weight, labels, temperature, reduction),) = calls
    assert hidden.shape == (1, labels.numel(), _DECODER["hidden_size"])
    assert weight is model.lm_head.weight and torch.equal(labels, inputs["shift_labels"])
    assert (temperature, reduction) == (T, "none")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_backend_through_tplogp_matches_verls_own_kernel_on_cuda(verl, monkeypatch):
    """On a GPU the triton backend runs verl's own Triton kernel (``LinearCrossEntropy``): the same
    forward routed to tplogp is no worse against float64 than verl's kernel, in bf16."""
    model = _tiny_llama(torch.bfloat16, _DECODER_128).cuda()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v
              for k, v in _engine_inputs(4, _DECODER_128["vocab_size"]).items()}
    g_logp, g_ent = torch.randn(2, inputs["input_ids"].numel(),
                                generator=torch.Generator().manual_seed(5)).cuda()

    verls, verl_hidden = _actor_forward(verl, model, "triton", inputs, g_logp, g_ent)
    monkeypatch.setattr(verl.linear_cross_entropy, "linear_cross_entropy", linear_cross_entropy)
    ours, our_hidden = _actor_forward(verl, model, "triton", inputs, g_logp, g_ent)

    assert torch.equal(our_hidden, verl_hidden), "the same body on the same inputs"
    truth = _float64_truth(our_hidden, model.lm_head.weight, inputs["shift_labels"][0], g_logp,
                           g_ent)
    for name, o, r, t in zip(("log_probs", "entropy", "d_hidden", "d_weight"), ours, verls, truth):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        assert_no_worse(name, o.cpu(), r.cpu(), t, torch.bfloat16)
