"""``actor_rollout_ref.rollout.engine_stream``: the CUDA stream of the in-process vLLM engine thread.

CPU: the stream is inert there (every method a no-op), an unknown mode is refused naming the key, and the engine
thread's protocol is checked with a recording stand-in for the stream (CUDA streams cannot exist here): a call
starts after the engine's queued work and its caller's mark, runs, finishes the stream's work, then answers; every weight bucket is waited for and
held on the engine stream before it is loaded. GPU (``gpu``): a real engine on its own high-priority stream
generates what HF generates, also while another thread keeps the GPU busy, and a weight sync round trip lands.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
import torch

from tests.test_config import compose_config, script_overrides
from verl.trainer.config_schema import validate_config
from verl.workers.rollout.engine_stream import ENGINE_STREAMS, EngineStream
from verl.workers.rollout.vllm_drivers import InprocDriver
from verl.workers.rollout.weight_sync import BEGIN_UPDATE_RPC, FINISH_UPDATE_RPC, LOAD_WEIGHTS_RPC


def test_on_cpu_the_stream_is_inert_in_every_mode():
    for mode in ENGINE_STREAMS:
        stream = EngineStream(mode, device=None)
        assert not stream.active and stream.stream is None
        stream.enter()
        assert stream.mark() is None
        stream.wait(None)
        stream.hold([torch.zeros(2)])
        stream.finish()


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.engine_stream must be one of"):
        EngineStream("fast", device=None)


def test_valid_settings_pass_validation(tmp_path):
    """The launch script's config with the stream of its own and a 0.5 ms switch interval validates (the bad
    values are in tests/test_config.py::BAD_OVERRIDES)."""
    validate_config(
        compose_config(
            script_overrides("run_memory_7B.sh", tmp_path)
            + [
                "actor_rollout_ref.rollout.engine_stream=high_priority",
                "actor_rollout_ref.rollout.gil_switch_interval_ms=0.5",
            ]
        )
    )


class RecordingStream:
    """Stands in for EngineStream: records what the driver asks of it, in order."""

    def __init__(self):
        self.log: list = []
        self._marks = 0

    def mark(self):
        self._marks += 1
        self.log.append(("mark", self._marks))
        return self._marks

    def wait(self, event):
        self.log.append(("wait", event))

    def hold(self, tensors):
        self.log.append(("hold", [tuple(t.shape) for t in tensors]))

    def finish(self):
        self.log.append(("finish",))

    def check(self):
        self.log.append(("check",))


class FakeWorker:
    def __init__(self, log):
        self.log = log

    def __getattr__(self, name):
        if name in (BEGIN_UPDATE_RPC, FINISH_UPDATE_RPC):
            return lambda: self.log.append((name,))
        if name == LOAD_WEIGHTS_RPC:
            return lambda bucket: self.log.append(("load", [n for n, _ in bucket]))
        raise AttributeError(name)


class FakeEngine:
    def __init__(self, log):
        self.log = log

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


def _driver_with_engine_thread():
    """An InprocDriver without vLLM: its command queue served by a thread that runs the calls as ``_loop`` does."""
    driver = object.__new__(InprocDriver)
    driver._stream = RecordingStream()
    driver._commands = queue.Queue()
    driver._closed = False
    driver.engine = FakeEngine(driver._stream.log)
    worker = FakeWorker(driver._stream.log)
    driver.local_worker = lambda: worker

    def serve():
        while True:
            cmd = driver._commands.get()
            if cmd[0] == "stop":
                return
            assert cmd[0] == "call"
            driver._run_call(*cmd[1:])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return driver, thread


def test_a_call_waits_for_its_callers_mark_and_finishes_before_answering():
    driver, thread = _driver_with_engine_thread()
    log = driver._stream.log
    try:
        assert driver.run_when_idle(lambda: log.append(("call",)) or 7) == 7
        assert log == [("mark", 1), ("check",), ("finish",), ("wait", 1), ("call",), ("finish",)]
        with pytest.raises(RuntimeError, match="boom"):
            driver.run_when_idle(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
        assert log[-4:] == [("mark", 2), ("check",), ("finish",), ("wait", 2)]  # a failed call answers with its error
    finally:
        driver._commands.put(("stop",))
        thread.join(5)


def test_each_weight_bucket_is_waited_for_and_held_before_it_is_loaded():
    driver, thread = _driver_with_engine_thread()
    log = driver._stream.log
    buckets = [[("a", torch.zeros(2, 3))], [("b", torch.zeros(4)), ("c", torch.zeros(1))]]
    try:
        assert driver.load_weights(iter(buckets)) == 3
    finally:
        driver._commands.put(("stop",))
        thread.join(5)
    marks = [entry for entry in log if entry[0] == "mark"]
    assert len(marks) == 3  # the call and one per bucket, all made in the calling thread
    engine_side = [entry for entry in log if entry[0] != "mark"]
    call_mark, first, second = (m[1] for m in marks)
    assert engine_side == [
        ("check",),
        ("finish",),
        ("wait", call_mark),
        (BEGIN_UPDATE_RPC,),
        ("wait", first),
        ("hold", [(2, 3)]),
        ("load", ["a"]),
        ("wait", second),
        ("hold", [(4,), (1,)]),
        ("load", ["b", "c"]),
        (FINISH_UPDATE_RPC,),
        ("reset_prefix_cache",),
        ("finish",),
    ]


def test_every_engine_step_first_checks_the_threads_stream():
    """``_step`` checks that the engine thread is on its stream before stepping the engine."""
    log: list = []
    driver = object.__new__(InprocDriver)
    driver._stream = RecordingStream()
    driver._stream.log = log
    driver._inflight = {}
    driver.steps, driver.step_seconds = 0, 0.0

    class StepEngine:
        def step(self):
            log.append(("step",))
            return []

    driver.engine = StepEngine()
    driver._step()
    driver._step()
    assert log == [("check",), ("step",), ("check",), ("step",)]
    assert driver.steps == 2 and driver.step_seconds > 0  # step_counters: every step counted


def test_the_engine_is_built_on_the_engine_stream(monkeypatch):
    """vLLM keeps the stream current while it builds and warms up as its main stream: the driver builds the engine
    inside ``EngineStream.building()``."""
    import vllm.engine.arg_utils as arg_utils
    import vllm.v1.engine.llm_engine as llm_engine

    log: list = []

    class BuildingStream(RecordingStream):
        def __init__(self, mode, device):
            super().__init__()
            self.log = log
            self.inside = False

        def building(self):
            stream = self

            class Inside:
                def __enter__(self):
                    stream.inside = True

                def __exit__(self, *exc):
                    stream.inside = False

            return Inside()

    class FakeEngine:
        model_config = SimpleNamespace(max_model_len=64)

        @classmethod
        def from_engine_args(cls, args):
            log.append(("build", driver_stream[0].inside))
            return cls()

        def has_unfinished_requests(self):
            return False

    driver_stream: list = []

    def make_stream(mode, device):
        driver_stream.append(BuildingStream(mode, device))
        return driver_stream[0]

    monkeypatch.setattr(llm_engine, "LLMEngine", FakeEngine)
    monkeypatch.setattr(arg_utils, "EngineArgs", lambda **kwargs: kwargs)  # no model folder to resolve
    monkeypatch.setattr("verl.workers.rollout.vllm_drivers.EngineStream", make_stream)
    driver = InprocDriver({"model": "unused"}, "high_priority")
    try:
        assert log == [("build", True)] and not driver_stream[0].inside
    finally:
        driver._commands.put(("stop",))
        driver._thread.join(5)


class FakeCudaStream:
    def __init__(self, name, priority=0):
        self.name, self.priority, self.waited_for = name, priority, []

    def wait_stream(self, other):
        self.waited_for.append(other.name)


def test_check_counts_a_move_off_the_stream_warns_once_and_leaves_the_thread_there(monkeypatch, caplog):
    """check(): on its own stream nothing happens; elsewhere the move is counted and warned about once, and the
    thread stays on the stream vLLM chose (vLLM orders its copies after that stream)."""
    own, other = FakeCudaStream("own", -1), FakeCudaStream("other", 0)
    current = {"stream": own}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: pytest.fail("check() must not switch streams"))
    stream = EngineStream("shared", device=None)
    stream.device, stream.stream = 0, own
    stream.check()
    assert stream.switches == 0
    current["stream"] = other
    with caplog.at_level("WARNING", logger="verl.workers.rollout.engine_stream"):
        stream.check()
        stream.check()
    assert current["stream"] is other and own.waited_for == [] and stream.switches == 2
    assert [r.getMessage() for r in caplog.records].count(
        "vLLM moved its engine thread off the rollout.engine_stream stream (to a stream of priority 0): "
        "its kernels run at that priority from here on"
    ) == 1


def test_building_makes_the_engine_stream_current_and_nothing_without_one(monkeypatch):
    entered: list = []

    class Ctx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            entered.append(self.stream)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    for mode in ENGINE_STREAMS:
        with EngineStream(mode, device=None).building():
            pass
    assert entered == []
    own = EngineStream("shared", device=None)
    own.device, own.stream = 0, FakeCudaStream("own", -1)
    with own.building():
        pass
    assert entered == [own.stream]


def test_check_is_a_no_op_without_a_stream_of_its_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pytest.fail("no stream to check"))
    for mode in ENGINE_STREAMS:
        EngineStream(mode, device=None).check()
    shared = EngineStream("shared", device=None)
    shared.device = 0  # "shared" on CUDA: the thread stays on whatever stream vLLM gives it
    shared.check()


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_engine_on_its_own_stream_generates_like_hf_beside_busy_training(varied_path):
    """vLLM on CUDA with engine_stream=high_priority: greedy tokens equal HF's (float32), also while another thread
    runs matmuls on its own stream; after loading perturbed weights and then the original ones back, the tokens
    are the original ones again (the loads landed in order on the engine's stream)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoModelForCausalLM

    from verl.workers.rollout import SamplingParams
    from verl.workers.rollout.vllm_engine import VLLMRolloutEngine

    prompts = [[5, 6, 7], [100, 200, 300, 400, 500, 12], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 78]]
    params = SamplingParams(greedy=True, max_tokens=16)
    model = AutoModelForCausalLM.from_pretrained(varied_path, dtype=torch.float32).cuda().eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
        expected.append(out[0, len(prompt) :].tolist())
    engine = VLLMRolloutEngine(
        varied_path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.2, engine_stream="high_priority"
    )
    stop = threading.Event()

    def busy() -> None:
        a = torch.randn(4096, 4096, device="cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            while not stop.is_set():
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()

    try:
        assert engine._driver._stream.active
        assert [o[0].token_ids for o in engine.generate_batch(prompts, params)] == expected
        worker = threading.Thread(target=busy)
        worker.start()
        try:
            assert [o[0].token_ids for o in engine.generate_batch(prompts, params)] == expected
            state = {k: v.detach() for k, v in model.state_dict().items()}
            engine.update_weights((k, v * 1.5 if v.dim() == 2 else v) for k, v in state.items())
            perturbed = [o[0].token_ids for o in engine.generate_batch(prompts, params)]
            engine.update_weights(state.items())
            assert [o[0].token_ids for o in engine.generate_batch(prompts, params)] == expected
        finally:
            stop.set()
            worker.join()
        assert perturbed != expected
        # the engine thread still issues on the stream it was given: vLLM, built on it, made it its main stream
        # (built on another stream, vLLM 0.26 moved the thread back there after every step)
        own = engine._driver._stream.stream
        assert engine._driver.run_when_idle(lambda: torch.cuda.current_stream() == own)
        assert engine._driver._stream.switches == 0
        assert own.priority < torch.cuda.Stream().priority
    finally:
        engine.shutdown()
