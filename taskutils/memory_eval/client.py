"""OpenAI-compatible endpoints: client construction, retries with backoff, clear error messages.

Every request of the harness and of ``quickstart.py`` goes through :func:`chat_completion`, which
uses the official ``openai`` client (``AsyncOpenAI``, or ``AsyncAzureOpenAI`` for Azure deployment
URLs) with its own retries switched off, so the retry policy here is the only one:

* retried, with exponential backoff and jitter: HTTP 429 (honouring ``Retry-After``), HTTP 5xx,
  timeouts (a stalled server), dropped/refused connections;
* not retried: other HTTP 4xx (bad request, unknown model, bad key), which are configuration errors.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import openai

__all__ = [
    "DEFAULT_LOCAL_URL",
    "EndpointConfig",
    "EndpointError",
    "RequestFailed",
    "RetryPolicy",
    "RequestStats",
    "chat_completion",
    "check_endpoint",
    "describe_error",
    "endpoint_from_env",
    "is_retryable",
    "make_client",
]

DEFAULT_LOCAL_URL = "http://127.0.0.1:8000/v1"
DEFAULT_AZURE_API_VERSION = "2024-10-21"
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"}


class EndpointError(RuntimeError):
    """The endpoint cannot be used as configured (unreachable, wrong model, missing/bad key)."""


class RequestFailed(RuntimeError):
    """A request failed for good (non-retryable error, or retries exhausted)."""


@dataclass
class EndpointConfig:
    """Where to send requests.

    ``base_url`` is the OpenAI-style base (ending in ``/v1`` for vLLM) or an Azure deployment URL
    ``https://{endpoint}/openai/deployments/{deployment}`` (detected, sent with the ``api-key``
    header and ``api-version`` query parameter).
    """

    base_url: str = DEFAULT_LOCAL_URL
    api_key: str | None = None
    azure_api_version: str = DEFAULT_AZURE_API_VERSION

    @property
    def is_azure(self) -> bool:
        return "/openai/deployments/" in self.base_url

    @property
    def is_local(self) -> bool:
        return (urlparse(self.base_url).hostname or "") in _LOCAL_HOSTS


def normalize_base_url(url: str) -> str:
    """Strip a trailing slash; add ``/v1`` when the URL has no path at all (``http://host:8000``)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if urlparse(url).path in ("", "/"):
        url += "/v1"
    return url


def endpoint_from_env(
    url: str | None = None, api_key: str | None = None, require_key_for_remote: bool = True
) -> EndpointConfig:
    """Endpoint from arguments or the ``URL`` / ``API_KEY`` (and ``AZURE_API_VERSION``) environment.

    Without a URL the local vLLM default ``http://127.0.0.1:8000/v1`` is used. A local endpoint needs
    no key (vLLM's default); a remote one does.

    Raises:
        EndpointError: if the endpoint is remote and no key is set.
    """
    raw = url or os.environ.get("URL") or DEFAULT_LOCAL_URL
    key = api_key or os.environ.get("API_KEY") or None
    cfg = EndpointConfig(
        base_url=normalize_base_url(raw),
        api_key=key,
        azure_api_version=os.environ.get("AZURE_API_VERSION", DEFAULT_AZURE_API_VERSION),
    )
    if key is None and require_key_for_remote and not cfg.is_local:
        raise EndpointError(
            f"API_KEY is not set for the remote endpoint {cfg.base_url}; export API_KEY=<your key> "
            "(a local vLLM server on 127.0.0.1 needs none)"
        )
    return cfg


def make_client(cfg: EndpointConfig, timeout: float = 600.0) -> openai.AsyncOpenAI:
    """An ``openai`` async client for ``cfg`` with the library's own retries disabled."""
    key = cfg.api_key or "EMPTY"
    if cfg.is_azure:
        return openai.AsyncAzureOpenAI(
            base_url=cfg.base_url, api_key=key, api_version=cfg.azure_api_version, timeout=timeout, max_retries=0
        )
    return openai.AsyncOpenAI(base_url=cfg.base_url, api_key=key, timeout=timeout, max_retries=0)


@dataclass
class RetryPolicy:
    """Retry schedule: attempt k (0-based) waits ``min(max_delay, base_delay * 2**k)`` times jitter."""

    max_attempts: int = 6
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: float = 0.25

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        wait = min(self.max_delay, self.base_delay * (2**attempt))
        wait *= 1.0 + self.jitter * random.random()
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_delay))
        return wait


@dataclass
class RequestStats:
    """Counters shared by the requests of one item (or one run)."""

    requests: int = 0
    retries: int = 0
    errors: list[str] = field(default_factory=list)


def is_retryable(exc: BaseException) -> bool:
    """429, 5xx, timeouts and connection errors are transient; everything else is not."""
    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500
    return False


def describe_error(exc: BaseException) -> str:
    """Short one-line description: class, HTTP status and message."""
    if isinstance(exc, openai.APIStatusError):
        return f"{type(exc).__name__}: HTTP {exc.status_code}: {str(exc.message)[:300]}"
    if isinstance(exc, openai.APITimeoutError):
        return "APITimeoutError: request timed out"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _retry_after_seconds(exc: BaseException) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    try:
        return float(headers.get("retry-after"))
    except (TypeError, ValueError):
        return None


async def create_with_retries(
    client: openai.AsyncOpenAI,
    policy: RetryPolicy | None = None,
    stats: RequestStats | None = None,
    **request: Any,
) -> Any:
    """``client.chat.completions.create(**request)`` retried on 429/5xx/timeouts with backoff.

    Raises:
        RequestFailed: for a non-retryable error or when ``policy.max_attempts`` are used up; the
            message says which and carries the last error.
    """
    policy = policy or RetryPolicy()
    stats = stats if stats is not None else RequestStats()
    last: BaseException | None = None
    for attempt in range(policy.max_attempts):
        stats.requests += 1
        try:
            return await client.chat.completions.create(**request)
        except Exception as exc:  # noqa: BLE001 - classified below
            last = exc
            stats.errors.append(describe_error(exc))
            if not is_retryable(exc):
                raise RequestFailed(f"non-retryable error: {describe_error(exc)}") from exc
            if attempt + 1 < policy.max_attempts:
                stats.retries += 1
                await asyncio.sleep(policy.delay(attempt, _retry_after_seconds(exc)))
    assert last is not None
    raise RequestFailed(f"gave up after {policy.max_attempts} attempts: {describe_error(last)}") from last


async def chat_completion(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[dict[str, str]],
    policy: RetryPolicy | None = None,
    stats: RequestStats | None = None,
    **sampling: Any,
) -> tuple[str, str | None]:
    """One chat completion with retries; returns ``(content, finish_reason)`` (content "" if None)."""
    response = await create_with_retries(client, policy, stats, model=model, messages=messages, **sampling)
    if not response.choices:
        raise RequestFailed("the server returned no choices")
    choice = response.choices[0]
    return choice.message.content or "", choice.finish_reason


async def check_endpoint(client: openai.AsyncOpenAI, cfg: EndpointConfig, model: str) -> list[str]:
    """Fail early with a clear message if the endpoint is unreachable, rejects the key, or lacks ``model``.

    Returns the served model names (empty when the service does not list models, e.g. Azure).

    Raises:
        EndpointError: unreachable endpoint, rejected key, or a model name the server does not serve.
    """
    if cfg.is_azure:
        return []
    try:
        page = await client.models.list()
    except openai.APIConnectionError as exc:
        raise EndpointError(
            f"cannot reach the endpoint {cfg.base_url} ({describe_error(exc)}); is the server running? "
            "Start one with `python -m serve --model /path/to/model` or set URL"
        ) from exc
    except openai.AuthenticationError as exc:
        raise EndpointError(f"the endpoint {cfg.base_url} rejected the API key (HTTP 401); check API_KEY") from exc
    except openai.PermissionDeniedError as exc:
        raise EndpointError(f"the endpoint {cfg.base_url} refused access (HTTP 403); check API_KEY") from exc
    except openai.APIStatusError:
        return []  # the service has no model listing; the first request will tell
    names = [m.id for m in page.data]
    if names and model not in names:
        raise EndpointError(f"model {model!r} is not served by {cfg.base_url}; available: {', '.join(names)}")
    return names
