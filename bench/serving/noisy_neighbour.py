"""Noisy neighbour: "no request can hurt another user", measured.

Starts `pyllama-paged serve` (the embedded model unless --model; a free port unless
--port; the server's default options, --threads passed through) as a subprocess, then:

- a benign client streams /api/generate the whole time, in a process of its own
  (num_predict 200, temperature 0.7; when one answer ends it starts the next), and records
  when every streamed token chunk arrives;
- after a quiet baseline of ~10 s, a second client sends each hostile request of
  HOSTILE below, one at a time, each with a 60 s client timeout, and records its
  start/end, HTTP status (or "timeout" / the exception) and an excerpt of the answer; the
  next starts ~3 s after the benign stream has moved again.

Rows marked for another server (13: a long prompt on a server started with --draft-model)
run against a second `serve` started for them, with a benign stream and a baseline of its
own, after the rows of the plain server. Row 14 pulls from a silent host (a local TCP
listener that accepts and never answers), allowed to the server with --pull-allow (or, on a
server without that flag, as its PYLLAMA_PAGED_REGISTRY).

Per hostile request: the benign stream's inter-token gaps whose interval overlaps the
hostile request's [start, end] window (count, p50, p99, max) and the benign requests that
failed in it. The benign stream is one session: the gap from one answer's last token to the
next answer's first token counts too (a stall between two answers is a stall), so the
baseline row includes those. Pass (reported, not asserted): benign gap p99 < 1 s and the
hostile request ended (an answer or a 4xx, not a 5xx, timeout or broken connection; for the
pulls from a silent host a 502/503/504 too, the answer a dead upstream deserves, with every
/api/tags probe answered within 1 s) within 30 s.

Writes bench/results/noisy_neighbour.{json,md,png}; the server's output goes to
noisy_neighbour.server.log beside them (not committed).

    python -m bench.serving.noisy_neighbour                      # everything, several minutes
    python -m bench.serving.noisy_neighbour --only 4,9,stats_burst --out-dir /tmp/nn
    python -m bench.serving.noisy_neighbour --only draft_long_prompt,pulls_silent_host
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import queue
import random
import socket
import string
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from bench.common.options import add_options
from bench.common.peers import our_cli
from bench.common.report import RESULTS_DIR, save_figure, write_results
from pyllama_paged.engine import default_model_path
from pyllama_paged.models.refs import REGISTRY_ENV
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy

NAME = "noisy_neighbour"
HOSTILE_TIMEOUT = 60.0     # client timeout of one hostile request (per read/write, as httpx counts)
QUIET_GAP = 3.0            # seconds between two hostile requests
BASELINE_SECONDS = 10.0
WARMUP_SECONDS = 5.0       # of the benign stream before the baseline window
RECOVERY_WAIT = 180.0      # at most this long for the benign stream to move again after a hostile request
GAP_P99_LIMIT = 1.0        # pass: the benign stream's gap p99 in the window
HOSTILE_LIMIT = 30.0       # pass: the hostile request ended within this
DRAFT_PROMPT_WORDS = 3900  # row 13: ~3.9k tokens of words (about one token a word), under the 4096 context
SILENT_PULLS = 6           # row 14: pulls at once to the silent host
TAGS_PROBE_EVERY = 0.25    # row 14: seconds between two GET /api/tags while the pulls run
BENIGN_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WORDS = ("the of and to in is was for on that with as by at from his her they this which be or an had "
         "river mountain city garden window morning evening letter music table forest harbor station "
         "winter summer market bridge library teacher doctor farmer sailor painter engineer village road "
         "quickly slowly carefully quietly suddenly often never always together again almost nearly "
         "walked carried opened remembered wondered listened answered followed discovered believed "
         "bright heavy narrow ancient gentle broken golden silent distant crowded familiar").split()


# ---- the server ----------------------------------------------------------------

SERVER_KINDS = {"default": "the server's default options", "draft_model": "--draft-model"}


def serve_flags(exe: str) -> str:
    """`serve --help`'s text: which flags this build of the server takes."""
    return subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=60, check=False).stdout


def start_server(args, log: Path, kind: str = "default", silent: str | None = None,
                 port: int | None = None) -> tuple[subprocess.Popen, str, str]:
    """`pyllama-paged serve` with its default options (kind draft_model: plus --draft-model);
    pulls from silent (host:port) allowed; (process, base URL, model name)."""
    port = port or free_port()
    exe = our_cli()
    cmd = [exe, "serve", "--port", str(port)]
    env = None
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    if kind == "draft_model":
        cmd += ["--draft-model", args.draft_model or args.model or default_model_path()]
    if silent:
        if "--pull-allow" in serve_flags(exe):
            cmd += ["--pull-allow", silent]
        else:   # a server without an allow-list reaches its configured registry
            env = {**os.environ, REGISTRY_ENV: f"http://{silent}"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, "/v1/models", 300, log=log)
        return proc, url, httpx.get(url + "/v1/models", timeout=2).json()["data"][0]["id"]
    except BaseException:
        stop_server(proc)
        raise


# ---- the benign user -------------------------------------------------------------

def benign_stream(url: str, model: str, stop, first_token, last_token, results) -> None:
    """The benign user, in its own process (so the hostile client's CPU and GIL do not
    delay its clock): streams /api/generate answers back to back until `stop` is set, then
    puts on `results` the arrival time of every token chunk (time.perf_counter(), the
    system's monotonic clock, comparable across processes), the answers' start times and
    its failures."""
    stamps: list[float] = []
    answer_starts: list[float] = []
    errors: list[tuple[float, str]] = []
    body = {"model": model, "prompt": BENIGN_PROMPT, "stream": True,
            "options": {"num_predict": 200, "temperature": 0.7}}
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        while not stop.is_set():
            answer_starts.append(time.perf_counter())
            try:
                with client.stream("POST", url + "/api/generate", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        errors.append((time.perf_counter(), f"HTTP {r.status_code}: {r.text[:200]}"))
                        time.sleep(0.2)
                        continue
                    for line in r.iter_lines():
                        if not line:
                            continue
                        chunk = json.loads(line)
                        if chunk.get("error"):
                            errors.append((time.perf_counter(), f"stream error: {str(chunk['error'])[:200]}"))
                        if chunk.get("response"):
                            stamps.append(time.perf_counter())
                            last_token.value = stamps[-1]
                            first_token.set()
                        if stop.is_set():
                            break
            except (httpx.HTTPError, ValueError) as e:
                errors.append((time.perf_counter(), f"{type(e).__name__}: {e}"[:200]))
                time.sleep(0.2)
    results.put({"stamps": stamps, "answer_starts": answer_starts, "errors": errors})


def gaps_in(stamps: np.ndarray, start: float, end: float) -> np.ndarray:
    """The inter-token gaps whose interval (previous chunk, this chunk) overlaps [start, end]."""
    prev, cur = stamps[:-1], stamps[1:]
    return (cur - prev)[(prev < end) & (cur > start)]


# ---- the hostile requests ----------------------------------------------------------
# Each takes (client, url, model) and returns (status, excerpt): status is the HTTP status
# (several joined by "/" for a request made of parts) or what went wrong.

def excerpt_of(r: httpx.Response, n: int = 160) -> str:
    text = r.text if r.content else ""
    return " ".join(text.split())[:n]


def post_json(client: httpx.Client, url: str, body, **kw) -> httpx.Response:
    """POST a body as compact JSON (NaN allowed, which httpx's json= refuses)."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body, separators=(",", ":"))
    return client.post(url, content=content, headers={"content-type": "application/json", **kw.pop("headers", {})},
                       **kw)


def one(r: httpx.Response) -> tuple[str, str]:
    return str(r.status_code), excerpt_of(r)


def random_words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_backtrack(client, url, model):
    """1. Tools offered and a GBNF grammar forcing "```" and 3,000 spaces: the tool-call
    parser then sees an opened code fence it used to backtrack over."""
    grammar = 'root ::= "```" " "{3000}'
    r = post_json(client, url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL], "grammar": grammar, "max_tokens": 4000})
    status, text = one(r)
    if r.status_code == 200:
        body = r.json()
        choice = body["choices"][0]
        text = (f"finish={choice.get('finish_reason')} content_chars={len(choice['message'].get('content') or '')} "
                f"tool_calls={len(choice['message'].get('tool_calls') or [])} "
                f"completion_tokens={body.get('usage', {}).get('completion_tokens')}")
    return status, text


def stop_80k(client, url, model):
    """2. 80,000 stop strings of 10 random characters, n=8."""
    rng = random.Random(2)
    stops = ["".join(rng.choices(string.ascii_letters + string.digits, k=10)) for _ in range(80_000)]
    return one(post_json(client, url + "/v1/completions", {
        "model": model, "prompt": "Once upon a time", "stop": stops, "n": 8, "max_tokens": 50}))


def chat_28k_msgs(client, url, model):
    """3. /api/chat with 28,000 tiny messages."""
    messages = [{"role": "user", "content": "hi"} if i % 2 == 0 else {"role": "assistant", "content": "ok"}
                for i in range(28_000)]
    messages[-1] = {"role": "user", "content": "hi"}
    return one(post_json(client, url + "/api/chat", {"model": model, "messages": messages, "stream": False}))


def prompt_scoring(client, url, model):
    """4. echo + logprobs 5 + max_tokens 0 on a ~3,000-token prompt of real words."""
    r = post_json(client, url + "/v1/completions", {
        "model": model, "prompt": random_words(3000, seed=4), "echo": True, "logprobs": 5, "max_tokens": 0})
    status, text = one(r)
    if r.status_code == 200:
        body = r.json()
        lp = body["choices"][0].get("logprobs") or {}
        text = f"prompt_tokens={body.get('usage', {}).get('prompt_tokens')} scored={len(lp.get('tokens') or [])}"
    return status, text


def prompt_1mib(client, url, model):
    """5a. A 1 MiB prompt without spaces (the body is then just over the default 1 MiB limit)."""
    return one(post_json(client, url + "/api/generate", {
        "model": model, "prompt": "a" * (1 << 20), "stream": False, "options": {"num_predict": 8}}))


def prompt_900kb(client, url, model):
    """5b. A 900 KB prompt without spaces (under the body limit: it reaches the tokenizer)."""
    return one(post_json(client, url + "/api/generate", {
        "model": model, "prompt": "a" * 900_000, "stream": False, "options": {"num_predict": 8}}))


def big_schema(n_props: int = 60) -> dict:
    props = {}
    for i in range(n_props):
        kind = i % 5
        if kind == 0:
            props[f"name_{i}"] = {"type": "string", "maxLength": 40}
        elif kind == 1:
            props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        elif kind == 2:
            props[f"color_{i}"] = {"enum": ["red", "green", "blue", "yellow", "purple"]}
        elif kind == 3:
            props[f"tags_{i}"] = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        else:
            props[f"point_{i}"] = {"type": "object", "properties": {
                "x": {"type": "number"}, "y": {"type": "number"}, "label": {"type": "string"}},
                "required": ["x", "y", "label"], "additionalProperties": False}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def schema_n8(client, url, model):
    """6. A large-ish JSON schema response_format with n=8 (a grammar per sample)."""
    schema = big_schema()
    r = post_json(client, url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Fill in the record."}], "n": 8,
        "max_tokens": 100, "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "record", "schema": schema}}})
    status, text = one(r)
    if r.status_code == 200:
        body = r.json()
        text = (f"schema_bytes={len(json.dumps(schema))} choices={len(body['choices'])} "
                f"completion_tokens={body.get('usage', {}).get('completion_tokens')}")
    return status, text


def tools_5000(client, url, model):
    """7a. 5,000 tools in one chat request."""
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(5000)]
    return one(post_json(client, url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 16}))


def logit_bias_100k(client, url, model):
    """7b. logit_bias with 100,000 entries."""
    return one(post_json(client, url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
        "logit_bias": {str(i): 1 for i in range(100_000)}}))


def embed_10k(client, url, model):
    """7c. 10,000 inputs in one /v1/embeddings request."""
    r = post_json(client, url + "/v1/embeddings", {
        "model": model, "input": [f"sentence number {i} about the sea" for i in range(10_000)]})
    status, text = one(r)
    if r.status_code == 200:
        text = f"embeddings={len(r.json().get('data') or [])}"
    return status, text


def body_8mib(client, url, model):
    """7d. An 8 MiB request body."""
    return one(post_json(client, url + "/api/generate", {
        "model": model, "prompt": "hello " * ((8 << 20) // 6), "stream": False}))


def schema_depth_5000(client, url, model):
    """8. A JSON schema nested 5,000 levels deep in Ollama's `format` (written by hand:
    json.dumps itself stops at ~1,000 levels)."""
    depth = 5000
    schema = ('{"type":"object","properties":{"a":' * depth) + '{"type":"string"}' + ("}}" * depth)
    body = ('{"model":' + json.dumps(model) + ',"prompt":"hi","stream":false,'
            '"options":{"num_predict":8},"format":' + schema + "}")
    return one(post_json(client, url + "/api/generate", body))


def keep_alive_huge(client, url, model):
    """9. keep_alive 1e300 and NaN (a JSON extension Python's parser accepts) on
    /api/generate, then GET /api/ps."""
    statuses, texts = [], []
    for value in ("1e300", "NaN"):
        body = ('{"model":' + json.dumps(model) + ',"prompt":"hi","stream":false,'
                '"options":{"num_predict":4},"keep_alive":' + value + "}")
        r = post_json(client, url + "/api/generate", body)
        statuses.append(str(r.status_code))
        texts.append(f"{value}: {excerpt_of(r, 70)}")
    r = client.get(url + "/api/ps")
    statuses.append(str(r.status_code))
    texts.append(f"ps: {excerpt_of(r, 70)}")
    return "/".join(statuses), " | ".join(texts)


def stats_burst(client, url, model):
    """10. 200 GET /api/pool and /metrics (alternating) from 16 threads."""
    def get(i: int) -> tuple[str, float]:
        t = time.perf_counter()
        try:
            r = client.get(url + ("/api/pool" if i % 2 == 0 else "/metrics"))
            return str(r.status_code), time.perf_counter() - t
        except httpx.TimeoutException:
            return "timeout", time.perf_counter() - t
        except httpx.HTTPError as e:
            return type(e).__name__, time.perf_counter() - t
    with ThreadPoolExecutor(16) as ex:   # one client (its pool of 16+ connections) for all threads
        results = list(ex.map(get, range(200)))
    counts: dict[str, int] = {}
    for status, _ in results:
        counts[status] = counts.get(status, 0) + 1
    worst = max(s for _, s in results)
    status = "/".join(f"{k}x{v}" for k, v in sorted(counts.items()))
    return status, f"{len(results)} requests, slowest {worst:.2f} s"


def logit_bias_unicode(client, url, model):
    """11a. logit_bias {"²": 1} (a digit to str.isdigit, not to int())."""
    return one(post_json(client, url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "logit_bias": {"²": 1}}))


def header_non_ascii(client, url, model):
    """11b. Request headers with bytes >= 0x80 (raw, through http.client)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HOSTILE_TIMEOUT)
    body = json.dumps({"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 4}}).encode()
    try:
        conn.putrequest("POST", "/api/generate")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.putheader("User-Agent", b"caf\xc3\xa9 \xff\xfe\x80")
        conn.putheader("X-Request-Id", b"\xe2\x98\x83\x80\x81")
        conn.putheader("Authorization", b"Bearer \xff\xff")
        conn.endheaders(body)
        r = conn.getresponse()
        return str(r.status), " ".join(r.read().decode("utf-8", "replace").split())[:160]
    finally:
        conn.close()


def sampling_extremes(client, url, model):
    """11c. temperature 1e308 and top_k -1 (Ollama options and OpenAI fields)."""
    a = post_json(client, url + "/api/generate", {
        "model": model, "prompt": "hi", "stream": False,
        "options": {"num_predict": 16, "temperature": 1e308, "top_k": -1}})
    b = post_json(client, url + "/v1/completions", {
        "model": model, "prompt": "hi", "max_tokens": 16, "temperature": 1e308, "top_k": -1})
    c = post_json(client, url + "/api/generate", {
        "model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 16, "temperature": 1e308}})
    return (f"{a.status_code}/{b.status_code}/{c.status_code}",
            f"ollama: {excerpt_of(a, 50)} | openai: {excerpt_of(b, 50)} | t=1e308 alone: {excerpt_of(c, 50)}")


def pool_figures(client, url) -> dict:
    stats = client.get(url + "/api/pool").json().get("stats") or {}
    return {k: stats.get(k) for k in ("blocks_used", "running_requests", "waiting_requests")}


def hangup_stream(client, url, model):
    """12. A streamed /api/generate (num_predict 2000) whose client hangs up after 5 chunks;
    the pool must go back to where it was (the benign stream holds some blocks meanwhile)."""
    before = pool_figures(client, url)
    chunks = 0
    with client.stream("POST", url + "/api/generate", json={
            "model": model, "prompt": random_words(600, seed=12), "stream": True,
            "options": {"num_predict": 2000, "temperature": 0.7}}) as r:
        status = str(r.status_code)
        for line in r.iter_lines():
            if line:
                chunks += 1
            if chunks >= 5:
                break
    # the hang-up: the connection is closed here; wait for the server to drop the request
    deadline = time.perf_counter() + 10
    after = pool_figures(client, url)
    while after["running_requests"] is not None and after["running_requests"] > (before["running_requests"] or 0) \
            and time.perf_counter() < deadline:
        time.sleep(0.25)
        after = pool_figures(client, url)
    return status, f"{chunks} chunks then hang-up; pool before {before}, after {after}"


def draft_long_prompt(client, url, model):
    """13. On a server started with --draft-model: /api/generate of a ~3.9k-token prompt
    (num_predict 160, greedy), which the draft model has to catch up on before it drafts."""
    before = client.get(url + "/api/pool").json().get("stats") or {}
    r = post_json(client, url + "/api/generate", {
        "model": model, "prompt": random_words(DRAFT_PROMPT_WORDS, seed=13), "stream": False,
        "options": {"num_predict": 160, "temperature": 0}})
    status, text = one(r)
    if r.status_code == 200:
        body = r.json()
        after = client.get(url + "/api/pool").json().get("stats") or {}

        def delta(key):
            return (after.get(key) or 0) - (before.get(key) or 0)
        text = (f"prompt_tokens={body.get('prompt_eval_count')} tokens={body.get('eval_count')} "
                f"draft catch-up tokens={delta('spec_draft_catch_up_tokens')} "
                f"drafted={delta('spec_draft_tokens')} accepted={delta('spec_accepted_tokens')}")
    return status, text


class SilentHost:
    """A TCP listener on loopback that accepts every connection and never sends a byte."""

    def __init__(self):
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:   # closed
                return
            self._held.append(conn)   # held open, never read or written

    def close(self) -> None:
        """Stop listening and drop every held connection."""
        self._sock.close()
        for conn in self._held:
            conn.close()


SILENT: SilentHost | None = None   # main() starts it before the server, when row 14 runs


def counted(prefix: str, statuses: list[str]) -> str:
    """"200x3/502x1" style counts, each with prefix."""
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return "/".join(f"{prefix}{k}x{v}" for k, v in sorted(counts.items()))


def pulls_silent_host(client, url, model):
    """14. Six /api/pull at once of a model on a host that accepts connections and never
    answers; meanwhile GET /api/tags every 0.25 s (an answer slower than 1 s counts as
    "slow")."""
    name = f"{SILENT.address}/library/silent:latest"
    done = threading.Event()
    probes: list[tuple[str, float]] = []

    def pull(_):
        try:
            r = post_json(client, url + "/api/pull", {"model": name, "stream": False})
            return str(r.status_code), excerpt_of(r, 80)
        except httpx.TimeoutException:
            return "timeout", f"no answer in {HOSTILE_TIMEOUT:g} s"
        except httpx.HTTPError as e:
            return type(e).__name__, str(e)[:80]

    def probe():
        while not done.is_set():
            t = time.perf_counter()
            try:
                status = str(client.get(url + "/api/tags").status_code)
            except httpx.TimeoutException:
                status = "timeout"
            except httpx.HTTPError as e:
                status = type(e).__name__
            took = time.perf_counter() - t
            probes.append(("slow" if status == "200" and took >= GAP_P99_LIMIT else status, took))
            done.wait(TAGS_PROBE_EVERY)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    with ThreadPoolExecutor(SILENT_PULLS) as ex:
        pulls = list(ex.map(pull, range(SILENT_PULLS)))
    done.set()
    prober.join(HOSTILE_TIMEOUT)
    status = counted("pull", [p for p, _ in pulls]) + "/" + counted("tags", [p for p, _ in probes])
    slowest = max((t for _, t in probes), default=0.0)
    answers = sorted({text for _, text in pulls})
    return status, f"/api/tags slowest {slowest:.2f} s of {len(probes)}; answers: {' | '.join(answers)[:200]}"


def answered(status: str) -> bool:
    """Whether every part of a status is an answer (2xx or 4xx)."""
    return all(s.split("x")[0][:1] in ("2", "4") for s in status.split("/"))


def pulls_answered(status: str) -> bool:
    """Row 14: each pull answered, a dead upstream's 502/503/504 included, and each /api/tags
    probe a 200 within the limit."""
    for part in status.split("/"):
        code = part.split("x")[0]
        if code.startswith("pull"):
            if not (answered(code[4:]) or code[4:] in ("502", "503", "504")):
                return False
        elif code != "tags200":
            return False
    return True


@dataclass
class Hostile:
    number: str
    name: str
    run: Callable[[httpx.Client, str, str], tuple[str, str]]
    server: str = "default"                       # a key of SERVER_KINDS: the server it runs on
    ended: Callable[[str], bool] = answered       # whether its status counts as an answer


HOSTILE = [
    Hostile("1", "tool_backtrack", tool_backtrack),
    Hostile("2", "stop_80k", stop_80k),
    Hostile("3", "chat_28k_msgs", chat_28k_msgs),
    Hostile("4", "prompt_scoring", prompt_scoring),
    Hostile("5a", "prompt_1mib", prompt_1mib),
    Hostile("5b", "prompt_900kb", prompt_900kb),
    Hostile("6", "schema_n8", schema_n8),
    Hostile("7a", "tools_5000", tools_5000),
    Hostile("7b", "logit_bias_100k", logit_bias_100k),
    Hostile("7c", "embed_10k", embed_10k),
    Hostile("7d", "body_8mib", body_8mib),
    Hostile("8", "schema_depth_5000", schema_depth_5000),
    Hostile("9", "keep_alive_huge", keep_alive_huge),
    Hostile("10", "stats_burst", stats_burst),
    Hostile("11a", "logit_bias_unicode", logit_bias_unicode),
    Hostile("11b", "header_non_ascii", header_non_ascii),
    Hostile("11c", "sampling_extremes", sampling_extremes),
    Hostile("12", "hangup_stream", hangup_stream),
    Hostile("13", "draft_long_prompt", draft_long_prompt, server="draft_model"),
    Hostile("14", "pulls_silent_host", pulls_silent_host, ended=pulls_answered),
]


def select(only: str | None) -> list[Hostile]:
    """--only: names or numbers ("7" takes 7a-7d)."""
    if not only:
        return HOSTILE
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    chosen = [h for h in HOSTILE if h.name in wanted or h.number in wanted or h.number.rstrip("abcd") in wanted]
    unknown = wanted - {h.name for h in chosen} - {h.number for h in chosen} - {h.number.rstrip("abcd") for h in chosen}
    if unknown:
        raise SystemExit(f"unknown hostile requests {sorted(unknown)}; known: {[h.name for h in HOSTILE]}")
    return chosen


# ---- the run ---------------------------------------------------------------------

@dataclass
class Window:
    label: str
    start: float
    end: float
    status: str = ""
    excerpt: str = ""
    recover: float | None = None   # seconds from the end to the benign stream's next token
    server: str = "default"        # the server it ran on (a key of SERVER_KINDS)
    ended: Callable[[str], bool] = answered


def run_hostile(h: Hostile, url: str, model: str) -> Window:
    w = Window(f"{h.number} {h.name}", time.perf_counter(), 0.0, server=h.server, ended=h.ended)
    try:
        with httpx.Client(timeout=HOSTILE_TIMEOUT) as client:
            w.status, w.excerpt = h.run(client, url, model)
    except (httpx.TimeoutException, socket.timeout, TimeoutError):
        w.status, w.excerpt = "timeout", f"no answer within the {HOSTILE_TIMEOUT:.0f} s client timeout"
    except Exception as e:   # a broken connection and the like: what the client saw
        w.status, w.excerpt = type(e).__name__, str(e)[:160]
    w.end = time.perf_counter()
    return w


def summarize(w: Window, stamps: np.ndarray, errors: list, hostile: bool) -> dict:
    gaps = gaps_in(stamps, w.start, w.end)
    pct = lambda p: float(np.percentile(gaps, p)) if len(gaps) else None  # noqa: E731
    p99 = pct(99)
    seconds = w.end - w.start
    n_errors = sum(1 for t, _ in errors if w.start <= t <= w.end)
    row = {"hostile": w.label, "server": SERVER_KINDS[w.server], "status": w.status if hostile else "-",
           "hostile_s": round(seconds, 3) if hostile else None,
           "gaps_n": int(len(gaps)), "gap_p50_s": pct(50), "gap_p99_s": p99,
           "gap_max_s": float(gaps.max()) if len(gaps) else None,
           "recover_s": round(w.recover, 3) if hostile and w.recover is not None else None, "benign_errors": n_errors}
    stream_ok = p99 is not None and p99 < GAP_P99_LIMIT and n_errors == 0
    row["pass"] = stream_ok and (not hostile or (w.ended(w.status) and seconds <= HOSTILE_LIMIT))
    return row


def plot(path: Path, phases: list[np.ndarray], t0: float, windows: list[Window], rows: list[dict]) -> None:
    """phases: the benign stream's token times on each server, one after the other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(12, 8), gridspec_kw={"height_ratios": [3, 2]})
    for i, stamps in enumerate(phases):
        if len(stamps) > 1:
            ax0.plot(stamps[1:] - t0, np.diff(stamps), ".", ms=2, color="tab:blue",
                     label="benign inter-token gap" if i == 0 else None)
    ax0.set_yscale("log")
    ax0.axhline(GAP_P99_LIMIT, color="tab:red", lw=0.8, ls="--", label=f"{GAP_P99_LIMIT:g} s")
    top = ax0.get_ylim()[1]
    for w in windows:
        color = "tab:green" if w.label.startswith("baseline") else "tab:orange"
        ax0.axvspan(w.start - t0, max(w.end - t0, w.start - t0 + 0.05), color=color, alpha=0.25, lw=0)
        ax0.text(w.start - t0, top, w.label.split(" ")[0], fontsize=7, va="top", rotation=90)
    ax0.set(xlabel="seconds since the run started", ylabel="gap (s)",
            title="Benign stream's inter-token gaps; shaded: baseline (green) and hostile requests (orange)")
    ax0.legend(loc="upper right", fontsize=8)
    labels = [r["hostile"] for r in rows]
    p99 = [r["gap_p99_s"] or 1e-3 for r in rows]
    colors = ["tab:green" if r["pass"] else "tab:red" for r in rows]
    ax1.bar(range(len(rows)), p99, color=colors)
    ax1.axhline(GAP_P99_LIMIT, color="tab:red", lw=0.8, ls="--")
    ax1.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    ax1.set_yscale("log")
    ax1.set(ylabel="benign gap p99 (s)", title="Benign gap p99 in each window (red: the row fails)")
    save_figure(fig, path)
    plt.close(fig)


def md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


@dataclass
class Phase:
    """One server's part of the run: its windows (the baseline first), the benign stream's
    token times and failures on it, and how the server ended."""

    kind: str
    url: str = ""
    model: str = ""
    windows: list[Window] | None = None
    stamps: np.ndarray | None = None
    errors: list | None = None
    answer_starts: list | None = None
    server_rc: int | None = None


def run_phase(args, kind: str, chosen: list[Hostile], out: Path) -> Phase:
    """Start a server of this kind, stream the benign user on it, take the baseline, send
    the chosen rows one at a time, stop both."""
    log = out / (f"{NAME}.server.log" if kind == "default" else f"{NAME}.{kind}.server.log")
    silent = SILENT.address if SILENT is not None and any(h.name == "pulls_silent_host" for h in chosen) else None
    proc, url, model = start_server(args, log, kind, silent, args.port if kind == "default" else None)
    phase = Phase(kind, url, model, windows=[])
    print(f"server {url} ({SERVER_KINDS[kind]}), model {model}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    stop, first_token, last_token, results = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    benign_proc = ctx.Process(target=benign_stream, args=(url, model, stop, first_token, last_token, results),
                              daemon=True)
    benign = {"stamps": [], "answer_starts": [], "errors": []}
    try:
        benign_proc.start()
        if not first_token.wait(120):
            raise RuntimeError("the benign stream got no token in 120 s")
        time.sleep(WARMUP_SECONDS)   # the first steps after loading are not the steady state
        label = "baseline (quiet)" if kind == "default" else f"baseline (quiet, {SERVER_KINDS[kind]})"
        base = Window(label, time.perf_counter(), 0.0, server=kind)
        time.sleep(args.baseline_s)
        base.end = time.perf_counter()
        phase.windows.append(base)
        for h in chosen:
            time.sleep(QUIET_GAP)
            w = run_hostile(h, url, model)
            phase.windows.append(w)
            # the next one starts once the benign stream moves again, so that a stall the
            # hostile request left behind is not counted in its successor's window
            while last_token.value < w.end and time.perf_counter() < w.end + RECOVERY_WAIT and proc.poll() is None:
                time.sleep(0.05)
            w.recover = max(0.0, last_token.value - w.end) if last_token.value >= w.end else None
            after = "none" if w.recover is None else f"{w.recover:.2f} s"
            print(f"{w.label}: {w.status} in {w.end - w.start:.2f} s (next benign token after {after}): "
                  f"{w.excerpt[:120]}", flush=True)
            if proc.poll() is not None:
                print(f"the server exited ({proc.returncode}); stopping", flush=True)
                break
        time.sleep(QUIET_GAP)
    finally:
        stop.set()
        try:
            benign = results.get(timeout=60)
        except queue.Empty:
            print("the benign stream did not report back", flush=True)
        benign_proc.join(10)
        if benign_proc.is_alive():
            benign_proc.terminate()
        phase.server_rc = proc.poll()
        stop_server(proc)
    phase.stamps = np.array(benign["stamps"])
    phase.errors = [tuple(e) for e in benign["errors"]]
    phase.answer_starts = benign["answer_starts"]
    return phase


def main(argv=None) -> int:
    global SILENT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft-model", default=None,
                    help="the draft GGUF of the --draft-model server (row 13; default: the served model "
                         "itself, which shares its vocabulary)")
    add_options(ap, model=None, threads=None, port=None, out_dir=str(RESULTS_DIR),
                helps={"threads": "the server's --threads (default: its own)",
                       "port": "port of the default server (default: a free one)"})
    ap.add_argument("--only", default=None,
                    help="comma-separated hostile requests, by name or number: " + ",".join(h.name for h in HOSTILE))
    ap.add_argument("--baseline-s", type=float, default=BASELINE_SECONDS)
    args = ap.parse_args(argv)
    chosen = select(args.only)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if any(h.name == "pulls_silent_host" for h in chosen):
        SILENT = SilentHost()
    t0 = time.perf_counter()
    phases: list[Phase] = []
    try:
        for kind in [k for k in SERVER_KINDS if any(h.server == k for h in chosen)]:   # the default one first
            phases.append(run_phase(args, kind, [h for h in chosen if h.server == kind], out))
            if phases[-1].server_rc is not None:
                break
    finally:
        if SILENT is not None:
            SILENT.close()

    rows = [summarize(w, p.stamps, p.errors, i > 0) for p in phases for i, w in enumerate(p.windows)]
    for r in rows:
        print(r, flush=True)
    windows = [w for p in phases for w in p.windows]
    errors = [e for p in phases for e in p.errors]
    columns = ["hostile", "server", "status", "hostile_s", "gaps_n", "gap_p50_s", "gap_p99_s", "gap_max_s",
               "recover_s", "benign_errors", "pass"]
    notes = [f"Pass: the benign stream's inter-token gap p99 < {GAP_P99_LIMIT:g} s in the window with no "
             f"failed benign request, and the hostile request answered (2xx/4xx; row 14's pulls from a silent "
             f"host also 502/503/504, with every /api/tags probe a 200 within {GAP_P99_LIMIT:g} s) within "
             f"{HOSTILE_LIMIT:g} s. "
             "Gaps: every gap of the benign /api/generate stream (num_predict 200, temperature 0.7, answers back "
             "to back, the gap between two answers included) that overlaps the hostile request's window. "
             f"Hostile requests one at a time, {HOSTILE_TIMEOUT:g} s client timeout; the next starts {QUIET_GAP:g} s "
             "after the benign stream has moved again (recover_s: from a request's end to the benign stream's next "
             "token; a stall that outlives the request shows there). Rows of another server (--draft-model) run "
             "on a second server after the first, with a benign stream and a baseline of their own.", "",
             "Answers:", ""]
    notes += [f"- {md_escape(w.label)}: {md_escape(w.status)}, {md_escape(w.excerpt)}"
              for w in windows if not w.label.startswith("baseline")]
    if errors:
        notes += ["", f"Benign stream failures: {len(errors)}; first: {md_escape(errors[0][1])}"]
    for p in phases:
        if p.server_rc is not None:
            notes += ["", f"The {SERVER_KINDS[p.kind]} server exited with {p.server_rc} during the run."]
    data = {"params": {**vars(args), "hostile_timeout_s": HOSTILE_TIMEOUT, "quiet_gap_s": QUIET_GAP,
                       "benign_prompt": BENIGN_PROMPT},
            "servers": [{"kind": p.kind, "url": p.url, "model": p.model, "exited_during_run": p.server_rc}
                        for p in phases],
            "windows": [{"label": w.label, "server": w.server, "start_s": w.start - t0, "end_s": w.end - t0,
                         "status": w.status, "excerpt": w.excerpt, "recover_s": w.recover} for w in windows],
            "benign": [{"server": p.kind, "token_times_s": (p.stamps - t0).round(4).tolist(),
                        "answer_starts_s": [round(t - t0, 4) for t in p.answer_starts],
                        "errors": [{"t_s": round(t - t0, 3), "error": e} for t, e in p.errors]} for p in phases]}
    paths = write_results(NAME, data, rows, out_dir=out, columns=columns, notes="\n".join(notes),
                          title="Noisy neighbour: a benign stream's inter-token gaps while hostile requests run")
    plot(out / f"{NAME}.png", [p.stamps for p in phases], t0, windows, rows)
    print(f"wrote {paths['json']}, {paths['md']}, {out / (NAME + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
