"""``model.override_config`` and ``model.trust_remote_code`` reach every model the trainer builds and the tokenizer.

Actor, reference model and the HF rollout engine are built for real from the config (tiny Qwen2 model) and carry
the override in their HF config; the vLLM engine gets it as ``hf_overrides`` (vLLM's own ``EngineArgs`` then
builds a model config with it). Every ``AutoConfig`` / ``AutoTokenizer`` / ``AutoModel*`` call made while
building them, and the trainer's tokenizer (``load_tokenizer``), passes ``trust_remote_code=True`` when the key
says so. The critic has its own ``critic.model.override_config`` and follows the policy's ``trust_remote_code``.
"""

from __future__ import annotations

import pytest
import transformers

from tests.test_config import worker_config

DROPOUT = 0.25


@pytest.fixture
def hf_calls(monkeypatch) -> list[tuple[str, object]]:
    """``(class name, trust_remote_code)`` of every ``from_pretrained`` call of the transformers auto classes."""
    calls: list[tuple[str, object]] = []
    for cls in (
        transformers.AutoConfig,
        transformers.AutoTokenizer,
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForTokenClassification,
    ):
        original = cls.from_pretrained

        def recording(*args, _original=original, _name=cls.__name__, **kwargs):
            calls.append((_name, kwargs.get("trust_remote_code")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", recording)
    return calls


def test_override_and_trust_remote_code_reach_actor_ref_hf_engine_and_tokenizer(tiny_model_path, hf_calls):
    from verl.utils.model_loading import load_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = worker_config(
        tiny_model_path,
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.model.trust_remote_code=True",
        f"+actor_rollout_ref.model.override_config.attention_dropout={DROPOUT}",
    )
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    assert tokenizer.eos_token is not None
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, "cpu")
    worker.init_model()
    try:
        assert worker.actor_module.config.attention_dropout == DROPOUT
        assert worker.ref.actor_module.config.attention_dropout == DROPOUT
        assert worker.rollout.model.config.attention_dropout == DROPOUT
    finally:
        worker.shutdown_engines()
    names = {name for name, _ in hf_calls}
    assert {"AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"} <= names
    assert all(trust is True for _, trust in hf_calls), hf_calls


def test_defaults_leave_models_alone(tiny_model_path, hf_calls, monkeypatch):
    import verl.workers.rollout.base as rollout_base
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: None)
    worker = ActorRolloutRefWorker(
        worker_config(tiny_model_path, "actor_rollout_ref.rollout.name=hf").actor_rollout_ref
    )
    worker.init_model()
    assert worker.actor_module.config.attention_dropout == 0.0
    assert all(trust is False for _, trust in hf_calls), hf_calls


def test_critic_gets_its_override_and_the_policys_trust_remote_code(tiny_model_path, hf_calls):
    from verl.workers.critic.critic_worker import CriticWorker

    cfg = worker_config(
        tiny_model_path,
        "actor_rollout_ref.model.trust_remote_code=True",
        "+critic.model.override_config.attention_dropout=0.5",
    )
    critic = CriticWorker(cfg.critic, "cpu")
    critic.init_model()
    assert critic.critic_module.config.attention_dropout == 0.5
    assert hf_calls and all(trust is True for _, trust in hf_calls), hf_calls


@pytest.mark.vllm
def test_vllm_engine_gets_hf_overrides_and_trust_remote_code(tiny_model_path, monkeypatch):
    import verl.workers.rollout.base as rollout_base
    import verl.workers.rollout.vllm_engine as vllm_engine
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    seen: dict = {}
    monkeypatch.setattr(rollout_base, "get_rollout_engine", lambda name, **kwargs: seen.update(name=name, **kwargs))
    cfg = worker_config(
        tiny_model_path,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # one rank here
        "actor_rollout_ref.model.trust_remote_code=True",
        f"+actor_rollout_ref.model.override_config.attention_dropout={DROPOUT}",
    )
    worker = object.__new__(ActorRolloutRefWorker)
    worker.config, worker.model_path, worker.device_name = cfg.actor_rollout_ref, str(tiny_model_path), "cpu"
    worker._init_rollout()
    assert seen["name"] == "vllm" and seen["trust_remote_code"] is True
    assert seen["hf_overrides"] == {"attention_dropout": DROPOUT}

    # the engine hands them to vLLM's EngineArgs, whose model config then carries the override
    class RecordingDriver:
        def __init__(self, args, engine_stream="shared"):
            seen["engine_args"] = args
            self.max_model_len, self.tokenizer = args.get("max_model_len"), None

    monkeypatch.setattr(vllm_engine, "_InprocDriver", RecordingDriver)
    vllm_engine.VLLMRolloutEngine(
        str(tiny_model_path),
        dtype="float32",
        max_model_len=128,
        trust_remote_code=True,
        hf_overrides={"attention_dropout": DROPOUT},
    )
    args = seen["engine_args"]
    assert args["hf_overrides"] == {"attention_dropout": DROPOUT} and args["trust_remote_code"] is True
    from vllm.engine.arg_utils import EngineArgs

    model_config = EngineArgs(**{k: v for k, v in args.items() if k != "worker_extension_cls"}).create_model_config()
    assert model_config.hf_config.attention_dropout == DROPOUT
