"""/dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by playwright
with no browser download of its own) loads the page from a real server on the default model
while streaming chat requests run, and the test reads what a person would see: the map of
the block pool, its numbers, that they move with the requests and settle after them, and a
console free of errors.

Skips when no Chromium is installed (`apt-get install chromium`; PYLLAMA_CHROMIUM names
another binary). With PYLLAMA_SCREENSHOT_DIR set, the screenshot taken while the requests
run is copied there as dashboard.png (bench/results/dashboard/ keeps one)."""

import json
import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from pyllama_paged.server.app import create_app
from pyllama_paged.server.generation import Limits
from pyllama_paged.server.registry import DEFAULT_MODEL_NAME
from pyllama_paged.testing.serving import Running, default_model_server, tiny_registry

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install '.[test]'")

# A shared system prompt longer than a block: requests that start after the first one find
# its blocks in the prefix cache, so the map shows shared blocks too.
SYSTEM = ("You are a storyteller for children. Tell calm, kind stories about animals who live in a forest "
          "beside a river, with a gentle ending, in simple words, and never anything frightening.")
STREAMS = 4
MAX_TOKENS = 96
# what the page shows, read inside it: the numbers of the summary line, the cells of the map
# by state, and the engine's figures below them
READ_PAGE = """() => {
  const cells = {};
  for (const c of document.querySelectorAll("#grid .b")) { const s = c.classList[1]; cells[s] = (cells[s] || 0) + 1; }
  let stats = null;
  try { stats = JSON.parse(document.getElementById("stats").textContent); } catch (e) {}
  return {summary: document.getElementById("summary").textContent, cells: cells, stats: stats,
          model: document.getElementById("model").textContent};
}"""


def chromium_binary() -> str | None:
    """The Chromium to drive: $PYLLAMA_CHROMIUM, else the first of Debian's names on PATH."""
    named = os.environ.get("PYLLAMA_CHROMIUM")
    if named:
        return named if os.path.exists(named) else None
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def summary_numbers(text: str) -> dict[str, int]:
    """'used: 3   shared: 0 ...' -> {'used': 3, 'shared': 0, ...}."""
    return {k: int(v) for k, v in re.findall(r"(\w+): (\d+)", text)}


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, the system's binary, for the module."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium to drive (apt-get install chromium, or set PYLLAMA_CHROMIUM): "
                    "the dashboard's browser test did not run")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=binary)
        yield b
        b.close()


class Watched:
    """A page in its own context, with every console error, page error and failed load kept."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1000, "height": 640})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(f"failed load: {r.url} {r.failure}"))

    def read(self) -> dict:
        """What the page shows now (READ_PAGE)."""
        return self.page.evaluate(READ_PAGE)

    def wait_for(self, condition: str, timeout_s: float = 120):
        """Wait until the JavaScript condition holds in the page."""
        # a deadline for a hang, not a timing assumption
        self.page.wait_for_function(condition, timeout=timeout_s * 1000)

    def close(self):
        """Close the page and its context."""
        self.context.close()


@pytest.fixture(scope="module")
def server():
    """The default model on a loopback port, with a small pool."""
    # a small pool (2,048 tokens: 768 cells of 16 tokens over Gemma 3's 6 layer groups) keeps the map on one screen
    with default_model_server(Limits(max_tokens=MAX_TOKENS), n_ctx=512, n_threads=2, n_batch=128, block_size=16,
                              kv_budget_tokens=2048, max_num_seqs=8) as s:
        yield s


def stream_chat(url: str, i: int, out: list):
    """One streaming chat completion to its end; its content chunk count goes to out[i]."""
    body = {"model": DEFAULT_MODEL_NAME, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Tell story number {i} about a fox."}]}
    chunks = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                chunks += 1
    out[i] = chunks


def test_dashboard_shows_the_pool_move_with_requests(browser, server, tmp_path):
    pool = httpx.get(server.url + "/api/pool").json()
    total = pool["stats"]["blocks_total"]
    w = Watched(browser)
    try:
        w.page.goto(server.url + "/dashboard")
        w.wait_for(f"document.querySelectorAll('#grid .b').length === {total}")
        idle = w.read()
        assert idle["model"].startswith(DEFAULT_MODEL_NAME) and "paged, 16 tokens/block" in idle["model"]
        assert summary_numbers(idle["summary"]) == {"used": 0, "shared": 0, "cached": 0, "free": total}
        assert idle["cells"] == {"free": total} and idle["stats"]["blocks_total"] == total
        # laid out as meant: every cell a visible square, the legend shown, no sideways scrolling
        boxes = w.page.eval_on_selector_all("#grid .b", "cs => cs.map(c => [c.offsetWidth, c.offsetHeight])")
        assert set(map(tuple, boxes)) == {(12, 12)}
        assert w.page.is_visible(".legend") and w.page.locator(".legend span").all_inner_texts() == [
            "free", "used", "shared", "cached (evictable)"]
        assert w.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

        done = [None] * STREAMS
        first = threading.Thread(target=stream_chat, args=(server.url, 0, done))
        first.start()
        # the first request is on the map (or, on a fast machine, already done) before the others
        # start: they then share its prefix
        w.wait_for("document.querySelectorAll('#grid .b.used').length > 0"
                   " || /\"generated_tokens\": [1-9]/.test(document.getElementById('stats').textContent)")
        rest = [threading.Thread(target=stream_chat, args=(server.url, i, done)) for i in range(1, STREAMS)]
        for t in rest:
            t.start()
        # while they run: the map and the numbers agree, and the numbers move
        seen, shot = [], tmp_path / "dashboard.png"
        generated = lambda: {s["stats"]["generated_tokens"] for s in seen if s["stats"]}  # noqa: E731
        while any(t.is_alive() for t in [first, *rest]) and len(generated()) < 4:
            seen.append(w.read())
            if len(generated()) == 2 and not shot.exists():
                w.page.screenshot(path=shot)   # mid-run: blocks in use on the map
            w.page.wait_for_timeout(600)   # about one poll of the page
        assert len(generated()) >= 2, f"the page's numbers did not change while requests ran: {seen}"
        busy = max(seen, key=lambda s: s["stats"]["blocks_used"] if s["stats"] else -1)
        assert busy["stats"]["blocks_used"] > 0
        for s in seen:
            shown = summary_numbers(s["summary"])
            assert sum(shown.values()) == total
            assert {k: v for k, v in s["cells"].items() if v} == {k: v for k, v in shown.items() if v}, s
        for t in [first, *rest]:
            t.join(600)
        assert all(n and n > 0 for n in done), done
        # after them: nothing in use, the prompts' blocks kept as cache, and the map says so
        w.wait_for("/used: 0 /.test(document.getElementById('summary').textContent)")
        w.page.wait_for_timeout(600)   # one more poll: the map and the figures of the same answer
        after = w.read()
        shown = summary_numbers(after["summary"])
        assert shown["used"] == shown["shared"] == 0 and shown["cached"] > 0
        assert after["cells"] == {k: v for k, v in shown.items() if v}
        assert after["stats"]["generated_tokens"] >= STREAMS * MAX_TOKENS
        assert w.problems == []
    finally:
        w.close()
    wanted = os.environ.get("PYLLAMA_SCREENSHOT_DIR")
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(wanted) / "dashboard.png")


def test_dashboard_with_an_api_key(browser, tmp_path):
    # The key in the address opens the page; its polls carry it in a header, the address bar
    # drops it, and a key the server refuses is said in words, not as a script error.
    registry = tiny_registry(tmp_path)
    s = Running(create_app(registry, Limits(), api_key="sekrit"))
    w = Watched(browser)
    try:
        w.page.goto(s.url + "/dashboard?key=sekrit")
        w.wait_for("/free: \\d+/.test(document.getElementById('summary').textContent)")
        assert w.read()["cells"].get("free", 0) > 0 and w.page.url == s.url + "/dashboard"
        assert w.problems == []
        w.page.goto(s.url + "/dashboard?key=sekrit#key=stale")
        w.wait_for("document.getElementById('summary').textContent.startsWith('error')")
        assert w.read()["summary"] == "error: HTTP 401: invalid or missing API key"
        # the refused polls (one every half second) are the only errors the browser reports
        assert w.problems and all("status of 401" in p for p in w.problems), w.problems
    finally:
        w.close()
        s.close()
        registry.close()
