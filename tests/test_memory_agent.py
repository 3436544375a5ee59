"""The memory agent's prompts, chunking, truncation and lock-step batching (sync workflow)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from recurrent.generation_manager import LLMGenerationManager
from recurrent.impls.memory import MemoryAgent, MemoryConfig, MemoryDataset
from recurrent.interface import load_register
from recurrent.prompts import MEMORY_FINAL_TEMPLATE_BOXED, MEMORY_UPDATE_TEMPLATE
from recurrent.utils import center_truncate, concat_conversations, final_batch
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import collate_fn

SPEC_UPDATE = (
    "You are presented with a problem, a section of an article that may contain the answer to the problem, "
    "and a previous memory. Please read the provided section carefully and update the memory with the new "
    "information that helps to answer the problem. Be sure to retain all relevant details from the previous "
    "memory while adding any new, useful information.\n\n<problem> \n{prompt}\n</problem>\n\n<memory>\n{memory}"
    "\n</memory>\n\n<section>\n{chunk}\n</section>\n\nUpdated memory:\n"
)
SPEC_FINAL = (
    "You are presented with a problem and a previous memory. Please answer the problem based on the previous "
    "memory and put the answer in \\boxed{}.\n\n<problem> \n{prompt}\n</problem>\n\n<memory>\n{memory}\n"
    "</memory>\n\nYour answer:\n"
)


@dataclass
class _Out:
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str


class ScriptedRollout:
    """Answers every prompt with fixed text + EOS and records the prompts of each call.

    The agent is under test here, not the engine; engine tests live in test_rollout_*.py.
    """

    def __init__(self, tokenizer, reply: str = "memo"):
        self.tok = tokenizer
        self.reply = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.calls: list[tuple[list[list[int]], object]] = []

    def generate_batch(self, prompts, params):
        self.calls.append((prompts, params))
        return [[_Out(self.reply[: params.max_tokens], None, "stop")] for _ in prompts]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _dataset(tmp_path, tok, contexts, chunk_size=16, max_chunks=8, questions=None):
    rows = [
        {
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": (questions or ["What is the code?"] * len(contexts))[i]}],
            "context": c,
            "reward_model": {"style": "rule", "ground_truth": ["42"]},
            "extra_info": {"index": i},
        }
        for i, c in enumerate(contexts)
    ]
    path = tmp_path / "d.parquet"
    pd.DataFrame(rows).to_parquet(path)
    cfg = MemoryConfig(
        chunk_size=chunk_size, max_chunks=max_chunks, max_memorization_length=8, max_final_response_length=6
    )
    ds = MemoryDataset(cfg, str(path), tok, {"truncation": "center", "max_prompt_length": 64})
    return cfg, ds


def _gen_batch(ds):
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    t_keys, nt_keys = ds.get_batch_keys()
    return batch.select(batch_keys=t_keys, non_tensor_batch_keys=nt_keys)


def test_prompts_byte_for_byte_inside_chat_template(tmp_path, tok):
    assert MEMORY_UPDATE_TEMPLATE == SPEC_UPDATE and MEMORY_FINAL_TEMPLATE_BOXED == SPEC_FINAL
    context = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho"
    cfg, ds = _dataset(tmp_path, tok, [context], chunk_size=10_000)
    agent = MemoryAgent(tok, cfg)
    agent.start(_gen_batch(ds), {})
    prompts, meta = agent.action()
    filled = SPEC_UPDATE.replace("{prompt}", "What is the code?").replace("{memory}", "No previous memory")
    filled = filled.replace("{chunk}", context)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": filled}], add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(prompts[0]) == expected
    assert meta["generation_kwargs"] == {"max_tokens": 8, "n": 1}
    out = _turn(tok, prompts, "remember 42")
    agent.update(out)
    prompts, meta = agent.action()
    final = SPEC_FINAL.replace("{prompt}", "What is the code?").replace("{memory}", "remember 42")
    expected = tok.apply_chat_template([{"role": "user", "content": final}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompts[0]) == expected
    assert "\\boxed{}" in tok.decode(prompts[0]) and "\\boxed{{}}" not in tok.decode(prompts[0])
    assert meta["generation_kwargs"]["max_tokens"] == 6  # max_final_response_length
    assert agent.done()


def _turn(tok, prompts, reply):
    from recurrent.utils import build_conversation_batch

    ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    return DataProto.from_dict(tensors=build_conversation_batch(prompts, [ids] * len(prompts), tok.pad_token_id))


def test_chunk_boundaries_and_lockstep_batching(tmp_path, tok):
    # contexts of 40, 16 and 5 tokens with chunk 16 -> 3, 1, 1 memory turns.
    words = " ".join(f"w{i}" for i in range(200))
    ids = tok.encode(words, add_special_tokens=False)
    contexts = [tok.decode(ids[:40]), tok.decode(ids[:16]), tok.decode(ids[:5])]
    cfg, ds = _dataset(tmp_path, tok, contexts, chunk_size=16)
    lengths = [int(ds[i]["context_length"]) for i in range(3)]
    rollout = ScriptedRollout(tok)
    manager = LLMGenerationManager(tok, rollout, MemoryAgent(tok, cfg))
    timing = {}
    conv, final_mask, sample_index = manager.run_llm_loop(_gen_batch(ds), timing)
    turns = [-(-n // 16) for n in lengths]
    # all trajectories still reading at turn k went to the engine in ONE call; then one final call
    active = [sum(t > k for t in turns) for k in range(max(turns))] + [3]
    assert [len(c[0]) for c in rollout.calls] == active
    assert sample_index.tolist() == [i for k in range(max(turns)) for i in range(3) if turns[i] > k] + [0, 1, 2]
    assert final_mask.tolist() == [False] * (len(sample_index) - 3) + [True] * 3
    assert len(conv) == len(sample_index) and final_mask.sum() == 3
    # chunk boundaries are exact: the section of turn k of sample 0 is ctx[16k:16k+16]
    ctx0 = ds[0]["context_ids"].tolist()
    for k in range(turns[0]):
        text = tok.decode(rollout.calls[k][0][0])
        section = text.split("<section>\n")[1].split("\n</section>")[0]
        assert section == tok.decode(ctx0[16 * k : 16 * (k + 1)])
    # the memory written by the model (EOS removed) is what the next turn sees
    assert "<memory>\nmemo\n</memory>" in tok.decode(rollout.calls[1][0][0])
    assert timing["mt_gen"] > 0
    # every row's response mask covers exactly the reply + EOS
    assert conv.batch["response_mask"].sum(-1).tolist() == [len(rollout.reply)] * len(conv)
    fb = final_batch(conv, final_mask, sample_index)
    assert len(fb) == 3


def test_center_truncation_keeps_first_and_last_halves(tmp_path, tok):
    assert center_truncate(list(range(10)), 4) == [0, 1, 8, 9]
    assert center_truncate(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert center_truncate(list(range(3)), 5) == [0, 1, 2]
    words = " ".join(f"w{i}" for i in range(300))
    cfg, ds = _dataset(tmp_path, tok, [words], chunk_size=10, max_chunks=3)
    full = tok.encode(words, add_special_tokens=False)
    got = ds[0]["context_ids"].tolist()
    assert got == full[:15] + full[-15:]
    assert int(ds[0]["context_length"]) == 30


def test_long_question_widens_batch_instead_of_failing(tmp_path, tok):
    long_q = "Which of these words " + " ".join(f"q{i}" for i in range(150)) + "?"
    words = " ".join(f"w{i}" for i in range(60))
    cfg, ds = _dataset(tmp_path, tok, [words, words], chunk_size=16, questions=["short?", long_q])
    manager = LLMGenerationManager(tok, ScriptedRollout(tok), MemoryAgent(tok, cfg))
    conv, final_mask, sample_index = manager.run_llm_loop(_gen_batch(ds), {})
    assert conv.batch["input_ids"].shape[1] == conv.batch["prompts"].shape[1] + conv.batch["responses"].shape[1]
    # unpadding the concatenated batch gives back each turn's exact prompt
    lens = conv.batch["attention_mask"][:, : conv.batch["prompts"].shape[1]].sum(-1)
    assert lens.max() > 150


def test_concat_conversations_repads_turns_of_different_widths(tok):
    from recurrent.utils import build_conversation_batch

    a = DataProto.from_dict(tensors=build_conversation_batch([[5, 6]], [[7]], 0))
    b = DataProto.from_dict(tensors=build_conversation_batch([[1, 2, 3, 4]], [[8, 9, 10]], 0))
    c = concat_conversations([a, b], pad_id=0)
    assert c.batch["prompts"].tolist() == [[0, 0, 5, 6], [1, 2, 3, 4]]
    assert c.batch["responses"].tolist() == [[7, 0, 0], [8, 9, 10]]
    assert c.batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5, 6]]
    assert c.batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    # response-aligned tensors (the engine's log-probs) stay aligned with their tokens: padded on the right
    a.batch["rollout_log_probs"] = torch.tensor([[-0.5]])
    b.batch["rollout_log_probs"] = torch.tensor([[-0.1, -0.2, -0.3]])
    c = concat_conversations([a, b], pad_id=0)
    torch.testing.assert_close(c.batch["rollout_log_probs"], torch.tensor([[-0.5, 0.0, 0.0], [-0.1, -0.2, -0.3]]))


def test_final_batch_orders_final_conversations_by_trajectory():
    """Finals arriving out of trajectory order (async agents finish when they finish) come back as row i =
    trajectory i; memory turns are left out."""
    conv = DataProto.from_dict(tensors={"row": torch.arange(5)})
    final_mask = torch.tensor([True, False, True, True, False])
    sample_index = torch.tensor([2, 0, 0, 1, 1])
    assert final_batch(conv, final_mask, sample_index).batch["row"].tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="more than one final conversation"):
        final_batch(conv, torch.tensor([True, True, False, False, False]), torch.tensor([0, 0, 1, 1, 1]))


def test_register_resolution(tmp_path):
    reg = load_register("memory")
    assert reg.agent_cls is MemoryAgent
    # the original configs name the file relative to the repository root
    assert load_register("memory", path="recurrent/impls/memory.py", obj_name="REGISTER").agent_cls is MemoryAgent
    with pytest.raises(ValueError, match="unknown recurrent workflow 'nope'"):
        load_register("nope")
    bad = tmp_path / "wf.py"
    bad.write_text("REGISTER = 3\n")
    with pytest.raises(TypeError, match="must be an RRegister"):
        load_register(str(bad))


def test_bad_config_and_rows_named(tmp_path, tok):
    with pytest.raises(ValueError, match="chunk_size"):
        MemoryConfig(chunk_size=0)
    pd.DataFrame([{"prompt": [{"role": "user", "content": "q?"}], "context": 3}]).to_parquet(tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x.parquet row 0: field 'context'"):
        MemoryDataset(MemoryConfig(), str(tmp_path / "x.parquet"), tok, {"truncation": "center"})
    with pytest.raises(ValueError, match="center"):
        MemoryDataset(MemoryConfig(), str(tmp_path / "x.parquet"), tok, {"truncation": "error"})
