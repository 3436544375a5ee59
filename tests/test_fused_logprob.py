"""The fused log-prob head (verl/workers/actor/fused_logprob.py): log-probs and entropy from hidden states,
a chunk of tokens at a time, without ``[tokens, vocab]`` float32 logits.

What is checked (CPU, float32, the tiny Qwen2 model):
* ``chunked_log_probs`` equals ``linear -> float -> / T -> log_softmax -> gather`` (and ``entropy_from_logits``)
  to 1e-5 for chunk sizes 1 / 7 / larger than the batch, values and gradients of hidden states, weight, bias;
  the entropy is differentiable only when asked;
* ``forward_response_log_probs`` with ``use_fused_kernels`` equals the unfused path for packed and padded rows,
  temperature 0.7, tied and untied lm_head: log-probs and entropy (1e-5), and the gradient of every parameter
  after one backward of a loss that uses both (relative 1e-5);
* memory: no tensor saved for backward, and no tensor created by any op during forward + backward, has
  ``K x V`` elements with the vocabulary as last axis (the unfused path does: the check can fail);
* the config keys reach the code: the worker's actor, ref and old-log-prob passes go through the fused head
  by default (``actor_rollout_ref.model.use_fused_kernels``), not with ``use_fused_kernels=False``, with the
  same numbers; a bad ``impl_backend`` is refused naming the key.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from verl.utils.model_loading import load_causal_lm
from verl.utils.torch_functional import entropy_from_logits
from verl.workers.actor import fused_logprob
from verl.workers.actor.forward import forward_response_log_probs
from verl.workers.actor.fused_logprob import chunked_log_probs, supports_fused_head

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tied_model(tiny_model_path):
    model = load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.fixture(scope="module")
def untied_model(tied_model):
    from transformers import Qwen2ForCausalLM

    config = copy.deepcopy(tied_model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config).float()
    model.config._attn_implementation = "sdpa"
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def make_batch(num_rows: int = 4, seq_len: int = 40, response_len: int = 24, seed: int = 0):
    """Left-padded prompts + right-padded responses (rows of different lengths), verl's position ids."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, 2000, (num_rows, seq_len), generator=gen)
    mask = torch.zeros(num_rows, seq_len, dtype=torch.long)
    prompt_len = seq_len - response_len
    for row in range(num_rows):
        left_pad = int(torch.randint(0, prompt_len - 2, (1,), generator=gen))
        response = int(torch.randint(3, response_len + 1, (1,), generator=gen))
        mask[row, left_pad : prompt_len + response] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, position_ids, response_len


# ------------------------------------------------------------------------------------------- the function
def _reference(hidden, weight, bias, labels, temperature):
    logits = F.linear(hidden, weight, bias).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_logits(logits)


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("entropy_with_grad", [True, False])
def test_chunked_log_probs_match_reference(chunk_size, entropy_with_grad):
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden_size, vocab = 23, 16, 50
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)
    w_lp, w_ent = torch.randn(num_tokens, generator=gen), torch.randn(num_tokens, generator=gen)

    results = []
    for fused in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        if fused:
            lp, ent = chunked_log_probs(
                *leaves[:2], labels, leaves[2], TEMPERATURE, chunk_size, True, entropy_with_grad=entropy_with_grad
            )
        else:
            lp, ent = _reference(leaves[0], leaves[1], leaves[2], labels, TEMPERATURE)
            if not entropy_with_grad:
                ent = ent.detach()
        loss = (lp * w_lp).sum() + (ent * w_ent).sum() if entropy_with_grad else (lp * w_lp).sum()
        loss.backward()
        results.append((lp.detach(), ent.detach(), ent.requires_grad, [leaf.grad for leaf in leaves]))
    (lp0, ent0, req0, grads0), (lp1, ent1, req1, grads1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    assert req1 == req0 == entropy_with_grad
    for g1, g0 in zip(grads1, grads0):  # relative to the largest entry: entropy gradients cancel terms
        torch.testing.assert_close(g1, g0, atol=1e-5 * float(g0.abs().max()), rtol=0)
    # the entropy term really contributes when it has a gradient (so the comparison above can fail)
    if entropy_with_grad:
        assert not torch.allclose(grads1[0], _lp_only_grad(hidden, weight, bias, labels, w_lp), atol=1e-4)


def _lp_only_grad(hidden, weight, bias, labels, w_lp):
    h = hidden.clone().requires_grad_(True)
    lp, _ = _reference(h, weight, bias, labels, TEMPERATURE)
    (lp * w_lp).sum().backward()
    return h.grad


def test_chunked_entropy_gradient_alone():
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(11, 8, generator=gen), torch.randn(30, 8, generator=gen)
    labels = torch.randint(0, 30, (11,), generator=gen)
    grads = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        if fused:
            _, ent = chunked_log_probs(h, weight, labels, None, TEMPERATURE, 4, True, True)
        else:
            ent = _reference(h, weight, None, labels, TEMPERATURE)[1]
        (ent * torch.arange(11.0)).sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5 * float(grads[0].abs().max()), rtol=0)


def test_chunked_log_probs_without_entropy_and_no_grad():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(9, 8, generator=gen), torch.randn(30, 8, generator=gen)
    labels = torch.randint(0, 30, (9,), generator=gen)
    with torch.no_grad():
        lp, ent = chunked_log_probs(hidden, weight, labels, temperature=1.0, chunk_size=4)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, _reference(hidden, weight, None, labels, 1.0)[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_log_probs(hidden, weight, labels, chunk_size=0)


# ------------------------------------------------------------------------------------------- the model
def _run(model, fused: bool, remove_padding: bool, chunk_size: int = 5, batch=None):
    """log-probs, entropy and the gradients of all parameters after one backward (a fresh copy of ``model``)."""
    model = copy.deepcopy(model)
    input_ids, mask, position_ids, response_len = batch or make_batch()
    lp, ent = forward_response_log_probs(
        model,
        input_ids,
        mask,
        position_ids,
        response_len,
        temperature=TEMPERATURE,
        use_remove_padding=remove_padding,
        calculate_entropy=True,
        entropy_with_grad=True,
        use_fused_kernels=fused,
        fused_chunk_size=chunk_size,
    )
    gen = torch.Generator().manual_seed(7)
    loss = (lp * torch.randn(lp.shape, generator=gen)).sum() - 0.3 * (ent * torch.rand(ent.shape, generator=gen)).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return lp.detach(), ent.detach(), loss.detach(), grads


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_forward_matches_unfused(tied_model, untied_model, remove_padding, tied):
    model = tied_model if tied else untied_model
    assert supports_fused_head(model)
    lp0, ent0, loss0, grads0 = _run(model, False, remove_padding)
    lp1, ent1, loss1, grads1 = _run(model, True, remove_padding)
    _, mask, _, response_len = make_batch()
    valid = mask[:, -response_len:].bool()
    assert valid.sum() > 40 and (lp0[valid] < 0).all() and (lp0[~valid] == 0).all()
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss1, loss0, atol=1e-5, rtol=1e-6)
    assert set(grads1) == set(grads0) and len(grads0) == len(list(model.parameters()))
    for name, g0 in grads0.items():
        scale = float(g0.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(grads1[name], g0, atol=1e-5 * scale, rtol=0, msg=name)


def test_fused_forward_without_logits_to_keep(tied_model):
    """Models without ``logits_to_keep`` hand the head every position; the head selects its own."""
    batch = make_batch(seed=4)
    ref = forward_response_log_probs(tied_model, *batch, temperature=TEMPERATURE, use_remove_padding=True)[0]
    for remove_padding in (False, True):
        lp, _ = forward_response_log_probs(
            tied_model,
            *batch,
            temperature=TEMPERATURE,
            use_remove_padding=remove_padding,
            use_logits_to_keep=False,
            use_fused_kernels=True,
        )
        torch.testing.assert_close(lp, ref.detach(), atol=1e-5, rtol=0)
    assert tied_model.lm_head.forward.__func__ is torch.nn.Linear.forward  # the override was removed


def test_models_that_post_process_logits_keep_the_unfused_path(tied_model):
    model = copy.deepcopy(tied_model)
    model.config.final_logit_softcapping = 30.0
    assert not supports_fused_head(model)


# ------------------------------------------------------------------------------------------- memory
class _LargestVocabTensor(TorchDispatchMode):
    """Largest number of elements of any tensor an op allocates whose last axis is the vocabulary (views of
    inputs, such as the transposed lm_head weight inside ``linear``, allocate nothing and are not counted)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                if t.untyped_storage().data_ptr() not in storages:
                    self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_no_full_vocabulary_logits_are_kept_or_created(tied_model, remove_padding):
    model = copy.deepcopy(tied_model)
    vocab = model.config.vocab_size
    input_ids, mask, position_ids, response_len = make_batch(num_rows=6, seq_len=60, response_len=40, seed=2)
    num_targets = int(mask[:, -response_len:].sum())
    chunk = 16
    assert num_targets > 4 * chunk

    def measure(fused: bool) -> tuple[int, int]:
        saved = []

        def pack(t):
            if t.dim() >= 1 and t.shape[-1] == vocab:
                saved.append(t.numel())
            return t

        dispatch = _LargestVocabTensor(vocab)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dispatch:
            lp, ent = forward_response_log_probs(
                model,
                input_ids,
                mask,
                position_ids,
                response_len,
                temperature=TEMPERATURE,
                use_remove_padding=remove_padding,
                calculate_entropy=True,
                entropy_with_grad=True,
                use_fused_kernels=fused,
                fused_chunk_size=chunk,
            )
            (lp.sum() + ent.sum()).backward()
        model.zero_grad(set_to_none=True)
        return max(saved, default=0), dispatch.largest

    saved_unfused, created_unfused = measure(False)
    saved_fused, created_fused = measure(True)
    # the unfused path keeps [K, V] float32 logits for backward (so this test can fail) ...
    assert saved_unfused >= num_targets * vocab and created_unfused >= num_targets * vocab
    # ... the fused one keeps none and never creates more than one chunk of them
    assert saved_fused == 0
    assert 0 < created_fused <= chunk * vocab


# ------------------------------------------------------------------------------------------- the config
def test_config_keys_reach_the_actor_ref_and_old_log_prob_passes(monkeypatch, tiny_model_path):
    from tests.test_dp_actor import make_update_data
    from tests.test_log_prob_budgets import build_worker

    data = make_update_data(load_causal_lm(tiny_model_path, dtype="float32", attn_implementation="sdpa"), 6, 3)
    data.meta_info["temperature"] = TEMPERATURE
    calls = []
    real = fused_logprob.chunked_log_probs

    def counting(*args, **kwargs):
        calls.append(args[4] if len(args) > 4 else kwargs.get("temperature"))
        return real(*args, **kwargs)

    import verl.workers.actor.forward as forward_module

    monkeypatch.setattr(forward_module, "chunked_log_probs", counting)
    results = {}
    for fused in (True, False):
        overrides = [] if fused else ["actor_rollout_ref.model.use_fused_kernels=False"]
        worker = build_worker(
            monkeypatch, tiny_model_path, "actor_rollout_ref.model.use_remove_padding=True", *overrides
        )
        assert worker.actor.use_fused_kernels is fused and worker.ref.use_fused_kernels is fused
        assert worker.actor.settings.fused_chunk_size == 1024 and worker.actor.settings.fused_backend == "torch"
        calls.clear()
        old = worker.compute_log_prob(data).batch["old_log_probs"]
        after_old = len(calls)
        ref = worker.compute_ref_log_prob(data).batch["ref_log_prob"]
        after_ref = len(calls)
        metrics = worker.update_actor(data)
        if fused:
            assert after_old > 0 and after_ref > after_old and len(calls) > after_ref
            assert set(calls) == {TEMPERATURE}
        else:
            assert calls == []
        params = torch.cat([p.detach().flatten() for p in worker.actor_module.parameters()])
        results[fused] = (old, ref, metrics["actor/pg_loss"], params)
    (old1, ref1, loss1, params1), (old0, ref0, loss0, params0) = results[True], results[False]
    torch.testing.assert_close(old1, old0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref1, ref0, atol=1e-5, rtol=0)
    assert loss1 == pytest.approx(loss0, abs=1e-5)
    torch.testing.assert_close(params1, params0, atol=1e-6, rtol=0)


def test_bad_backend_is_refused_naming_the_key(tied_model):
    from tests.test_config import compose_config
    from verl.trainer.config_schema import ConfigError, validate_config
    from verl.workers.actor import DataParallelPPOActor

    cfg = {"ppo_micro_batch_size_per_gpu": 1, "fused_kernel_options": {"impl_backend": "cuda"}}
    with pytest.raises(ValueError, match=r"fused_kernel_options.impl_backend must be one of \[torch, triton, liger\]"):
        DataParallelPPOActor(cfg, tied_model)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.model.fused_kernel_options.chunk_size must be"):
        validate_config(compose_config(["actor_rollout_ref.model.fused_kernel_options.chunk_size=0"]))


# ------------------------------------------------------------------------------------------- GPU (the lead's)
@pytest.mark.gpu
def test_bf16_cuda_fused_and_liger_match_unfused(tied_model):
    """bf16 on CUDA: the chunked head (and liger-kernel for the no-grad pass, when installed) agree with the
    unfused path to bf16 rounding; gradients to 2% of their scale."""
    from verl.workers.actor.fused_logprob import liger_available

    model = copy.deepcopy(tied_model).to("cuda", torch.bfloat16)
    batch = [t.cuda() for t in make_batch(num_rows=4, seq_len=80, response_len=60, seed=9)[:3]]
    batch.append(60)
    with torch.no_grad():
        ref = forward_response_log_probs(model, *batch, temperature=TEMPERATURE)[0]
        chunked = forward_response_log_probs(model, *batch, temperature=TEMPERATURE, use_fused_kernels=True)[0]
        assert (chunked - ref).abs().max() < 0.05
        if liger_available(torch.device("cuda")):
            liger = forward_response_log_probs(
                model, *batch, temperature=TEMPERATURE, use_fused_kernels=True, fused_backend="triton"
            )[0]
            assert (liger - ref).abs().max() < 0.05
    grads = []
    for fused in (False, True):
        m = copy.deepcopy(model)
        lp, _ = forward_response_log_probs(m, *batch, temperature=TEMPERATURE, use_fused_kernels=fused)
        (lp * torch.linspace(-1, 1, lp.shape[-1], device="cuda")).sum().backward()
        grads.append({n: p.grad.float() for n, p in m.named_parameters()})
    for name, g0 in grads[0].items():
        assert (grads[1][name] - g0).abs().max() <= 0.02 * g0.abs().max() + 1e-6, name
