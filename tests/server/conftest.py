"""Clients of a module's `server` fixture (a running server with a .url), for the modules
that do not define their own."""

import ollama
import openai
import pytest


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url)
