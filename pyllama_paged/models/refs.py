"""Model references, as `pull`, /api/pull and the server's model names take them.

- ``hf.co/USER/REPO[:QUANT]`` (or ``huggingface.co/...``, with or without ``https://``): a
  GGUF of a Hugging Face repository, picked by QUANT (see hub.choose_quant).
- ``USER/REPO`` with a file glob: a file of a Hugging Face repository, as llama-cpp-python's
  from_pretrained takes it.
- ``NAME[:TAG]``, ``NAMESPACE/NAME[:TAG]``, ``HOST/NAMESPACE/NAME[:TAG]``: a model of an Ollama
  registry (tag ``latest``, namespace ``library`` and the configured registry by default).

NOTE(refs): a bare ``USER/REPO`` without a glob is an Ollama ``NAMESPACE/NAME``, as Ollama
reads it; the Hub needs ``hf.co/`` in front or a file glob."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from ..errors import RequestError

HF_HOST = "hf.co"
HF_HOSTS = ("hf.co", "huggingface.co")
DEFAULT_TAG = "latest"
DEFAULT_NAMESPACE = "library"
REGISTRY_ENV = "PYLLAMA_PAGED_REGISTRY"
DEFAULT_REGISTRY = "https://registry.ollama.ai"

# Ollama's own rules for names and tags; both also keep every part a safe path component
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A parsed reference. source: "hf" or "ollama"; host: "hf.co" or the registry's
    host[:port]; namespace/name: the Hub's user and repository, or the registry's
    namespace and model; tag: the QUANT (None: the default choice) or the registry tag;
    pattern: a file glob (Hub only)."""

    source: str
    host: str
    namespace: str
    name: str
    tag: str | None
    pattern: str | None = None

    @property
    def repo_id(self) -> str:
        """The Hub's USER/REPO (or the registry's NAMESPACE/NAME)."""
        return f"{self.namespace}/{self.name}"

    def with_tag(self, tag: str) -> "ModelRef":
        """The same model under another tag (a Hub file once it is chosen)."""
        return replace(self, tag=tag, pattern=None)

    def display(self) -> str:
        """The shortest name that means this model: Ollama's way (library models of the
        configured registry by name alone, others with namespace and host)."""
        tag = self.tag or DEFAULT_TAG
        if self.source == "hf":
            return f"{HF_HOST}/{self.repo_id}:{tag}"
        if self.host.lower() != registry_host().lower():
            return f"{self.host}/{self.repo_id}:{tag}"
        if self.namespace == DEFAULT_NAMESPACE:
            return f"{self.name}:{tag}"
        return f"{self.repo_id}:{tag}"

    def key(self) -> str:
        """The case-insensitive identity of a stored model (Ollama's names are)."""
        return f"{self.host}/{self.repo_id}:{self.tag or DEFAULT_TAG}".lower()


def registry_base() -> str:
    """The default Ollama registry's base URL (PYLLAMA_PAGED_REGISTRY, read at each call)."""
    base = (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).strip().rstrip("/")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RequestError(f"{REGISTRY_ENV}={base!r} is not an http(s) URL such as {DEFAULT_REGISTRY}")
    return base


def registry_host() -> str:
    """The host[:port] of the default registry, as it appears in names and store paths."""
    return urlsplit(registry_base()).netloc


def base_url_for(host: str) -> str:
    """The base URL of the registry a reference names: the configured one for its own host
    (it may be plain http), https otherwise."""
    base = registry_base()
    return base if urlsplit(base).netloc.lower() == host.lower() else f"https://{host}"


def _check(part: str, rule: re.Pattern, what: str, text: str) -> str:
    if not rule.fullmatch(part):
        raise RequestError(f"model reference {text!r}: {what} {part!r} is not valid (letters, digits, '.', "
                           "'_' and '-', starting with a letter or digit)")
    return part


def parse_reference(text: str, pattern: str | None = None) -> ModelRef:
    """A ModelRef for a reference; pattern is a file glob (Hub only). RequestError naming
    the part at fault for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise RequestError("a model reference is required (e.g. hf.co/USER/REPO:Q4_K_M or llama3.2:1b)")
    if pattern is not None and (not pattern.strip() or "\0" in pattern):
        raise RequestError(f"file pattern {pattern!r} is empty or not a glob")
    ref = text.strip()
    lowered = ref.lower()
    for scheme in ("https://", "http://"):
        if lowered.startswith(scheme):
            rest = ref[len(scheme):]
            if rest.split("/", 1)[0].lower() not in HF_HOSTS:
                raise RequestError(f"model reference {text!r}: a URL is only understood for the Hugging Face Hub; "
                                   f"for another Ollama registry set {REGISTRY_ENV}")
            ref = rest
    if "@" in ref:
        raise RequestError(f"model reference {text!r}: pulling by digest (@sha256:...) is not supported")
    head, _, last = ref.rpartition("/")
    name, colon, tag = last.partition(":")
    if colon:
        _check(tag, _TAG, "tag", text)
    parts = (head.split("/") if head else []) + [name]
    if parts[0].lower() in HF_HOSTS:
        if len(parts) != 3:
            raise RequestError(f"model reference {text!r}: a Hub reference is hf.co/USER/REPO[:QUANT]")
        if colon and pattern:
            raise RequestError(f"model reference {text!r}: give either :QUANT or a file pattern, not both")
        user, repo = (_check(p, _NAME, "name", text) for p in parts[1:])
        return ModelRef("hf", HF_HOST, user, repo, tag or None, pattern)
    if pattern is not None:
        if len(parts) != 2 or colon:
            raise RequestError(f"model reference {text!r}: a file pattern goes with a Hugging Face USER/REPO")
        user, repo = (_check(p, _NAME, "name", text) for p in parts)
        return ModelRef("hf", HF_HOST, user, repo, None, pattern)
    if len(parts) > 3:
        raise RequestError(f"model reference {text!r}: an Ollama name is [HOST/][NAMESPACE/]NAME[:TAG]")
    host = _check(parts[0], _HOST, "host", text) if len(parts) == 3 else registry_host()
    namespace = _check(parts[-2], _NAME, "namespace", text) if len(parts) >= 2 else DEFAULT_NAMESPACE
    return ModelRef("ollama", host, namespace, _check(parts[-1], _NAME, "name", text), tag or DEFAULT_TAG)
