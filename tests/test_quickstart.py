"""quickstart.py: endpoint configuration (plain/Azure, keys) and clear errors, against a scripted loopback server."""

from __future__ import annotations

import asyncio
import socket

import pytest

import quickstart
from taskutils.memory_eval.client import EndpointError, chat_completion, endpoint_from_env, make_client
from taskutils.memory_eval.testing import ScriptedOpenAIServer, question_of_prompt


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("URL", "API_KEY", "AZURE_API_VERSION"):
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_forms(monkeypatch):
    local = endpoint_from_env()
    assert local.base_url == "http://127.0.0.1:8000/v1" and local.api_key is None and not local.is_azure
    assert endpoint_from_env("http://localhost:8011").base_url == "http://localhost:8011/v1"
    monkeypatch.setenv("URL", "https://api.example.com/v1/")
    monkeypatch.setenv("API_KEY", "sk-1")
    plain = endpoint_from_env()
    assert (plain.base_url, plain.api_key, plain.is_azure) == ("https://api.example.com/v1", "sk-1", False)
    monkeypatch.setenv("URL", "https://res.openai.azure.com/openai/deployments/gpt-4o-2024-11-20")
    azure = endpoint_from_env()
    assert azure.is_azure and azure.base_url.endswith("/openai/deployments/gpt-4o-2024-11-20")
    monkeypatch.delenv("API_KEY")
    with pytest.raises(EndpointError, match="API_KEY is not set"):
        endpoint_from_env()


def test_azure_deployment_request_uses_api_key_header_and_version(monkeypatch):
    monkeypatch.setenv("AZURE_API_VERSION", "2024-06-01")
    with ScriptedOpenAIServer(models=["gpt-4o"], api_key="secret") as srv:
        cfg = endpoint_from_env(f"http://127.0.0.1:{srv.port}/openai/deployments/gpt-4o", "secret")

        async def go():
            client = make_client(cfg)
            try:
                return await chat_completion(client, "gpt-4o", [{"role": "user", "content": "hi"}])
            finally:
                await client.close()

        content, _ = asyncio.run(go())
    assert content == "Therefore, the answer is unknown."
    assert srv.azure_requests == [{"deployment": "gpt-4o", "api_version": "2024-06-01", "api_key_header": "secret"}]


def _reply(content: str) -> str:
    if "Updated memory:" in content:
        section = content.split("<section>\n", 1)[1]
        return "Vasse moved to Port Ellery." if "Port Ellery" in section else "Nothing relevant yet."
    assert question_of_prompt(content) == quickstart.EXAMPLE_QUESTION
    return "The keeper moved to \\boxed{Port Ellery}."


def test_quickstart_builtin_example_prints_chunks_memory_and_answer(monkeypatch, capsys):
    with ScriptedOpenAIServer(models=["mem"], reply=_reply, faults=["429"]) as srv:
        monkeypatch.setenv("URL", srv.base_url)
        assert quickstart.main(["--model", "mem", "--max-attempts", "3"]) == 0
        n_requests = len(srv.outcomes())
    out = capsys.readouterr().out
    n_chunks = out.count("[chunk ")
    assert n_chunks >= 3 and f"[chunk {n_chunks}/{n_chunks}]" in out  # 256-token chunks of the example
    assert "memory is now:" in out and "Nothing relevant yet." in out and "Vasse moved to Port Ellery." in out
    assert "answer: Port Ellery" in out
    assert n_requests == n_chunks + 1 + 1  # memory turns + final + the retried 429


def test_quickstart_context_file(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("The code word is {tangerine}. " * 50)
    with ScriptedOpenAIServer(
        models=["mem"], reply=lambda c: "Therefore, the answer is tangerine. \\boxed{tangerine}"
    ) as srv:
        monkeypatch.setenv("URL", srv.base_url)
        rc = quickstart.main(["--model", "mem", "--context-file", str(doc), "--question", "Code word?",
                              "--chunk-size", "100", "--final-style", "answer_is"])  # fmt: skip
        prompts = [content for _, content in srv.log]
    assert rc == 0
    out = capsys.readouterr().out
    assert "[chunk 4/4]" in out and "answer: tangerine. \\boxed{tangerine}" in out
    # 100 tokens ~ 400 characters, cut back to the last space: 13 whole 30-character sentences + "The code "
    assert (
        prompts[0].count("{tangerine}") == 13
        and "<section>\n" + "The code word is {tangerine}. " * 13 + "The code \n</section>" in prompts[0]
    )
    assert 'format your response as follows "Therefore, the answer is' in prompts[-1]
    assert quickstart.main(["--model", "mem", "--context-file", str(doc)]) == 2
    assert "--question is required" in capsys.readouterr().err


def test_quickstart_unreachable_endpoint(monkeypatch, capsys):
    monkeypatch.setenv("URL", f"http://127.0.0.1:{_free_port()}/v1")
    assert quickstart.main(["--model", "mem"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the endpoint" in err and "is the server running" in err


def test_quickstart_wrong_model_name(monkeypatch, capsys):
    with ScriptedOpenAIServer(models=["tiny", "other"]) as srv:
        monkeypatch.setenv("URL", srv.base_url)
        assert quickstart.main(["--model", "tinyy"]) == 2
        assert srv.outcomes() == []  # caught before any chat request
    err = capsys.readouterr().err
    assert "model 'tinyy' is not served" in err and "available: tiny, other" in err


def test_quickstart_missing_and_rejected_key(monkeypatch, capsys):
    monkeypatch.setenv("URL", "https://api.example.invalid/v1")
    assert quickstart.main(["--model", "gpt-4o"]) == 2
    assert "API_KEY is not set" in capsys.readouterr().err
    with ScriptedOpenAIServer(models=["m"], api_key="right") as srv:
        monkeypatch.setenv("URL", srv.base_url)
        monkeypatch.setenv("API_KEY", "wrong")
        assert quickstart.main(["--model", "m"]) == 2
    assert "rejected the API key (HTTP 401)" in capsys.readouterr().err
