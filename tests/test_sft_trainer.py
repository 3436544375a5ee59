"""The SFT trainer (``python -m verl.trainer.main_sft``): assistant masks token by token, truncation, the global
token-mean loss against a hand-written reference and across micro-batch sizes, the loss falling on the tiny
model, resume after a stop (same batches, same parameters as an uninterrupted run), the Hydra entry point end to
end, and the config file (a comment above every key, early validation)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.rank_processes import spawn
from verl.trainer.fsdp_sft_trainer import FSDPSFTTrainer, validate_sft_config
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset, sft_collate, tokenize_with_assistant_mask

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(REPO / "verl" / "trainer" / "config")
YAML_PATH = REPO / "verl" / "trainer" / "config" / "sft_trainer.yaml"

# ChatML without {% generation %} blocks: the mask must not depend on them.
PLAIN_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": "It is 2."},
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _masked_runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


# --------------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------------


def test_assistant_mask_token_by_token_on_a_multi_turn_conversation(tok):
    ids, mask = tokenize_with_assistant_mask(tok, CONVERSATION)
    text = tok.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
        "<|im_start|>assistant\nIt is 2.<|im_end|>\n<|im_start|>user\nAnd 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )
    # exactly the two answers with their end-of-turn token: no header, no "\n" after <|im_end|>, no prompt
    assert _masked_runs(tok, ids, mask) == ["It is 2.<|im_end|>", "4<|im_end|>"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [k for k, t in enumerate(ids) if t == im_end]
    assert [mask[k] for k in ends] == [0, 0, 1, 0, 1]  # system, user, assistant, user, assistant
    assert mask[ends[2] + 1] == 0 and tok.decode([ids[ends[2] + 1]]) == "\n"
    first = ids.index(tok.convert_tokens_to_ids("<|im_start|>"), ends[1])  # the first assistant header
    header_len = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
    assert mask[first : first + header_len] == [0] * header_len and mask[first + header_len] == 1
    assert (
        sum(mask)
        == len(tok("It is 2.", add_special_tokens=False)["input_ids"])
        + 1
        + len(tok("4", add_special_tokens=False)["input_ids"])
        + 1
    )
    # the same mask the template's {% generation %} blocks give
    ref = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ref["input_ids"] == ids and list(ref["assistant_masks"]) == mask


def test_mask_does_not_need_generation_blocks_and_handles_a_default_system_prompt(tok):
    ids, mask = tokenize_with_assistant_mask(tok, CONVERSATION, chat_template=PLAIN_CHATML)
    assert _masked_runs(tok, ids, mask) == ["It is 2.<|im_end|>", "4<|im_end|>"]
    smollm2 = (REPO / "recurrent" / "chat_template" / "smollm2.jinja").read_text()
    ids, mask = tokenize_with_assistant_mask(tok, CONVERSATION[1:3], chat_template=smollm2)
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert _masked_runs(tok, ids, mask) == ["It is 2.<|im_end|>"]


def test_chat_template_key_reaches_the_dataset(tok, tmp_path):
    files = _write(tmp_path / "c.parquet", [CONVERSATION[1:3]])
    path = REPO / "recurrent" / "chat_template" / "smollm2.jinja"
    for spec in (str(path), path.read_text()):  # a file path or the template text
        row = MultiTurnSFTDataset(files, tok, {"chat_template": spec})[0]
        assert tok.decode(row["input_ids"]).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    with pytest.raises(FileNotFoundError, match="data.chat_template"):
        MultiTurnSFTDataset(files, tok, {"chat_template": "no/such/template.jinja"})


class _CountingTokenizer:
    """The tokenizer with its encode calls counted (and ``is_fast`` optionally hidden)."""

    def __init__(self, tok, fast: bool) -> None:
        self._tok, self.is_fast, self.calls = tok, fast, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._tok(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_mask_tokenises_a_long_conversation_once_and_matches_per_prefix_tokenisation(tok):
    turns = [CONVERSATION[0]]
    for k in range(12):
        turns += [{"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": f"Answer {k}."}]
    counting_fast, counting_slow = _CountingTokenizer(tok, fast=True), _CountingTokenizer(tok, fast=False)
    fast = tokenize_with_assistant_mask(counting_fast, turns, chat_template=PLAIN_CHATML)
    slow = tokenize_with_assistant_mask(counting_slow, turns, chat_template=PLAIN_CHATML)
    assert counting_fast.calls == 1  # offsets give every boundary: linear, not one encode per prefix
    assert counting_slow.calls == 1 + 2 * 12  # without offsets: the whole text plus two prefixes per answer
    assert fast == slow
    assert _masked_runs(tok, *fast) == [f"Answer {k}.<|im_end|>" for k in range(12)]


def test_mask_rejects_conversations_without_a_prompt_or_an_answer(tok):
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_with_assistant_mask(tok, CONVERSATION[:2])
    with pytest.raises(ValueError, match="starts with an assistant"):
        tokenize_with_assistant_mask(tok, CONVERSATION[2:])
    # a template that rewrites earlier turns (drops past assistant messages) cannot be masked by prefixes
    rewriting = (
        "{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(ValueError, match="data.chat_template"):
        tokenize_with_assistant_mask(tok, CONVERSATION, chat_template=rewriting)


def test_collate_right_pads_rows_and_counts_positions_over_real_tokens():
    rows = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
        {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([1])},
    ]
    out = sft_collate(rows, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def _write(path: Path, conversations: list[list[dict]]) -> str:
    pd.DataFrame({"messages": conversations, "split": "train"}).to_parquet(path)
    return str(path)


def test_truncation_left_right_and_error(tok, tmp_path):
    files = _write(tmp_path / "c.parquet", [CONVERSATION])
    full = MultiTurnSFTDataset(files, tok, {"max_length": 1000})[0]
    n = 12
    left = MultiTurnSFTDataset(files, tok, {"max_length": n, "truncation": "left"})[0]
    right = MultiTurnSFTDataset(files, tok, {"max_length": n, "truncation": "right"})[0]
    assert left["input_ids"].tolist() == full["input_ids"][-n:].tolist()
    assert left["loss_mask"].tolist() == full["loss_mask"][-n:].tolist()
    assert tok.decode(left["input_ids"][left["loss_mask"].bool()]) == "4<|im_end|>"  # the last answer survives
    assert right["input_ids"].tolist() == full["input_ids"][:n].tolist()
    assert right["loss_mask"].sum() == 0  # the first 12 tokens are system + user text
    with pytest.raises(ValueError, match=r"data.max_length=12"):
        MultiTurnSFTDataset(files, tok, {"max_length": n, "truncation": "error"})[0]
    with pytest.raises(ValueError, match="data.truncation"):
        MultiTurnSFTDataset(files, tok, {"truncation": "middle"})


def test_single_turn_rows_and_missing_columns(tok, tmp_path):
    path = tmp_path / "s.parquet"
    pd.DataFrame({"q": ["What is 1+1?"], "a": ["It is 2."]}).to_parquet(path)
    cfg = {"multiturn": {"enable": False}, "prompt_key": "q", "response_key": "a"}
    row = MultiTurnSFTDataset(str(path), tok, cfg)[0]
    ids, mask = tokenize_with_assistant_mask(tok, CONVERSATION[1:3])
    assert row["input_ids"].tolist() == ids and row["loss_mask"].tolist() == mask
    with pytest.raises(ValueError, match="data.multiturn.messages_key='messages' is not a column"):
        MultiTurnSFTDataset(str(path), tok, {})


# --------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------


def _conversations(n: int) -> list[list[dict]]:
    out = []
    for k in range(n):
        a, b = k % 5 + 1, k % 3 + 2
        conv = [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"It is {a + b}."}]
        if k % 2:
            conv = [{"role": "system", "content": "Answer in words."}] + conv
            conv += [{"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes, I am sure."}]
        out.append(conv)
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    return _write(tmp_path_factory.mktemp("sft_data") / "train.parquet", _conversations(8))


def _cfg(tiny_model_path, data_file, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sft_trainer",
            overrides=[
                f"data.train_files={data_file}",
                f"model.partial_pretrain={tiny_model_path}",
                f"trainer.default_local_dir={out}",
                "trainer.device=cpu",
                "trainer.logger=[jsonl]",
                "trainer.progress_bar=false",
                "data.train_batch_size=4",
                "data.micro_batch_size_per_gpu=2",
                "optim.lr=1e-3",
                "optim.warmup_steps_ratio=0",
                *overrides,
            ],
        )


def _reference_loss(model_path, dataset: MultiTurnSFTDataset, rows: list[int]) -> float:
    """Token-mean NLL of the assistant tokens, one unpadded row at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    total, count = 0.0, 0
    with torch.no_grad():
        for i in rows:
            row = dataset[i]
            ids, mask = row["input_ids"], row["loss_mask"]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)
            for t in range(1, len(ids)):
                if mask[t]:
                    total -= float(logp[t - 1, ids[t]])
                    count += 1
    return total / count


def test_loss_is_the_global_token_mean_and_invariant_to_the_micro_batch_size(tiny_model_path, data_file, tmp_path):
    results = {}
    for micro in (1, 3, 4):
        trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path / f"m{micro}", "data.shuffle=false",
                                      f"data.micro_batch_size_per_gpu={micro}"))  # fmt: skip
        seen = []  # the accumulated gradient the optimizer steps with
        trainer.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs, seen=seen, model=trainer.model: seen.extend(
                p.grad.detach().clone() for p in model.parameters()
            )
        )
        metrics = trainer.train_step([0, 1, 2, 3])
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results[micro] = (metrics, torch.cat([g.flatten() for g in seen]), params)
    reference = _reference_loss(tiny_model_path, trainer.train_dataset, [0, 1, 2, 3])
    tokens = sum(int(trainer.train_dataset[i]["loss_mask"][1:].sum()) for i in range(4))
    for micro, (metrics, grads, params) in results.items():
        assert metrics["train/assistant_tokens"] == tokens
        assert metrics["train/loss"] == pytest.approx(reference, rel=1e-5), micro
        assert metrics["train/grad_norm"] == pytest.approx(results[1][0]["train/grad_norm"], rel=1e-5)
        assert torch.allclose(grads, results[1][1], rtol=1e-5, atol=1e-7), (micro, (grads - results[1][1]).abs().max())
        # Adam's first step moves each weight by ~lr x g / (|g| + eps): for the entries whose gradient is below
        # eps (1e-8; the smallest here are ~3e-10) float rounding of g shows up at ~1e-6 of the weight
        assert torch.allclose(params, results[1][2], atol=1e-5), (micro, (params - results[1][2]).abs().max())
    # rows of different lengths and token counts: a mean of per-micro-batch means would differ
    per_row = [_reference_loss(tiny_model_path, trainer.train_dataset, [i]) for i in range(4)]
    assert abs(sum(per_row) / 4 - reference) > 1e-3


def test_loss_falls_on_the_tiny_model(tiny_model_path, data_file, tmp_path):
    cfg = _cfg(
        tiny_model_path, data_file, tmp_path, "trainer.total_training_steps=12", "optim.lr=1e-2",
        "optim.warmup_steps_ratio=0.25",
    )  # fmt: skip
    history = FSDPSFTTrainer(cfg).fit()
    # 3 warm-up steps (0.25 x 12), then half a cosine over the other 9 (optim.lr_scheduler=cosine by default)
    expected = [(s + 1) / 3 if s < 3 else 0.5 * (1 + math.cos(math.pi * (s - 3) / 9)) for s in range(12)]
    assert [h["train/lr"] for h in history] == pytest.approx([1e-2 * x for x in expected], rel=1e-9)
    losses = [h["train/loss"] for h in history]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[0] > 5.0  # ~log(vocab) for the random model
    assert losses[-1] < 0.5 * losses[0], losses
    assert [h["train/epoch"] for h in history][:2] == [0.0, 1.0]  # 8 rows / 4 per batch = 2 steps per epoch


def test_fewer_rows_than_one_batch_is_refused_naming_the_file_the_rows_and_the_key(
    tiny_model_path, data_file, tmp_path
):
    # 8 rows and batches of 16: zero optimizer steps per epoch, refused before the model loads
    with pytest.raises(ValueError, match=r"train\.parquet'\] has 8 rows, fewer than data\.train_batch_size=16"):
        FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "data.train_batch_size=16"))
    empty = _write(tmp_path / "empty.parquet", [])
    with pytest.raises(ValueError, match=r"empty\.parquet has no rows"):  # refused where the rows are read
        FSDPSFTTrainer(_cfg(tiny_model_path, empty, tmp_path))
    assert not (tmp_path / "logs").exists()


def _loss_and_grads(trainer: FSDPSFTTrainer, batch: dict) -> tuple[float, int, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    nll, count = trainer._nll_sum(batch)
    (nll / count).backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return float(nll.detach()), count, grads


def test_fused_loss_head_matches_the_unfused_loss_and_gradients(tiny_model_path, data_file, tmp_path):
    """model.use_fused_kernels (default on): the assistant tokens' log-probs from the hidden states in chunks
    (the RL actor's head), the same loss and gradients as full-vocabulary float32 logits, without those logits."""
    cfg = _cfg(tiny_model_path, data_file, tmp_path, "model.fused_kernel_options.chunk_size=7",
               "data.micro_batch_size_per_gpu=4")  # fmt: skip
    assert cfg.model.use_fused_kernels is True  # the default
    trainer = FSDPSFTTrainer(cfg)
    assert trainer.use_fused_kernels and trainer.fused_chunk_size == 7
    (batch,) = trainer._micro_batches([0, 1, 2, 3], trainer.train_dataset)  # rows of different lengths: padded
    assert (batch["attention_mask"] == 0).any()
    shapes = []
    head = trainer.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    fused = _loss_and_grads(trainer, batch)
    trainer.use_fused_kernels = False
    unfused = _loss_and_grads(trainer, batch)
    hook.remove()
    vocab = head.weight.shape[0]
    assert shapes == [(1, fused[1], 1), (*batch["input_ids"].shape, vocab)]  # no [batch, seq, vocab] when fused
    assert fused[1] == unfused[1] == int(batch["loss_mask"][:, 1:].sum()) > 7  # several chunks
    assert fused[0] == pytest.approx(unfused[0], rel=1e-5)
    assert fused[0] / fused[1] == pytest.approx(_reference_loss(tiny_model_path, trainer.train_dataset, [0, 1, 2, 3]),
                                                rel=1e-5)  # fmt: skip
    assert fused[2].keys() == unfused[2].keys() and len(fused[2]) > 5
    for name, grad in fused[2].items():
        assert torch.allclose(grad, unfused[2][name], atol=1e-5, rtol=1e-5), (
            name,
            (grad - unfused[2][name]).abs().max(),
        )
    off = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path / "off", "model.use_fused_kernels=false"))
    assert off.use_fused_kernels is False
    with pytest.raises(ValueError, match="model.fused_kernel_options.chunk_size must be an integer >= 1, got 0"):
        validate_sft_config(_cfg(tiny_model_path, data_file, tmp_path, "model.fused_kernel_options.chunk_size=0"))


def test_rows_are_tokenised_once_over_two_epochs(tiny_model_path, data_file, tok, tmp_path):
    once = _CountingTokenizer(tok, fast=True)
    dataset = MultiTurnSFTDataset(data_file, once, {})
    first = [dataset[i] for i in range(len(dataset))]
    per_epoch = once.calls
    assert per_epoch >= len(dataset) == 8
    again = [dataset[i] for i in range(len(dataset))]  # a second epoch reads the cache
    assert once.calls == per_epoch and all(a is b for a, b in zip(first, again))
    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "trainer.total_epochs=2"))
    counting = trainer.train_dataset.tokenizer = _CountingTokenizer(tok, fast=True)
    history = trainer.fit()
    assert [h["train/epoch"] for h in history] == [0.0, 1.0, 1.0, 2.0]  # 2 epochs of 2 steps
    assert counting.calls == per_epoch  # every row tokenised in the first epoch only


def _sigterm_in_step(trainer: FSDPSFTTrainer, at_step: int, times: int) -> None:
    """Send SIGTERM to this process ``times`` times at the start of step ``at_step`` (1-based)."""
    import signal

    real = trainer.train_step

    def step(indices):
        if trainer.global_step + 1 == at_step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGTERM)
        return real(indices)

    trainer.train_step = step


def test_first_sigterm_finishes_the_step_checkpoints_and_returns(tiny_model_path, data_file, tmp_path, capsys):
    import signal

    from verl.utils.checkpoint import CheckpointManager

    before = signal.getsignal(signal.SIGTERM)
    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "trainer.total_training_steps=4"))
    _sigterm_in_step(trainer, at_step=2, times=1)
    history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    assert [s for s, _ in CheckpointManager(tmp_path).list_checkpoints()] == [2]  # save_freq=-1: the stop's own
    assert "[sft] SIGTERM: stopped after step 2/4; checkpoint written" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before
    # SIGTERM while the checkpoint loads: no step runs, nothing new is saved
    early = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "trainer.total_training_steps=4"))
    load = early.load_checkpoint
    early.load_checkpoint = lambda: (load(), os.kill(os.getpid(), signal.SIGTERM))[0]
    assert early.fit() == [] and early.global_step == 2
    assert "[sft] SIGTERM: stopping before step 3/4; no step ran" in capsys.readouterr().out
    assert [s for s, _ in CheckpointManager(tmp_path).list_checkpoints()] == [2]
    resumed = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "trainer.total_training_steps=4")).fit()
    assert [h["step"] for h in resumed] == [3, 4]
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_sigterm_abandons_the_step_with_exit_code_143(tiny_model_path, data_file, tmp_path):
    import signal

    from verl.trainer.ppo.signals import ABANDONED_EXIT_CODE, StepAbandoned
    from verl.utils.checkpoint import CheckpointManager

    before = signal.getsignal(signal.SIGTERM)
    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, "trainer.total_training_steps=4"))
    _sigterm_in_step(trainer, at_step=2, times=2)
    with pytest.raises(StepAbandoned) as abandoned:
        trainer.fit()
    assert abandoned.value.code == ABANDONED_EXIT_CODE == 143
    assert trainer.global_step == 1 and CheckpointManager(tmp_path).find_latest() is None  # nothing half-done saved
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_after_a_stop_continues_like_an_uninterrupted_run(tiny_model_path, data_file, tmp_path):
    def run(out: Path, *overrides: str) -> tuple[list[dict], list[list[int]]]:
        trainer = FSDPSFTTrainer(
            _cfg(
                tiny_model_path,
                data_file,
                out,
                "trainer.total_training_steps=4",
                "trainer.test_freq=4",
                f"data.val_files={data_file}",
                *overrides,
            )  # fmt: skip
        )
        seen, step = [], trainer.train_step
        trainer.train_step = lambda indices: (seen.append(list(indices)), step(indices))[1]
        return trainer.fit(), seen

    whole, whole_batches = run(tmp_path / "whole")
    first, first_batches = run(tmp_path / "cut", "trainer.max_wall_time_s=0")  # stops after step 1, saved
    assert [h["step"] for h in first] == [1] and (tmp_path / "cut" / "global_step_1" / "COMPLETE").exists()
    rest, rest_batches = run(tmp_path / "cut")
    assert [h["step"] for h in rest] == [2, 3, 4]
    assert first_batches + rest_batches == whole_batches  # the same batches, in the same order (shuffled)
    assert sorted(whole_batches[0] + whole_batches[1]) == list(range(8)) and whole_batches[0] != [0, 1, 2, 3]
    for a, b in zip(whole, first + rest):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6, abs=1e-7)
    assert whole[-1]["val/loss"] == pytest.approx(rest[-1]["val/loss"], rel=1e-6)
    from safetensors.torch import load_file

    final = [load_file(d / "global_step_4" / "actor" / "huggingface" / "model.safetensors") for d in
             (tmp_path / "whole", tmp_path / "cut")]  # fmt: skip
    assert final[0].keys() == final[1].keys()
    assert all(torch.allclose(final[0][k], final[1][k], atol=1e-6) for k in final[0])
    lines = (tmp_path / "cut" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]  # each step logged once


@pytest.mark.slow
def test_entry_point_runs_end_to_end_with_hydra_overrides(tiny_model_path, data_file, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "verl.trainer.main_sft", f"data.train_files={data_file}",
           f"data.val_files={data_file}", f"model.partial_pretrain={tiny_model_path}",
           f"trainer.default_local_dir={out}", "trainer.device=cpu", "trainer.logger=[console,jsonl]",
           "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2", "trainer.total_epochs=2",
           "trainer.test_freq=2", "optim.lr=1e-3", f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 8 rows / 4 per batch x 2 epochs
    assert "val/loss" in records[1] and "val/loss" in records[3] and "val/loss" not in records[0]
    assert records[3]["val/loss"] < records[1]["val/loss"]
    assert re.search(r"step:4 - .*train/loss:", proc.stdout)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "global_step_4" / "actor" / "huggingface")
    assert sum(p.numel() for p in merged.parameters()) > 0
    assert (out / "global_step_4" / "actor" / "huggingface" / "tokenizer.json").is_file()


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*:")


def test_every_key_has_a_comment_line_above_it():
    undocumented, previous, keys = [], "", 0
    for number, line in enumerate(YAML_PATH.read_text().splitlines(), start=1):
        if _KEY_LINE.match(line):
            keys += 1
            if not previous.lstrip().startswith("#"):
                undocumented.append(f"line {number}: {line.strip()}")
        if line.strip():
            previous = line
    assert undocumented == [] and keys > 40
    cfg = OmegaConf.load(YAML_PATH)
    for key in ("data.multiturn.messages_key", "data.micro_batch_size_per_gpu", "model.partial_pretrain",
                "optim.warmup_steps_ratio", "optim.clip_grad", "trainer.resume_mode", "trainer.save_freq"):  # fmt: skip
        assert OmegaConf.select(cfg, key, default="missing") != "missing", key


@pytest.mark.parametrize("flag", [True, False])
def test_compile_layers_reaches_the_model(tiny_model_path, data_file, tmp_path, flag):
    from verl.utils.compile_layers import decoder_layers, is_compiled

    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, f"model.compile_layers={str(flag).lower()}"))
    assert [is_compiled(layer) for layer in decoder_layers(trainer.model)] == [flag, flag]


@pytest.mark.parametrize("given", [None, True, False], ids=["null", "true", "false"])
def test_use_liger_is_resolved_for_the_trainers_device(
    tiny_model_path, data_file, tmp_path, monkeypatch, caplog, given
):
    """``model.use_liger``: null resolves for this process's device (CPU here: off, though the host has CUDA and
    liger-kernel, both faked), logged under the SFT key; true/false reach the loader as given. null and false with
    compile_layers validate (only true is refused, above)."""
    import logging

    from verl.utils import liger, model_loading

    monkeypatch.setattr(liger.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(liger, "liger_model_types", lambda: frozenset({"qwen2"}))
    loads, real_load = [], model_loading.load_causal_lm
    monkeypatch.setattr(
        model_loading, "load_causal_lm", lambda *a, **kw: loads.append(kw["use_liger"]) or real_load(*a, **kw)
    )
    overrides = ["trainer.device=cpu"] + ([] if given is None else [f"model.use_liger={str(given).lower()}"])
    with caplog.at_level(logging.INFO, logger="verl.utils.liger"):
        trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, *overrides))
    assert loads == [False if given is None else given] and not liger.liger_applied(trainer.model)
    infos = [r.getMessage() for r in caplog.records if r.name == "verl.utils.liger" and r.levelno == logging.INFO]
    assert infos == (["model.use_liger=null -> False: the model is loaded on cpu; liger-kernel's Triton kernels need CUDA"] if given is None else [])  # fmt: skip
    for value in ("null", "false"):
        validate_sft_config(_cfg(tiny_model_path, data_file, tmp_path, "model.compile_layers=true", f"model.use_liger={value}"))  # fmt: skip


def test_gradient_checkpointing_every_reaches_the_model(tiny_model_path, data_file, tmp_path):
    from verl.utils.compile_layers import decoder_layers

    overrides = ("model.enable_gradient_checkpointing=true", "model.gradient_checkpointing_every=2")
    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, *overrides))
    assert [layer.gradient_checkpointing for layer in decoder_layers(trainer.model)] == [True, False]


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("null", None)])
def test_optim_fused_reaches_the_optimizer(tiny_model_path, data_file, tmp_path, value, expected):
    """``optim.fused`` (verl/utils/fsdp_utils.py::build_optimizer): true = torch's fused AdamW (CPU kernel here);
    null on CPU = torch's default."""
    trainer = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path, f"optim.fused={value}"))
    assert trainer.optimizer.defaults["fused"] is expected


@pytest.mark.parametrize(
    ("override", "world", "message"),
    [
        ("data.train_batch_size=6", 4, r"data.train_batch_size=6 must be divisible by the number of processes \(4\)"),
        ("data.micro_batch_size_per_gpu=0", 1, "data.micro_batch_size_per_gpu must be an integer >= 1, got 0"),
        ("optim.lr_scheduler=wsd", 1, r"optim.lr_scheduler must be one of \('constant', 'cosine'\), got 'wsd'"),
        ("trainer.total_training_steps=0", 1, "trainer.total_training_steps must be null or an integer >= 1"),
        ("optim.warmup_steps_ratio=1.5", 1, r"optim.warmup_steps_ratio must be in \[0, 1\], got 1.5"),
        ("data.train_files=''", 1, "data.train_files must name at least one parquet/json/jsonl file, got nothing"),
        ("model.compile_layers=1", 1, "model.compile_layers must be true or false, got 1"),
        ("optim.fused=1", 1, "optim.fused must be true, false or null, got 1"),
        (
            "model.gradient_checkpointing_every=0",
            1,
            "model.gradient_checkpointing_every must be an integer >= 1, got 0",
        ),
        (
            "model.compile_layers=true model.attn_implementation=flex_attention",
            1,
            "model.compile_layers=True with model.attn_implementation=flex_attention is not supported: on C",
        ),
        ("model.use_liger=1", 1, "model.use_liger must be true, false or null, got 1"),
        (
            "model.compile_layers=true model.use_liger=true",
            1,
            r"model.use_liger=True with model.compile_layers=True is not supported: dynamo cannot trace liger-kernel's "
            r"Triton RMSNorm .* set one of them to False .* or leave model.use_liger null",
        ),
    ],
)
def test_config_is_validated_early_with_the_key_named(tiny_model_path, data_file, tmp_path, override, world, message):
    cfg = _cfg(tiny_model_path, data_file, tmp_path, *override.split())
    with pytest.raises(ValueError, match=message):
        validate_sft_config(cfg, world)


def test_sft_and_rl_trainers_read_file_lists_with_one_helper():
    """data.train_files / data.val_files: one path, a list (ListConfig too) or none, the same for SFT and RL."""
    from verl.trainer import config_preflight, fsdp_sft_trainer
    from verl.trainer.config.data import DataConfig, file_list

    assert fsdp_sft_trainer.file_list is file_list and config_preflight.file_list is file_list
    assert file_list(None) == file_list("") == [] and file_list("a.parquet") == ["a.parquet"]
    assert file_list(OmegaConf.create({"f": ["a.parquet", "${x}"], "x": "b.jsonl"}).f) == ["a.parquet", "b.jsonl"]
    assert DataConfig.from_config({"train_files": "a.parquet", "val_files": ["b.jsonl"]}).val_file_list == ["b.jsonl"]


# --------------------------------------------------------------------------------------------------
# 2 ranks (FSDP2 over gloo on CPU) vs 1 process
# --------------------------------------------------------------------------------------------------


def _rank_main(rank: int, port: int, cfg_yaml: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    from verl.trainer.main_sft import run

    history = run(OmegaConf.create(cfg_yaml))
    Path(out, f"history_rank{rank}.json").write_text(json.dumps(history))


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(tiny_model_path, data_file, tmp_path):
    import socket

    from safetensors.torch import load_file

    val = _write(tmp_path / "val.parquet", _conversations(5))  # 5 rows: rank 1 runs a zero-weight pass
    overrides = ("trainer.total_training_steps=2", "trainer.test_freq=2", f"data.val_files={val}")
    single = FSDPSFTTrainer(_cfg(tiny_model_path, data_file, tmp_path / "one", *overrides)).fit()
    cfg = _cfg(tiny_model_path, data_file, tmp_path / "two", *overrides)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_rank_main, args=(port, OmegaConf.to_yaml(cfg), str(tmp_path)), nprocs=2, join=True)
    double = json.loads((tmp_path / "history_rank0.json").read_text())
    assert [h["step"] for h in double] == [1, 2]
    for a, b in zip(single, double):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
        assert b["train/assistant_tokens"] == a["train/assistant_tokens"]
    assert double[-1]["val/loss"] == pytest.approx(single[-1]["val/loss"], rel=1e-5)
    assert double[-1]["val/assistant_tokens"] == single[-1]["val/assistant_tokens"]
    meta = json.loads((tmp_path / "two" / "global_step_2" / "COMPLETE").read_text())
    assert meta["world_size"] == 2
    weights = [load_file(tmp_path / d / "global_step_2" / "actor" / "huggingface" / "model.safetensors") for d in
               ("one", "two")]  # fmt: skip
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-5) for k in weights[0])


def test_attention_errors_name_the_sft_key(tiny_model_path, data_file, tmp_path):
    """The loader's attention messages name ``model.attn_implementation`` in the SFT trainer (its own section), not
    the RL trainer's ``actor_rollout_ref.model``: torch_varlen cannot run on this CPU trainer."""
    cfg = _cfg(tiny_model_path, data_file, tmp_path, "trainer.device=cpu", "model.attn_implementation=torch_varlen")
    with pytest.raises(ValueError, match=r"^model\.attn_implementation='torch_varlen' needs CUDA"):
        FSDPSFTTrainer(cfg)
