"""A pulled chat template tried as an attacker would (issue 54): a number squared until one
multiplication takes seconds, a string doubled until it is gigabytes, a loop that never ends,
a prompt of many megabytes. In-process, one such C call held the GIL (every stream stalled)
and grew the server's memory without bound. Templates now render in renderer processes with
a memory limit and a wall-clock budget, killed and replaced when they overrun it; the Jinja
sandbox refuses the obvious one-step blow-ups before they run. The last test runs a real
`pyllama-paged serve` and checks its own memory and a stream of another model."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pyllama_paged.errors import PagedError
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy
from pyllama_paged.tokenizer import render_pool
from pyllama_paged.tokenizer.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE, ChatTemplate
from pyllama_paged.tokenizer.render_pool import InProcessRenderer, RenderLimits, RenderPool

MESSAGES = [{"role": "user", "content": "hi"}]
# each `~` is one C call copying the whole string: 2**34 characters after 34 doublings
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(34) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
# each `*` is one C call; the 20th squaring alone would run for minutes
SQUARING = "{% set ns = namespace(x=7) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}"
LOOPING = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")
QUICK = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


@pytest.fixture
def pool():
    p = RenderPool(RenderLimits(seconds=2.0, memory_mib=256, output_bytes=1 << 20, processes=2))
    yield p
    p.close()


def test_a_string_doubled_past_the_memory_limit_ends_its_renderer_not_the_server(pool):
    assert pool.render(QUICK, {"messages": MESSAGES}) == "<user>hi"
    [before] = pool.pids()
    with pytest.raises(PagedError, match="chat template ran out of memory.*256 MiB.*replaced"):
        pool.render(DOUBLING, {"messages": MESSAGES})
    assert not _alive(before) and pool.replaced == 1
    assert pool.render(QUICK, {"messages": MESSAGES}) == "<user>hi"
    assert before not in pool.pids()


def test_a_render_past_its_time_is_killed_and_replaced(pool):
    pool.render(QUICK, {"messages": MESSAGES})
    [before] = pool.pids()
    with pytest.raises(PagedError, match="did not finish rendering within 2 s.*stopped and replaced"):
        pool.render(LOOPING, {"messages": MESSAGES})
    assert not _alive(before) and pool.replaced == 1
    assert pool.render(QUICK, {"messages": MESSAGES}) == "<user>hi"


@pytest.mark.parametrize("source, why", [
    (SQUARING, "multiplies numbers"),
    ("{{ 10 ** 100000000 }}", "enormous power"),
    ("{{ 'x' * 1000000000 }}", "repeats a sequence"),
    ("{{ ['x'] * 1000000000 }}", "repeats a sequence"),
    ("{{ 'x'.center(2000000000) }}", "pads text"),
    ("{{ 'x'.ljust(2000000000) }}", "pads text"),
    ("{{ 'x'.zfill(2000000000) }}", "pads text"),
    ("{{ 'x\ty'.expandtabs(2000000000) }}", "expands tabs"),
    ("{{ 'x'|center(2000000000) }}", "pads text"),
    ("{{ 'a\nb'|indent(2000000000) }}", "indents text"),
    ("{{ '%2000000000d' % 1 }}", "formats to a width"),
    ("{{ '%*d' % (2000000000, 1) }}", "formats to a width"),
    ("{{ '%2000000000d'|format(1) }}", "formats to a width"),
    ("{{ '{:>2000000000}'.format(1) }}", "formats to a width"),
    ("{{ '{:>{w}}'.format(1, w=2000000000) }}", "computed width"),
    ("{{ 'ab'|replace('', 'x' * 4000000) }}", "replaces text"),
    ("{{ 'ab'.replace('', 'x' * 4000000) }}", "replaces text"),
    ("{{ messages|tojson(indent=2000000000) }}", "indents JSON"),
])
def test_one_step_blow_ups_are_refused_before_they_run(pool, source, why):
    pool.render(QUICK, {"messages": MESSAGES})
    [process] = pool.pids()
    with pytest.raises(PagedError, match=f"chat template failed to render: .*{why}"):
        pool.render(source, {"messages": MESSAGES})
    assert pool.pids() == [process] and pool.replaced == 0   # refused by the sandbox: nothing to replace


def test_a_prompt_past_the_output_cap_is_refused_and_the_renderer_kept(pool):
    pool.render(QUICK, {"messages": MESSAGES})
    [process] = pool.pids()
    big = "{% for i in range(3) %}{{ 'x' * 1000000 }}{% endfor %}"   # 3 MB, past the 1 MiB cap
    with pytest.raises(PagedError, match="rendered a prompt of 3000000 bytes, more than the 1048576"):
        pool.render(big, {"messages": MESSAGES})
    assert pool.pids() == [process] and pool.render(QUICK, {"messages": MESSAGES}) == "<user>hi"


def test_a_renderer_killed_from_outside_is_replaced(pool):
    pool.render(QUICK, {"messages": MESSAGES})
    [before] = pool.pids()
    os.kill(before, signal.SIGKILL)
    while _alive(before):
        time.sleep(0.01)
    assert pool.render(QUICK, {"messages": MESSAGES}) == "<user>hi"
    assert before not in pool.pids() and pool.replaced == 1


def test_renders_wait_for_a_free_renderer_and_never_exceed_the_pool(pool):
    def render(i: int) -> str:
        return pool.render(QUICK, {"messages": [{"role": "user", "content": str(i)}]})

    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, render(i))) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: f"<user>{i}" for i in range(12)}
    assert 1 <= len(pool.pids()) <= 2


def test_compiling_a_template_runs_nothing_in_this_process():
    # Jinja folds constant expressions when it compiles, so compiling
    # "{{ 'x'|center(2000000000) }}" in the server built a 2 GB string there at load time
    script = ("import resource; from pyllama_paged.tokenizer.chat_template import ChatTemplate; "
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
              "t = ChatTemplate(\"{{ 'x'|center(1500000000) }}{{ '%1500000000d' % 1 }}\"); "
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)")
    grown_kib = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                   check=True, cwd="/").stdout)
    assert grown_kib < 64 << 10


def test_the_pool_and_the_process_render_real_templates_alike(pool):
    from pyllama_paged.testing.scripted_gguf import HARMONY_TEMPLATE, OPEN_THINK_TEMPLATE, THINKING_TEMPLATE

    here = InProcessRenderer(RenderLimits())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris? <|im_end|>"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny \ud800"}]
    for source in (THINKING_TEMPLATE, OPEN_THINK_TEMPLATE, HARMONY_TEMPLATE, GEMMA_TEMPLATE, CHATML_TEMPLATE,
                   LLAMA3_TEMPLATE):
        for variables in ({}, {"tools": tools, "enable_thinking": False}):
            names = {"messages": chat, "add_generation_prompt": True, "bos_token": "", "eos_token": "</s>",
                     **variables}
            try:
                expected = here.render(source, names)
            except PagedError as e:   # the same refusal from both
                with pytest.raises(PagedError, match=str(e)[:40]):
                    pool.render(source, names)
                continue
            assert pool.render(source, names) == expected


def test_our_own_templates_render_here_and_pulled_ones_in_a_renderer():
    assert ChatTemplate(GEMMA_TEMPLATE).trusted and not ChatTemplate(QUICK).trusted
    assert ChatTemplate(QUICK).render(MESSAGES) == "<user>hi"
    assert isinstance(render_pool.renderer(), RenderPool) or render_pool.limits().in_process


def test_in_process_rendering_is_an_opt_in_that_keeps_the_time_budget():
    before = render_pool.limits()
    render_pool.configure(RenderLimits(seconds=0.5, in_process=True))
    try:
        assert isinstance(render_pool.renderer(), InProcessRenderer)
        assert ChatTemplate(QUICK).render(MESSAGES) == "<user>hi"
        with pytest.raises(PagedError, match="did not finish rendering within 0.5 s"):
            ChatTemplate(LOOPING).render(MESSAGES)
        with pytest.raises(PagedError, match="multiplies numbers"):
            ChatTemplate(SQUARING).render(MESSAGES)
    finally:
        render_pool.configure(before)
    assert isinstance(render_pool.renderer(), RenderPool) or before.in_process


# ---- a real server under attack ------------------------------------------------------------
MEMORY_CAP_MIB = 256   # the server's resident memory may not grow more than this during the attack


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(c) for c in (task / "children").read_text().split())
    return found


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak(pid: int) -> bool:
    """Reset the process's peak resident memory (VmHWM) to its current one; False if the kernel does not allow it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _model(tmp_path: Path, name: str, template: str | None) -> str:
    def with_template(writer, rng):
        writer.add_string("tokenizer.chat_template", template)
    return write_tiny_model(tmp_path / f"{name}.gguf", "gemma3", extend=with_template if template else None)


def _stream(url: str, model: str, arrivals: list, out: dict) -> None:
    with httpx.stream("POST", f"{url}/api/chat", timeout=120, json={
            "model": model, "messages": MESSAGES, "options": {"num_predict": 48, "temperature": 0}}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            arrivals.append(time.monotonic())
            out["last"] = line


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the server's memory and children in /proc")
def test_a_hostile_template_leaves_the_server_small_and_other_streams_running(tmp_path):
    models = [_model(tmp_path, "operator", None), _model(tmp_path, "doubling", DOUBLING),
              _model(tmp_path, "squaring", SQUARING), _model(tmp_path, "looping", LOOPING)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "pyllama_paged.cli", "serve", "--port", str(port), "--threads", "1",
               "--ctx", "256", "--kv-budget", "2048", "--template-seconds", "3", "--template-memory-mib", "256"]
    for path in models:
        command += ["--model", path]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, proc, "/api/tags", timeout=300, log=log)
        chat = {"messages": MESSAGES, "stream": False, "options": {"num_predict": 2}}
        assert httpx.post(f"{url}/api/chat", json={"model": "operator", **chat}, timeout=120).status_code == 200
        assert httpx.post(f"{url}/api/chat", json={"model": "looping", **chat, "messages": []},
                          timeout=120).status_code == 200   # loaded; its template not rendered yet
        renderers = _children(proc.pid)
        assert renderers, "the server started no renderer process"
        resident = _status_kib(proc.pid, "VmRSS")
        peak_known = _reset_peak(proc.pid)

        arrivals, streamed = [], {}
        stream = threading.Thread(target=_stream, args=(url, "operator", arrivals, streamed))
        stream.start()
        answers = {}

        def attack(model):
            answers[model] = httpx.post(f"{url}/api/chat", json={"model": model, **chat}, timeout=120)
        attackers = [threading.Thread(target=attack, args=(m,)) for m in ("doubling", "squaring", "looping")]
        for t in attackers:
            t.start()
        for t in attackers + [stream]:
            t.join(180)

        assert answers["doubling"].status_code == 400
        assert "chat template ran out of memory" in answers["doubling"].json()["error"]
        assert answers["squaring"].status_code == 400
        assert "chat template failed to render: the template multiplies numbers" in answers["squaring"].json()["error"]
        assert answers["looping"].status_code == 400
        assert "chat template did not finish rendering within 3 s" in answers["looping"].json()["error"]
        # the stream of the operator's model went on to its end meanwhile
        assert streamed["status"] == 200 and '"done":true' in streamed["last"].replace(" ", "")
        # the renderers that overran were killed (never left running) and others took their place
        after = _children(proc.pid)
        assert not any(_alive(pid) for pid in renderers - after)
        assert after - renderers, "no renderer process was started in place of the killed ones"
        grown_kib = (_status_kib(proc.pid, "VmHWM") if peak_known else _status_kib(proc.pid, "VmRSS")) - resident
        assert grown_kib < MEMORY_CAP_MIB << 10, f"the server grew by {grown_kib} KiB"
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        print(f"operator stream: {len(arrivals)} lines, largest gap {max(gaps, default=0):.3f} s, "
              f"server grew {grown_kib} KiB (peak {'measured' if peak_known else 'not resettable'})")
        assert httpx.post(f"{url}/api/chat", json={"model": "operator", **chat}, timeout=120).status_code == 200
    finally:
        stop_server(proc)
