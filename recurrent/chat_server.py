"""OpenAI-compatible HTTP endpoint over a :class:`ChatCompletionProxy`, on loopback.

    server = ChatServer(proxy).start()          # picks a free port on 127.0.0.1
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused")
    await client.chat.completions.create(model=proxy.model_name, messages=[...], max_tokens=64)

Routes: ``POST /v1/chat/completions`` (non-streaming), ``GET /v1/models``, ``GET /health``. The
``x-request-id`` header (optionally ``chatcmpl-`` prefixed) selects a sticky session. Errors come
back in OpenAI's shape ``{"error": {"message", "type", "code"}}``: 400 for bad requests, 404 for an
unknown model, 500 for engine failures. The server runs on the proxy's own event loop (aiohttp),
so HTTP requests and in-process ``proxy.chat`` calls share one router and one set of records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

__all__ = ["ChatServer"]


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status)


class ChatServer:
    """Serve ``proxy`` over HTTP (see the module docstring).

    Args:
        proxy: the chat proxy to expose.
        host: bind address; loopback by default (the endpoint has no authentication).
        port: 0 picks a free port; the bound one is in :attr:`port` / :attr:`url` after :meth:`start`.
    """

    def __init__(self, proxy: Any, host: str = "127.0.0.1", port: int = 0):
        self.proxy = proxy
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self.created = int(time.time())

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients (``http://host:port/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> ChatServer:
        """Bind and start serving on the proxy loop; returns self."""
        self.proxy.run(self._start())
        self.proxy.server = self
        logger.info("chat server listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        try:
            self.proxy.run(asyncio.wait_for(runner.cleanup(), timeout=10))
        except RuntimeError:  # the proxy loop is already gone
            pass
        if getattr(self.proxy, "server", None) is self:
            self.proxy.server = None

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
            ]
        )
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=600)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runner = runner

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.proxy.model_name, "object": "model", "created": self.created, "owned_by": "memagent"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        messages = body.pop("messages", None)
        if messages is None:
            return _error(400, "missing required field 'messages'", "invalid_request_error")
        rid = request.headers.get("x-request-id")
        if rid and rid.startswith("chatcmpl-"):
            rid = rid[len("chatcmpl-") :]
        try:
            completion = await self.proxy.chat(messages, request_id=rid, **body)
        except LookupError as exc:
            return _error(404, str(exc), "not_found_error")
        except (ValueError, TypeError, KeyError) as exc:
            return _error(400, f"{type(exc).__name__}: {exc}", "invalid_request_error")
        except Exception as exc:  # noqa: BLE001 - engine failure: report, keep serving
            logger.exception("chat completion failed")
            return _error(500, f"{type(exc).__name__}: {exc}", "server_error")
        return web.Response(text=completion.model_dump_json(), content_type="application/json")
