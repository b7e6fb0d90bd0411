"""Schemathesis fuzzing of the server's own OpenAPI schema (/openapi.json)
against a real uvicorn server on a loopback port, with the default model.

Every operation gets a bounded number of schema-valid (positive) and
schema-invalid (negative) requests, derandomized so a run repeats exactly.
Generation stays cheap: replies are capped at a few tokens and prompts at 64.
No request may get a 5xx, responses must match the documented status codes,
content types, headers and JSON schemas, and schema-invalid requests must be
refused. Afterwards the server must still generate, and every KV block must
come back to the pool.
"""

import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_headers_conformance, response_schema_conformance,
                                 status_code_conformance)

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME, ModelRegistry
from pyllama_paged.server.config import ServeConfig
from pyllama_paged.testing.serving import Running

# Per operation and mode; FUZZ_HTTP_EXAMPLES=200 for a longer local run.
MAX_EXAMPLES = int(os.environ.get("FUZZ_HTTP_EXAMPLES", "25"))
# positive_data_acceptance is left out on purpose: a schema-valid request may
# still name a model that is not loaded, token ids outside the vocabulary,
# images, or exceed the server's limits, and those are 4xx by design.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def server():
    registry = ModelRegistry(None, ServeConfig.flat(n_ctx=256, n_threads=2, n_batch=64, block_size=32,
                                                    kv_budget_tokens=4096, max_num_seqs=8))
    s = Running(create_app(registry, Limits(max_body_bytes=16 * 1024, max_tokens=4, max_n=2,
                                            max_prompt_tokens=64)))
    yield s
    s.close()
    registry.close()


def blocks_used(url: str) -> int:
    return httpx.get(f"{url}/api/pool", timeout=60).json()["stats"]["blocks_used"]


def wait_for_empty_pool(url: str, deadline_s: float = 120.0) -> int:
    """Poll until no KV block is in use (requests finish on the engine thread
    after their response is sent); returns the last count seen."""
    end = time.monotonic() + deadline_s
    used = blocks_used(url)
    while used and time.monotonic() < end:
        time.sleep(0.05)
        used = blocks_used(url)
    return used


def run_operation(op, mode, stats: Counter, failures: list) -> None:
    @given(case=op.as_strategy(generation_mode=mode), real_model=st.booleans())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def check(case, real_model):
        # A generated model name is never the loaded one; half of the valid
        # bodies name it so requests reach tokenization and generation.
        if mode == GenerationMode.POSITIVE and real_model and isinstance(case.body, dict) \
                and "model" in case.body:
            case.body["model"] = DEFAULT_MODEL_NAME
        response = case.call(timeout=120)
        stats["cases"] += 1
        stats[f"status {response.status_code // 100}xx"] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, BaseExceptionGroup) as e:  # collected, so every operation runs
            failures.append(f"{op.label} [{mode.value}] {response.status_code}: {str(e)[:600]}")

    try:
        check()
    except Unsatisfiable:  # an operation without inputs has no invalid requests
        stats["operations without negative cases"] += 1


def test_openapi_fuzz(server):
    # 413 (body over the server's limit, checked before the body is read) is a rejection too
    rejections = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5xx"]
    config = schemathesis.config.SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": rejections}}})
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)
    stats: Counter = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        stats["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_operation(op, mode, stats, failures)
    print(f"\nschemathesis: {dict(stats)}, failures: {len(failures)}")
    assert stats["operations"] >= 14 and stats["cases"] > 300
    assert stats["status 2xx"] > 50  # the fuzzing reached real work, not only refusals
    assert not failures, "\n".join(failures[:10])
    assert stats["status 5xx"] == 0

    # Afterwards: the server still generates, and every KV block comes back.
    r = httpx.post(f"{server.url}/api/generate", timeout=120, json={
        "model": DEFAULT_MODEL_NAME, "prompt": "Why is the sky blue?", "stream": False,
        "options": {"num_predict": 4, "temperature": 0}})
    assert r.status_code == 200 and r.json()["done"] and r.json()["eval_count"] == 4
    assert wait_for_empty_pool(server.url) == 0
