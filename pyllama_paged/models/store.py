"""The local model store: what `pull` fetched, found again by name.

Layout under the store's root ($PYLLAMA_PAGED_MODELS; else $XDG_CACHE_HOME/pyllama-paged/models,
else ~/.cache/pyllama-paged/models):

    blobs/sha256-<hex>              a registry layer, complete and verified (shared by tags)
    blobs/sha256-<hex>.partial      a download in progress; the next pull resumes it
    manifests/<host>/<namespace>/<name>/<tag>.json   one per pulled name

A manifest names the GGUF ("model": path, digest, size), the extra layers kept beside it
("files": template, params, system, license) and a few GGUF facts for listings. Hugging Face
files stay in Hugging Face's cache (shared with other tools); their manifest points there.
Manifests are written last and atomically: a name exists only once its files are complete."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..gguf.reader import read_metadata
from .refs import ModelRef, parse_reference

STORE_ENV = "PYLLAMA_PAGED_MODELS"
log = logging.getLogger("pyllama_paged.models")


def store_root() -> Path:
    """The store's directory for this environment (read at each call)."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pyllama-paged" / "models"


@dataclass
class StoredModel:
    """A pulled model: its name, GGUF path, sha256 digest and what listings show."""

    name: str
    path: str
    digest: str
    size: int
    source: str
    pulled_at: float
    manifest: Path
    details: dict = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


def gguf_details(path: str | os.PathLike) -> dict:
    """Ollama's "details" of a GGUF from its metadata ({} when it cannot be read)."""
    try:
        meta = read_metadata(str(path))
    except Exception as e:   # a listing must not fail for one odd file
        log.warning("cannot read the GGUF metadata of %s: %s", path, e)
        return {}
    arch = str(meta.get("general.architecture", ""))
    return {"format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": str(meta.get("general.size_label", "")),
            "file_type": meta.get("general.file_type")}


class ModelStore:
    """The store at root (default: store_root() now)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else store_root()

    def blob_path(self, digest: str) -> Path:
        """Where a layer with this "sha256:<hex>" digest lives."""
        return self.root / "blobs" / digest.replace(":", "-")

    def manifest_path(self, ref: ModelRef) -> Path:
        """The manifest file of a reference (parts are path-safe: refs checks them)."""
        return self.root / "manifests" / ref.host / ref.namespace / ref.name / f"{ref.tag or 'latest'}.json"

    def write(self, ref: ModelRef, model: dict, files: dict[str, dict], origin: dict) -> StoredModel:
        """Record a pulled model (model: path, digest, size; files: role -> path, digest)."""
        record = {"schema": 1, "name": ref.display(), "source": ref.source, "model": model, "files": files,
                  "origin": origin, "details": gguf_details(self._absolute(model["path"])),
                  "pulled_at": time.time()}
        path = self.manifest_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
        return self._stored(path, record)

    def _absolute(self, path: str) -> str:
        # registry blobs are recorded relative to the root, so a moved store still works
        return str(self.root / path) if not os.path.isabs(path) else path

    def _stored(self, manifest: Path, record: dict) -> StoredModel:
        model = record["model"]
        return StoredModel(name=record["name"], path=self._absolute(model["path"]), digest=model["digest"],
                           size=int(model["size"]), source=record["source"], pulled_at=float(record["pulled_at"]),
                           manifest=manifest, details=record.get("details") or {},
                           files={role: self._absolute(f["path"]) for role, f in (record.get("files") or {}).items()})

    def _read(self, manifest: Path) -> StoredModel | None:
        try:
            return self._stored(manifest, json.loads(manifest.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the unreadable model manifest %s: %s", manifest, e)
            return None

    def _manifests(self) -> list[Path]:
        return sorted((self.root / "manifests").glob("*/*/*/*.json"))

    def find(self, ref: ModelRef) -> StoredModel | None:
        """The stored model of a reference, its name compared without case."""
        exact = self.manifest_path(ref)
        if exact.is_file():
            return self._read(exact)
        key = ref.key()
        for manifest in self._manifests():
            host, namespace, name = manifest.parts[-4:-1]
            if f"{host}/{namespace}/{name}:{manifest.stem}".lower() == key:
                return self._read(manifest)
        return None

    def find_name(self, name: str) -> StoredModel | None:
        """The stored model a user-typed name means, or None (also for what is no reference)."""
        try:
            return self.find(parse_reference(name))
        except ValueError:
            return None

    def list(self) -> list[StoredModel]:
        """Every stored model whose manifest reads (and whose GGUF is still there)."""
        found = [self._read(m) for m in self._manifests()]
        return [m for m in found if m is not None and os.path.exists(m.path)]

    def delete(self, model: StoredModel) -> None:
        """Forget a stored model: its manifest, then the files no other manifest uses."""
        model.manifest.unlink(missing_ok=True)
        for parent in list(model.manifest.parents)[:3]:   # empty name/namespace/host folders
            try:
                parent.rmdir()
            except OSError:
                break
        still_used = {p for m in self.list() for p in [m.path, *m.files.values()]}
        for path in [model.path, *model.files.values()]:
            if path in still_used:
                continue
            if model.source == "hf" and path == model.path:
                remove_hub_file(Path(path))
            else:
                Path(path).unlink(missing_ok=True)


def remove_hub_file(link: Path) -> None:
    """Remove a file from Hugging Face's cache: the snapshot's link, and its blob once no
    other snapshot of the repository links to it."""
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        return
    blob = _link_target(link)
    link.unlink()
    repo = blob.parent.parent   # models--USER--REPO/blobs/<etag>
    others = [p for p in (repo / "snapshots").rglob("*") if p.is_symlink() and _link_target(p) == blob]
    if not others:
        # the blob itself, never what it may link to (huggingface_hub's store shared across repositories)
        blob.unlink(missing_ok=True)


def _link_target(link: Path) -> Path:
    """Where a symbolic link points, one level deep."""
    return Path(os.path.normpath(link.parent / os.readlink(link)))
