"""A pulled model's chat template is code from whoever published the model: one that loops
for hours must not hold the server's shared preparation threads (issue 39)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.server.app import create_app
from pyllama_paged.server.config import Limits, ServeConfig, TemplateLimits
from pyllama_paged.server.registry import ModelRegistry
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import Running
from pyllama_paged.tokenizer import render_pool
from pyllama_paged.tokenizer.chat_template import ChatTemplate

# ten billion iterations of a loop that calls nothing: no sandbox hook ever runs in it
LOOPING = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture
def render_seconds():
    """Sets the renderers' time budget for one test (the process's limits come back after)."""
    before = render_pool.limits()
    yield lambda seconds: render_pool.configure(render_pool.render_limits(seconds=seconds))
    render_pool.configure(before)


def test_a_looping_template_is_stopped_with_a_clear_error(render_seconds):
    render_seconds(0.5)
    template = ChatTemplate(LOOPING)
    with pytest.raises(PagedError, match="did not finish rendering within 0.5 s"):
        template.render([{"role": "user", "content": "hi"}])
    # the thread that rendered it is fine afterwards, and a quick template still renders
    assert ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("source", ["{{ 'x' * 1000000000 }}", "{{ ['x'] * 1000000000 }}", "{{ 10 ** 100000000 }}"])
def test_one_huge_operation_is_refused(source):
    with pytest.raises(PagedError, match="chat template failed to render"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_ordinary_products_still_work():
    text = ChatTemplate("{{ '=' * 3 }}{{ 2 ** 10 }}{{ [1] * 2 }}").render([{"role": "user", "content": "x"}])
    assert text == "===1024[1, 1]"


def test_looping_chats_do_not_hold_up_a_healthy_model(tmp_path):

    def with_template(writer, rng):
        writer.add_string("tokenizer.chat_template", LOOPING)

    loopy = write_tiny_model(tmp_path / "loopy.gguf", "gemma3", extend=with_template)
    healthy = write_tiny_model(tmp_path / "healthy.gguf", "gemma3")
    registry = ModelRegistry([loopy, healthy], ServeConfig.flat(n_ctx=256, n_threads=1, kv_budget_tokens=1024,
                                                                max_num_seqs=4))
    before = render_pool.limits()
    server = Running(create_app(registry, Limits(templates=TemplateLimits(seconds=1.0))))
    try:
        def chat(model: str) -> httpx.Response:
            return httpx.post(f"{server.url}/api/chat", timeout=120, json={
                "model": model, "stream": False, "options": {"num_predict": 2},
                "messages": [{"role": "user", "content": "hello"}]})

        with ThreadPoolExecutor(5) as pool:
            # as many looping chats as there are preparation threads (Limits.prep_threads: 4)
            hostile = [pool.submit(chat, "loopy") for _ in range(4)]
            answer = pool.submit(chat, "healthy").result()
            assert answer.status_code == 200, answer.text
            for future in hostile:
                refused = future.result()
                assert refused.status_code == 400
                assert "did not finish rendering" in refused.json()["error"]
        assert chat("healthy").status_code == 200
    finally:
        server.close()
        registry.close()
        render_pool.configure(before)
