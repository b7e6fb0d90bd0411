"""An Ollama registry as a model source: the tag's manifest (the Docker distribution
API's), its GGUF layer and the small layers Ollama keeps beside it (template, params,
system prompt, license), each fetched into the store by digest and verified."""

from __future__ import annotations

from typing import Callable

from ..errors import DownloadError
from .download import Progress, check_declared_size, fetch_blob, get_json, sha256_hex
from .egress import check_registry_host
from .refs import ModelRef, base_url_for
from .store import ModelStore, StoredModel

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
MODEL_LAYER = "application/vnd.ollama.image.model"
# the layers kept beside the GGUF (others, such as a vision projector or an adapter, are not used here)
EXTRA_LAYERS = {"application/vnd.ollama.image.template": "template",
                "application/vnd.ollama.image.params": "params",
                "application/vnd.ollama.image.system": "system",
                "application/vnd.ollama.image.license": "license"}
MAX_EXTRA_BYTES = 16 << 20   # text layers are kilobytes; a bigger one is not worth keeping


def _layers(manifest: dict, what: str) -> list[tuple[str, str, int]]:
    """(role, digest, size) of the layers used, the model's first; DownloadError for a
    manifest without exactly one GGUF layer or with malformed entries."""
    out = []
    for layer in manifest.get("layers") or []:
        if not isinstance(layer, dict):
            raise DownloadError(f"{what}: the manifest's layers are malformed")
        role = "model" if layer.get("mediaType") == MODEL_LAYER else EXTRA_LAYERS.get(layer.get("mediaType"))
        if role is None:
            continue
        digest, size = layer.get("digest"), layer.get("size")
        sha256_hex(digest if isinstance(digest, str) else "")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise DownloadError(f"{what}: layer {digest} has no valid size")
        if role != "model" and size > MAX_EXTRA_BYTES:
            continue
        check_declared_size(size, f"{what}: layer {digest}")
        out.append((role, digest, size))
    models = [entry for entry in out if entry[0] == "model"]
    if len(models) != 1:
        raise DownloadError(f"{what}: the manifest has {len(models)} model layers ({MODEL_LAYER}); one is needed")
    return models + [entry for entry in out if entry[0] != "model"]


class RegistryPull:
    """A pull from an Ollama registry, planned: the reference and the layers to fetch."""

    def __init__(self, ref: ModelRef, base: str, layers: list[tuple[str, str, int]]):
        self.ref, self.base, self.roles = ref, base, layers

    @property
    def layers(self) -> list[tuple[str, int | None]]:
        """(digest, size) of what is downloaded, the GGUF first."""
        return [(digest, size) for _, digest, size in self.roles]

    def blob_url(self, digest: str) -> str:
        """The registry URL of a layer."""
        return f"{self.base}/v2/{self.ref.namespace}/{self.ref.name}/blobs/{digest}"

    def fetch(self, store: ModelStore, progress: Progress | None = None,
              should_stop: Callable[[], bool] | None = None) -> StoredModel:
        """Download every layer into the store (resuming partial ones), then write the manifest."""
        store.prepare()
        paths = {}
        for role, digest, size in self.roles:
            status = f"pulling {sha256_hex(digest)[:12]}"
            paths[role] = fetch_blob(self.blob_url(digest), store.blob_path(digest), digest, size, status=status,
                                     progress=progress, should_stop=should_stop, source=self.base,
                                     gguf=role == "model")
        if progress:
            # each blob's digest was checked as it was renamed into place
            progress("verifying sha256 digest", 0, 0)
            progress("writing manifest", 0, 0)
        entries = {role: {"path": str(paths[role].relative_to(store.root)), "digest": digest, "size": size}
                   for role, digest, size in self.roles}
        model = entries.pop("model")
        return store.write(self.ref, model, entries, {"registry": self.base, "manifest": self.manifest_url()})

    def manifest_url(self) -> str:
        """Where the tag's manifest was read."""
        return manifest_url(self.ref, self.base)


def manifest_url(ref: ModelRef, base: str) -> str:
    """The distribution API's manifest URL of a reference's tag."""
    return f"{base}/v2/{ref.namespace}/{ref.name}/manifests/{ref.tag}"


def plan_registry(ref: ModelRef, should_stop: Callable[[], bool] | None = None) -> RegistryPull:
    """Read the tag's manifest (one request) and settle the layers to fetch; a registry that
    is not allowed is refused before any connection."""
    check_registry_host(ref.host)
    base = base_url_for(ref.host)
    what = f"model {ref.display()}"
    manifest = get_json(manifest_url(ref, base), what, {"Accept": MANIFEST_TYPE}, should_stop=should_stop)
    return RegistryPull(ref, base, _layers(manifest, what))
