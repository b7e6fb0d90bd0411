"""The Python API renders a GGUF's chat template as the server does (issue 54): in a renderer
process with a memory and time limit, so a hostile template costs an error, not the caller's
process. A real `Llama` on a tiny model whose template is hostile."""

import pytest

from pyllama_paged import Llama
from pyllama_paged.errors import PagedError
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.tokenizer import render_pool

# one `~` is one C call: 2**34 characters after 34 doublings, unless a limit stops it
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(34) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{% for m in messages %}{{ m.content }}{% endfor %}{{ ns.s }}")
FRIENDLY = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_create_chat_completion_renders_a_hostile_template_in_a_renderer_process(tmp_path):
    def with_template(writer, rng):
        writer.add_string("tokenizer.chat_template", DOUBLING)
    path = write_tiny_model(tmp_path / "hostile.gguf", "gemma3", extend=with_template)
    pool = render_pool.renderer()
    if not isinstance(pool, render_pool.RenderPool):
        pytest.skip("templates render in this process here (PYLLAMA_PAGED_TEMPLATE_RENDERER)")
    replaced = pool.replaced
    with Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False) as llm:
        with pytest.raises(PagedError, match="chat template ran out of memory"):
            llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
        assert pool.replaced == replaced + 1
        llm.chat_template.source = FRIENDLY   # the same model, a template that renders
        out = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
        assert out["choices"][0]["finish_reason"] in ("length", "stop")
