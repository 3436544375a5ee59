"""A scripted OpenAI-compatible loopback server for fault-injection tests of the harness and quickstart.

It serves ``GET /health``, ``GET /v1/models`` and ``POST /v1/chat/completions`` on 127.0.0.1 in a
background thread (so code under test may call ``asyncio.run`` itself), and misbehaves on request:

* ``faults``: a queue of outcomes consumed one per chat request: ``"500"``, ``"429"`` (with
  ``Retry-After: 0``), ``"stall"`` (sleep ``stall_seconds`` before answering, so the client times
  out), ``"ok"``;
* ``fault_for(content)``: a per-request rule (e.g. always 500 for one question) checked first;
* unknown model -> 404, wrong key (when ``api_key`` is set) -> 401, like real servers;
* the Azure deployment route ``POST /openai/deployments/{name}/chat/completions?api-version=...``
  (the deployment name is the model; requests are logged in ``azure_requests``).

Replies come from ``reply(content) -> str`` (default: a fixed memory/answer text).
This simulates failures only; the real-server tests use vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from aiohttp import web

__all__ = ["ScriptedOpenAIServer", "question_of_prompt"]


def question_of_prompt(content: str) -> str | None:
    """The question inside a memory-agent prompt (``<problem> ... </problem>``) or a direct prompt."""
    if "<problem> \n" in content:
        return content.split("<problem> \n", 1)[1].split("\n</problem>", 1)[0]
    if "</text>\n\n" in content:
        return content.split("</text>\n\n", 1)[1].split("\n\n", 1)[0]
    return None


def _default_reply(content: str) -> str:
    if "Updated memory:" in content:
        return "The section mentions nothing new."
    return "Therefore, the answer is unknown."


class ScriptedOpenAIServer:
    """Context manager running the scripted server; ``base_url`` is ``http://127.0.0.1:PORT/v1``."""

    def __init__(
        self,
        models: Iterable[str] = ("fake-model",),
        reply: Callable[[str], str] | None = None,
        faults: Iterable[str] = (),
        fault_for: Callable[[str], str | None] | None = None,
        stall_seconds: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        self.models = list(models)
        self.reply = reply or _default_reply
        self.faults: deque[str] = deque(faults)
        self.fault_for = fault_for
        self.stall_seconds = stall_seconds
        self.api_key = api_key
        self.log: list[tuple[str, str]] = []  # (outcome, prompt content) per chat request
        self.azure_requests: list[dict] = []  # deployment, api-version and api-key header of Azure-route requests
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self.port = 0

    # -- scripting -------------------------------------------------------------------------
    def add_faults(self, faults: Iterable[str]) -> None:
        with self._lock:
            self.faults.extend(faults)

    def outcomes(self) -> list[str]:
        with self._lock:
            return [outcome for outcome, _ in self.log]

    def _next_fault(self, content: str) -> str:
        with self._lock:
            if self.fault_for is not None:
                forced = self.fault_for(content)
                if forced:
                    return forced
            return self.faults.popleft() if self.faults else "ok"

    # -- handlers --------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        return (
            request.headers.get("Authorization", "") == f"Bearer {self.api_key}"
            or request.headers.get("api-key", "") == self.api_key
        )

    @staticmethod
    def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        body = {"error": {"message": message, "type": "error", "code": status}}
        return web.json_response(body, status=status, headers=headers)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "invalid API key")
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "test"} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _chat_azure(self, request: web.Request) -> web.Response:
        """Azure deployment route: the deployment name is the model; ``api-version`` is required."""
        with self._lock:
            self.azure_requests.append(
                {"deployment": request.match_info["deployment"], "api_version": request.query.get("api-version"),
                 "api_key_header": request.headers.get("api-key")}
            )  # fmt: skip
        if not request.query.get("api-version"):
            return self._error(400, "missing api-version")
        return await self._chat(request, request.match_info["deployment"])

    async def _chat(self, request: web.Request, model: str | None = None) -> web.Response:
        if not self._authorized(request):
            return self._error(401, "invalid API key")
        body = await request.json()
        if model is not None:
            body["model"] = model
        content = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        if body.get("model") not in self.models:
            with self._lock:
                self.log.append(("404", content))
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        fault = self._next_fault(content)
        with self._lock:
            self.log.append((fault, content))
        if fault == "500":
            return self._error(500, "scripted internal error")
        if fault == "429":
            return self._error(429, "scripted rate limit", headers={"Retry-After": "0"})
        if fault == "stall":
            await asyncio.sleep(self.stall_seconds)
        text = self.reply(content)
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.log)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": len(text) // 4, "total_tokens": 0},
            }
        )

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self._chat_azure)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def start(self) -> ScriptedOpenAIServer:
        self._thread = threading.Thread(target=self._serve, name="scripted-openai", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("scripted server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ScriptedOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def dump(self) -> str:
        """The request log as JSON (for debugging a failing test)."""
        return json.dumps(self.log, indent=1)[:5000]
