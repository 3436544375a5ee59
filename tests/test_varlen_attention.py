"""``attn_implementation="torch_varlen"``: packed rows through torch's ``varlen_attn`` (``varlen_attention.py``).

The FA2 kernel behind ``torch.nn.attention.varlen.varlen_attn`` runs on CUDA only, so on CPU it is replaced by a
reference with the same contract (causal sdpa over every ``cu_seq_lens`` slice, grouped-query heads honoured) in
the signatures torch has shipped: 2.12+ (``window_size``, ``scale``, ``enable_gqa``), 2.11 (exactly the signature
printed on a GPU machine with torch 2.11: ``window_size`` and ``scale``, no ``enable_gqa``) and 2.10
(``is_causal``, neither ``scale`` nor ``enable_gqa``: the key/value heads must arrive repeated). What is checked:

* ``pack_rows`` gives the hand-computed ``cu_seq_lens``/``max_length`` (empty rows skipped, flex's padding as one
  more sequence) and the host plan carries them to the device;
* the tiny Qwen2 model (GQA: 2 query heads, 1 key/value head) under ``torch_varlen`` on packed rows gives the
  padded sdpa log-probs and gradients to 1e-5 in float32 (unfused and fused head, with a host plan, the critic's
  values too); padded rows (the fallback for rows that cannot be packed) through its 2-D mask path as well;
* the kernel is called once per layer, each time with the very tensor ``pack_rows`` built (computed once per
  forward, never from the mask or the position_ids inside a layer), gradient-checkpointing recomputes included;
* ``resolve_attn_implementation`` refuses ``torch_varlen`` without CUDA or without ``torch.nn.attention.varlen``
  (a ValueError naming ``actor_rollout_ref.model.attn_implementation``); it is the automatic choice for packed rows
  on CUDA (the order: ``tests/test_attn_choice.py``);
* GPU (``@pytest.mark.gpu``): the real kernel against flex_attention (packed) and sdpa (padded), bf16 and float32,
  log-probs and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tests.packed_batches import RESPONSE_LENGTH, padded_batch
from verl.utils import model_loading
from verl.workers.actor import varlen_attention
from verl.workers.actor.forward import forward_response_log_probs, host_plan, pack_rows

LAYERS = 2  # the tiny model's


def _attend(query, key, value, cu_seq_lens, max_length, scale, enable_gqa):
    """Causal sdpa over every sequence of ``[T, H, D]`` tensors."""
    starts, ends = cu_seq_lens[:-1].tolist(), cu_seq_lens[1:].tolist()
    assert cu_seq_lens[0] == 0 and ends[-1] == query.shape[0] and max(e - s for s, e in zip(starts, ends)) == max_length
    outs = []
    for start, end in zip(starts, ends):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


class Reference:
    """Stand-ins for ``varlen_attn`` that record what they receive (``calls``: ``(cu_seq_q, max_q)``)."""

    def __init__(self):
        self.calls = []

    def new(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False):  # fmt: skip
        assert window_size == (-1, 0) and cu_seq_k is cu_seq_q and max_k == max_q
        self.calls.append((cu_seq_q, max_q))
        return _attend(query, key, value, cu_seq_q, max_q, scale, enable_gqa)

    def v2_11(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1)):  # fmt: skip
        """torch 2.11, as printed there: causal through window_size, scale, no GQA (equal head counts required)."""
        assert window_size == (-1, 0) and return_aux is None and cu_seq_k is cu_seq_q and max_k == max_q
        assert key.shape[1] == query.shape[1]
        self.calls.append((cu_seq_q, max_q))
        return _attend(query, key, value, cu_seq_q, max_q, scale, False)

    def old(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        """torch 2.10: no scale (the default 1/sqrt(D)), no GQA (equal head counts required)."""
        assert is_causal and cu_seq_k is cu_seq_q and max_k == max_q and key.shape[1] == query.shape[1]
        self.calls.append((cu_seq_q, max_q))
        return _attend(query, key, value, cu_seq_q, max_q, None, False)


@pytest.fixture(params=["torch-2.12", "torch-2.11", "torch-2.10"])
def reference(request, monkeypatch):
    from torch.nn.attention import varlen

    ref = Reference()
    kernel = {"torch-2.12": ref.new, "torch-2.11": ref.v2_11, "torch-2.10": ref.old}[request.param]
    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    return ref


@pytest.fixture(scope="module")
def models(tiny_model_path):
    """The same weights under sdpa and torch_varlen (float32)."""
    varlen_attention.register()
    return {
        attn: AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation=attn)
        for attn in ("sdpa", varlen_attention.NAME)
    }


# ------------------------------------------------------------------------------------------------ boundaries
def test_pack_rows_cu_seq_lens_hand_computed():
    input_ids, attention_mask, position_ids = padded_batch([5, 1, 3], seed=0)
    empty = torch.zeros_like(attention_mask[:1])  # a row without a valid token is no sequence
    batch = (
        torch.cat([input_ids[:1], input_ids[:1], input_ids[1:]]),
        torch.cat([attention_mask[:1], empty, attention_mask[1:]]),
        torch.cat([position_ids[:1], empty, position_ids[1:]]),
    )
    packed = pack_rows(*batch, RESPONSE_LENGTH)
    assert packed.cu_seq_lens.dtype == torch.int32
    assert packed.cu_seq_lens.tolist() == [0, 5, 6, 9] and packed.max_length == 5
    flex = pack_rows(*batch, RESPONSE_LENGTH, length_multiple=128)  # 9 tokens + 247 padding, one more sequence
    assert flex.cu_seq_lens.tolist() == [0, 5, 6, 9, 256] and flex.max_length == 247
    plan = host_plan(*batch, RESPONSE_LENGTH, True, False, 1, torch.device("meta"))
    assert plan.packed.cu_seq_lens.device.type == "meta" and plan.packed.max_length == 5


# ------------------------------------------------------------------------------------------------ on the model
def test_packed_log_probs_and_gradients_equal_padded_sdpa(models, reference):
    weights = torch.linspace(-1, 1, RESPONSE_LENGTH)
    for seed, lengths in enumerate([[33, 1, 66, 100], [300, 2, 129, 90, 17]]):
        batch = padded_batch(lengths, seed)
        results = {}
        for attn, packed in (("sdpa", False), (varlen_attention.NAME, True)):
            model = models[attn]
            model.zero_grad(set_to_none=True)
            log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=packed)
            (log_probs * weights).sum().backward()
            results[attn] = log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        reference_log_probs, reference_grads = results["sdpa"]
        log_probs, grads = results[varlen_attention.NAME]
        assert (reference_log_probs != 0).sum() > 10
        torch.testing.assert_close(log_probs, reference_log_probs, rtol=0, atol=1e-5)
        for name, grad in reference_grads.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)
    assert len(reference.calls) == 2 * LAYERS


@torch.no_grad()
def test_fused_head_and_host_plan_equal_padded_sdpa(models, reference):
    batch = padded_batch([300, 2, 129, 90, 17], seed=4)
    expected, _ = forward_response_log_probs(models["sdpa"], *batch, RESPONSE_LENGTH)
    model = models[varlen_attention.NAME]
    plan = host_plan(*batch, RESPONSE_LENGTH, True, True, 1, torch.device("cpu"))
    for fused, with_plan in ((True, False), (True, True), (False, True)):
        log_probs, _ = forward_response_log_probs(
            model,
            *batch,
            RESPONSE_LENGTH,
            use_remove_padding=True,
            use_fused_kernels=fused,
            plan=plan if with_plan else None,
        )
        torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_padded_rows_through_the_mask_path_equal_padded_sdpa(models, reference):
    """Rows that cannot be packed run padded: transformers hands the 2-D mask through (flash_attention_mask)."""
    batch = padded_batch([40, 3, 90], seed=2)
    expected, _ = forward_response_log_probs(models["sdpa"], *batch, RESPONSE_LENGTH)
    log_probs, _ = forward_response_log_probs(models[varlen_attention.NAME], *batch, RESPONSE_LENGTH)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-5)
    lengths = batch[1].sum(dim=1).tolist()
    assert [cu.tolist() for cu, _ in reference.calls] == [[0, *torch.tensor(lengths).cumsum(0).tolist()]] * LAYERS
    shifted = (batch[0], batch[1], batch[2] + batch[1])  # positions that do not start at 0: not packable
    log_probs, _ = forward_response_log_probs(
        models[varlen_attention.NAME], *shifted, RESPONSE_LENGTH, use_remove_padding=True
    )
    torch.testing.assert_close(log_probs, forward_response_log_probs(models["sdpa"], *shifted, RESPONSE_LENGTH)[0])


def test_boundaries_computed_once_per_forward(models, reference, monkeypatch):
    """Every layer gets the tensor pack_rows built (same object); nothing derives boundaries inside a layer, also
    when gradient checkpointing recomputes the layers in the backward."""

    def forbidden(*args, **kwargs):
        raise AssertionError("boundaries computed inside a layer")

    monkeypatch.setattr(varlen_attention, "_boundaries_from_positions", forbidden)
    monkeypatch.setattr(varlen_attention, "_boundaries_from_mask", forbidden)
    batch = padded_batch([5, 1, 3, 7], seed=1)
    plan = host_plan(*batch, RESPONSE_LENGTH, True, False, 1, torch.device("cpu"))
    assert plan.packed.cu_seq_lens.tolist() == [0, 5, 6, 9, 16] and plan.packed.max_length == 7
    model = models[varlen_attention.NAME]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=True, plan=plan)
        assert len(reference.calls) == LAYERS
        log_probs.sum().backward()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)
    assert len(reference.calls) == 2 * LAYERS  # the recomputed forward of each checkpointed layer
    assert all(cu is plan.packed.cu_seq_lens and length == 7 for cu, length in reference.calls)


@torch.no_grad()
def test_critic_packed_values_equal_padded_sdpa(tiny_model_path, reference):
    from verl.workers.critic.critic_worker import load_value_model
    from verl.workers.critic.dp_critic import forward_response_values

    varlen_attention.register()
    torch.manual_seed(0)
    sdpa = load_value_model(tiny_model_path, dtype="float32", attn_implementation="sdpa").eval()
    torch.manual_seed(0)  # same value head
    varlen = load_value_model(tiny_model_path, dtype="float32", attn_implementation="sdpa").eval()
    varlen.set_attn_implementation(varlen_attention.NAME)
    batch = padded_batch([40, 3, 90], seed=3)
    expected = forward_response_values(sdpa, *batch, RESPONSE_LENGTH)
    values = forward_response_values(varlen, *batch, RESPONSE_LENGTH, use_remove_padding=True)
    assert (expected != 0).sum() > 10
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)
    assert len(reference.calls) == LAYERS and reference.calls[0][0].tolist() == [0, 40, 43, 133]


def test_scale_and_grouped_heads_against_masked_sdpa(models, reference):
    """A scaling other than 1/sqrt(D) (folded into the query for torch 2.10) and 2 query heads per key/value head;
    boundaries from position_ids when no cu_seq_lens are given."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 9, 8, generator=gen)
    key, value = torch.randn(2, 1, 2, 9, 8, generator=gen)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    module = models[varlen_attention.NAME].model.layers[0].self_attn
    out, weights = varlen_attention.torch_varlen_attention(
        module, query, key, value, None, scaling=0.3, position_ids=position_ids
    )
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    mask = (docs[:, None] == docs[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert weights is None and out.shape == (1, 9, 4, 8)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-5)
    assert reference.calls[0][0].tolist() == [0, 4, 6, 9] and reference.calls[0][1] == 4
    # two rows: a row start is a sequence start even where the positions continue (no mask, no cu_seq_lens)
    two, key2, value2 = torch.randn(2, 4, 4, 8, generator=gen), *torch.randn(2, 2, 2, 4, 8, generator=gen)
    out, _ = varlen_attention.torch_varlen_attention(
        module, two, key2, value2, None, scaling=0.3, position_ids=torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]])
    )
    assert reference.calls[1][0].tolist() == [0, 4, 6, 8] and reference.calls[1][1] == 4
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    masks = torch.stack([causal, causal & torch.tensor([[1, 1, 0, 0]] * 2 + [[0, 0, 1, 1]] * 2, dtype=torch.bool)])
    expected = F.scaled_dot_product_attention(two, key2, value2, attn_mask=masks[:, None], scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-5)


def test_unsupported_layers_are_clear_errors(models, reference):
    query = torch.zeros(1, 2, 4, 8)
    model = models[varlen_attention.NAME].model.layers[0].self_attn
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention.torch_varlen_attention(model, query, query, query, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding-window"):
        varlen_attention.torch_varlen_attention(model, query, query, query, None, sliding_window=4)


# ------------------------------------------------------------------------------------------------ the choice
def test_torch_varlen_needs_cuda_and_torch_varlen(monkeypatch):
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.attn_implementation='torch_varlen' needs CUDA"):
        model_loading.resolve_attn_implementation("torch_varlen", "cpu", remove_padding=True)
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: False)
    with pytest.raises(ValueError, match=r"torch >= 2\.10"):
        model_loading.resolve_attn_implementation("torch_varlen", "cuda", remove_padding=True)


def test_torch_varlen_on_cuda_is_kept_and_registered(monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name, *a, **k: None)  # no flash-attn
    monkeypatch.setattr(varlen_attention, "varlen_available", lambda: True)
    monkeypatch.setattr(varlen_attention, "gpu_supported", lambda device=None: True)
    for remove_padding in (True, False):
        assert model_loading.resolve_attn_implementation("torch_varlen", "cuda", remove_padding) == "torch_varlen"
        # the automatic choice: torch_varlen for packed rows, sdpa for padded ones
        expected = "torch_varlen" if remove_padding else "sdpa"
        assert model_loading.resolve_attn_implementation(None, "cuda", remove_padding) == expected
    assert AttentionInterface._global_mapping["torch_varlen"] is varlen_attention.torch_varlen_attention
    assert AttentionMaskInterface._global_mapping["torch_varlen"] is flash_attention_mask


@torch.no_grad()
def test_benchmark_builder_takes_torch_varlen(models, reference, monkeypatch):
    """``bench_update_policy.py --attn torch_varlen`` builds its model with ``build_causal_lm_from_config`` (CUDA
    faked for the choice; the weights stay on CPU): the model runs packed rows through varlen_attn."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = models["sdpa"].config.__class__.from_dict(models["sdpa"].config.to_dict())
    model = model_loading.build_causal_lm_from_config(config, attn_implementation="torch_varlen", seed=0)
    assert model.config._attn_implementation == "torch_varlen"
    model.load_state_dict(models["sdpa"].state_dict())
    batch = padded_batch([33, 1, 66], seed=6)
    log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=True)
    expected, _ = forward_response_log_probs(models["sdpa"], *batch, RESPONSE_LENGTH)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-5)
    assert len(reference.calls) == LAYERS and reference.calls[0][0].tolist() == [0, 33, 34, 100]


# ------------------------------------------------------------------------------------------- GPU (the lead's)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_torch_varlen_equals_flex_and_padded_sdpa(tiny_model_path, dtype):
    """The real kernel, train mode with gradient checkpointing: torch_varlen (packed) against flex_attention
    (packed) and sdpa (padded). The FA2 kernel computes in bf16 (float32 inputs are cast), so both dtypes are held
    to bf16 tolerances: log-probs within 0.05, gradients within 2% of their scale."""
    batch = [t.cuda() for t in padded_batch([300, 2, 129, 90, 17], seed=7)]
    weights = torch.linspace(-1, 1, RESPONSE_LENGTH, device="cuda")
    results = {}
    for attn, packed in (("sdpa", False), ("flex_attention", True), ("torch_varlen", True)):
        model = model_loading.load_causal_lm(tiny_model_path, dtype=dtype, attn_implementation=attn).cuda().train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log_probs, _ = forward_response_log_probs(model, *batch, RESPONSE_LENGTH, use_remove_padding=packed)
        (log_probs.float() * weights).sum().backward()
        results[attn] = (log_probs.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()})
    assert (results["sdpa"][0] != 0).sum() > 20
    for other in ("sdpa", "flex_attention"):
        torch.testing.assert_close(results["torch_varlen"][0], results[other][0], rtol=0, atol=0.05)
        for name, grad in results[other][1].items():
            assert (results["torch_varlen"][1][name] - grad).abs().max() <= 0.02 * grad.abs().max() + 1e-6, name
