"""A module's served models (`registry`) and running server (`server`), from its SERVE
(ServeConfig.flat settings), TINY (a tiny random-weight model instead of the embedded default),
LIMITS and APP (create_app's other arguments), for the modules that do not define their own;
and clients of the `server`."""

import ollama
import openai
import pytest

from pyllama_paged.server.app import create_app
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.testing.serving import Running, tiny_registry


@pytest.fixture(scope="module")
def registry(request, tmp_path_factory):
    settings = getattr(request.module, "SERVE", {})
    if getattr(request.module, "TINY", False):
        served = tiny_registry(tmp_path_factory.mktemp("tiny"), **settings)
    else:
        served = ModelRegistry(None, ServeConfig.flat(**settings))
    yield served
    served.close()


@pytest.fixture(scope="module")
def server(registry, request):
    running = Running(create_app(registry, getattr(request.module, "LIMITS", None), **getattr(request.module, "APP", {})))
    yield running
    running.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oll(server):
    return ollama.Client(host=server.url)
