"""A pull from start to end: parse the reference, plan it with its source (one request:
the manifest or the repository's file list), then fetch into the store. Statuses are
Ollama's: "pulling manifest", "pulling <digest12>" with byte counts, "verifying sha256
digest", "writing manifest", "success"."""

from __future__ import annotations

from typing import Callable

from .download import Progress
from .hub import HubPull, plan_hub
from .ollama_registry import RegistryPull, plan_registry
from .refs import ModelRef, parse_reference
from .store import ModelStore, StoredModel


def plan_pull(ref: ModelRef, should_stop: Callable[[], bool] | None = None) -> HubPull | RegistryPull:
    """What pulling ref will fetch (ModelNotFoundError, RequestError or DownloadError if nothing;
    DownloadCancelled once should_stop() says so)."""
    return plan_hub(ref, should_stop) if ref.source == "hf" else plan_registry(ref, should_stop)


def pull(reference: str | ModelRef, pattern: str | None = None, *, store: ModelStore | None = None,
         progress: Progress | None = None, should_stop: Callable[[], bool] | None = None) -> StoredModel:
    """Fetch a model into the store (resuming what an earlier pull left) and return it."""
    ref = reference if isinstance(reference, ModelRef) else parse_reference(reference, pattern)
    if progress:
        progress("pulling manifest", 0, 0)
    plan = plan_pull(ref, should_stop)
    stored = plan.fetch(store or ModelStore(), progress, should_stop)
    if progress:
        progress("success", 0, 0)
    return stored
