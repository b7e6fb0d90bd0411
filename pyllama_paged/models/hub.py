"""The Hugging Face Hub as a model source, through huggingface_hub (as llama-cpp-python
uses it): the repository's file list, the choice of one GGUF, hf_hub_download into
Hugging Face's own cache layout, and a sha256 check against what the Hub publishes.

NOTE(hub): huggingface_hub 2.x writes each download to a file unique to the process and
deletes it when the download fails, so a Hub download resumes (with HTTP Range) only
within one call, across dropped connections; a new pull starts the file over."""

from __future__ import annotations

import fnmatch
import inspect
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import urlsplit

from .._version import __version__
from ..errors import DownloadError, IntegrityError, ModelNotFoundError, PagedError, RequestError
from .download import (DownloadCancelled, Progress, Reporter, StorageError, check_declared_size, file_sha256,
                       not_gguf, plan_deadline, blob_deadline)
from .egress import Unreachable
from .hub_guard import check_now, guarded
from .refs import ModelRef
from .store import ModelStore, StoredModel, hub_cache_dir, remove_hub_file

ENDPOINT_ENV = "HF_ENDPOINT"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_UNSAFE_TAG = re.compile(r"[^A-Za-z0-9._-]")


def hub_endpoint() -> str:
    """The Hub's URL: HF_ENDPOINT read now (huggingface_hub reads it once, at import)."""
    return (os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class HubFile:
    """A file of a repository: its path in the repository, size, and sha256 (LFS files only)."""

    name: str
    size: int | None
    sha256: str | None
    blob_id: str | None = None

    @property
    def digest(self) -> str:
        """sha256:<hex> for LFS files, the git blob id otherwise."""
        return f"sha256:{self.sha256}" if self.sha256 else f"git:{self.blob_id or ''}"


def _failure(e: Exception, what: str) -> PagedError:
    """huggingface_hub's errors (and its HTTP client's) as ours, naming what was asked."""
    from huggingface_hub import errors as hf

    if isinstance(e, PagedError):
        return e
    if isinstance(e, hf.GatedRepoError):
        return DownloadError(f"{what}: the repository is gated; accept its terms on the Hub and set HF_TOKEN")
    if isinstance(e, hf.LocalEntryNotFoundError):
        return DownloadError(f"{what}: cannot reach {hub_endpoint()} and the file is not in the cache")
    # the names of "no such file" moved between huggingface_hub releases
    missing = tuple(c for c in (getattr(hf, n, None) for n in ("RepositoryNotFoundError", "RevisionNotFoundError",
                                                               "RemoteEntryNotFoundError", "EntryNotFoundError"))
                    if isinstance(c, type))
    if isinstance(e, missing):
        return ModelNotFoundError(f"{what} not found on {hub_endpoint()} ({type(e).__name__})")
    # the status code only: the Hub's (or whatever answered's) own text is not repeated
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status is not None:
        return DownloadError(f"{what}: {hub_endpoint()} answered HTTP {status}")
    if isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "ssl"):
        return Unreachable(f"{what}: cannot reach {urlsplit(hub_endpoint()).hostname}")
    return DownloadError(f"{what}: {type(e).__name__} from {hub_endpoint()}")


def repo_files(repo_id: str, revision: str = "main", should_stop: Callable[[], bool] | None = None
               ) -> tuple[str, dict[str, HubFile]]:
    """(commit, path -> HubFile) of a model repository, sizes and sha256 included (within
    the planning deadline, under the pull's host rules)."""
    from huggingface_hub import HfApi

    try:
        with guarded(plan_deadline(), should_stop):
            info = HfApi(endpoint=hub_endpoint(), library_name="pyllama-paged", library_version=__version__) \
                .model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:   # the boundary with the Hub's client: every failure gets our shape
        raise _failure(e, f"Hugging Face repository {repo_id}") from None
    files = {}
    for s in info.siblings or []:
        lfs = s.lfs
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        size = s.size if s.size is not None else getattr(lfs, "size", None)
        files[s.rfilename] = HubFile(s.rfilename, size, sha if sha and _SHA256.fullmatch(sha) else None, s.blob_id)
    return info.sha or revision, files


def match_glob(names: list[str], pattern: str) -> list[str]:
    """The names whose path or base name matches the glob, without case (from_pretrained's rule)."""
    p = pattern.lower()
    return sorted(n for n in names if fnmatch.fnmatch(n.lower(), p) or fnmatch.fnmatch(PurePosixPath(n).name.lower(), p))


def _models(names: list[str]) -> dict[str, list[str]]:
    """GGUFs grouped by model: the parts of a split file (-00001-of-0000N) are one."""
    groups: dict[str, list[str]] = {}
    for n in sorted(names):
        m = _SPLIT.match(n)
        groups.setdefault(m.group(1) if m else n, []).append(n)
    return groups


def split_parts(repo_id: str, parts: list[str], names: list[str]) -> list[str]:
    """A chosen GGUF and, for a part of a split (-00001-of-0000N), every part in order, all
    found among the repository's names; a clear error for a part that is missing."""
    m = _SPLIT.match(parts[0])
    if m is None and len(parts) == 1:
        return parts
    if m is None:
        raise RequestError(f"several files of {repo_id} match: {', '.join(parts)}")
    prefix, count = m.group(1), int(m.group(3))
    by_lower = {n.lower(): n for n in names}
    wanted = [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [w for w in wanted if w.lower() not in by_lower]
    if count < 1 or missing:
        raise ModelNotFoundError(f"{repo_id}: the split GGUF {prefix} has {count} parts, but "
                                 f"{', '.join(missing) or 'its count'} is not in the repository")
    return [by_lower[w.lower()] for w in wanted]


def choose_quant(files: list[str], quant: str | None, repo_id: str) -> list[str]:
    """The one GGUF of a repository whose name has QUANT (default Q4_K_M, else the only one):
    its file, or a split's parts in order; a clear error for none, several or a missing part."""
    ggufs = [n for n in files if n.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(n).name.lower()]
    if not ggufs:
        raise ModelNotFoundError(f"{repo_id} has no .gguf file")
    wanted = quant or DEFAULT_QUANT
    hits = [n for n in ggufs if wanted.lower() in PurePosixPath(n).name.lower()]
    # Q6_K is in Q6_K_L's name too: a quant that ends where the name's part ends wins
    whole = re.compile(rf"(^|[-_.]){re.escape(wanted)}([-.]|$)", re.IGNORECASE)
    hits = [n for n in hits if whole.search(PurePosixPath(n).name)] or hits
    if not hits and quant is None and len(_models(ggufs)) == 1:
        hits = ggufs
    if not hits:
        raise ModelNotFoundError(f"no .gguf of {repo_id} has {wanted!r} in its name; there are: {', '.join(ggufs)}")
    groups = _models(hits)
    if len(groups) > 1:
        raise RequestError(f"{wanted!r} matches several files of {repo_id}: {', '.join(hits)}; "
                           "name one with a longer QUANT")
    return split_parts(repo_id, next(iter(groups.values())), files)


def choose_glob(files: list[str], pattern: str, repo_id: str) -> list[str]:
    """The one file of a repository that matches a glob (a split's parts in order when it
    matches parts of one); a clear error otherwise."""
    hits = match_glob(files, pattern)
    if not hits:
        ggufs = [n for n in files if n.lower().endswith(".gguf")]
        raise ModelNotFoundError(f"no file of {repo_id} matches {pattern!r}; its .gguf files: "
                                 f"{', '.join(ggufs) or 'none'}")
    groups = _models(hits)
    if len(groups) > 1:
        raise RequestError(f"several files of {repo_id} match {pattern!r}: {', '.join(hits)}")
    return split_parts(repo_id, next(iter(groups.values())), files)


def tag_for_file(name: str) -> str:
    """A registry-style tag for a chosen file: its stem (which also works as a QUANT)."""
    stem = PurePosixPath(name).name
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    tag = _UNSAFE_TAG.sub("-", stem)[:128]
    return tag if tag and tag[0] not in ".-" else f"f{tag}"[:128]


def _bar_class(report: Reporter, should_stop: Callable[[], bool] | None):
    """A stand-in for tqdm that huggingface_hub drives (its tqdm_class hook): bytes go to
    report, and should_stop() aborts the download."""

    class ByteBar:
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.n, self.total = initial or 0, total
            report.update(self.n, total or 0, force=True)

        def update(self, n=1):
            self.n += n
            report.update(self.n, self.total or 0)
            if should_stop and should_stop():
                raise DownloadCancelled(f"download stopped at byte {self.n}")
            check_now()

        def update_transfer(self, n=1):
            pass   # xet's network bytes: the bytes written (update) are what is reported

        def reset(self, total=None):
            self.n, self.total = 0, total if total is not None else self.total

        def set_postfix_str(self, *args, **kwargs):
            pass

        set_transfer_postfix_str = set_description = set_postfix_str

        def refresh(self, *args, **kwargs):
            pass

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return ByteBar


def download_file(repo_id: str, file: HubFile, *, cache_dir=None, local_dir=None, progress: Progress | None = None,
                  should_stop: Callable[[], bool] | None = None) -> str:
    """hf_hub_download of one file, then its sha256 checked against the Hub's (an LFS file's,
    or an ETag that is one); a mismatch deletes the file. Returns its path."""
    from huggingface_hub import hf_hub_download

    what = f"{repo_id}/{file.name}"
    report = Reporter(progress, f"pulling {file.digest.split(':', 1)[1][:12]}", file.size or 0)
    options = {}
    if "tqdm_class" in inspect.signature(hf_hub_download).parameters:   # older releases report no bytes
        options["tqdm_class"] = _bar_class(report, should_stop)
    try:
        with guarded(blob_deadline(file.size), should_stop):
            path = hf_hub_download(repo_id, file.name, revision="main", endpoint=hub_endpoint(),
                                   cache_dir=None if local_dir is not None else str(hub_cache_dir(cache_dir)),
                                   local_dir=local_dir, library_name="pyllama-paged", library_version=__version__,
                                   **options)
    except Exception as e:   # the boundary with the Hub's client: every failure gets our shape
        raise _failure(e, what) from None
    size = os.path.getsize(path)
    report.update(size, size, force=True)
    expected = file.sha256
    if expected is None and os.path.islink(path) and _SHA256.fullmatch(Path(os.path.realpath(path)).name):
        expected = Path(os.path.realpath(path)).name   # the blob is named by its ETag, an LFS sha256
    if expected is not None:
        check = Reporter(progress, "verifying sha256 digest", size)
        done = [0]

        def hashed(n: int) -> None:
            done[0] += n
            check.update(done[0])

        actual = file_sha256(path, hashed)
        check.update(size, force=True)
        if actual != expected:
            remove_hub_file(Path(path))
            raise IntegrityError(f"{what}: the downloaded file has sha256 {actual}, but the Hub publishes "
                                 f"{expected}; the file was deleted")
    return path


class HubPull:
    """A pull from the Hub, planned: the reference (tag settled), commit and files (one GGUF,
    or the parts of a split GGUF in order)."""

    def __init__(self, ref: ModelRef, commit: str, files: list[HubFile]):
        self.ref, self.commit, self.files = ref, commit, files
        self.file = files[0]   # the GGUF a load opens (a split's first part)

    @property
    def layers(self) -> list[tuple[str, int | None]]:
        """(digest, size) of what is downloaded."""
        return [(f.digest, f.size) for f in self.files]

    def fetch(self, store: ModelStore, progress: Progress | None = None,
              should_stop: Callable[[], bool] | None = None) -> StoredModel:
        """Download (or find in the cache) and verify each file, then record them in the store,
        with whether this pull downloaded the first (a file that was in the cache already belongs
        to whoever put it there, and a delete leaves it). A split's later parts are the
        manifest's files "split-0000k"."""
        store.prepare()
        cached = _cached(self.ref.repo_id, self.file.name)
        paths = [self._fetch_one(f, i == 0, progress, should_stop) for i, f in enumerate(self.files)]
        path = paths[0]
        if progress:
            progress("writing manifest", 0, 0)
        previous = store.find(self.ref)
        owned = cached is None or (previous is not None and previous.owned and previous.path == path)
        parts = {f"split-{i + 1:05d}": {"path": p, "digest": f.digest}
                 for i, (p, f) in enumerate(zip(paths, self.files)) if i > 0}
        return store.write(self.ref, {"path": path, "digest": self.file.digest,
                                      "size": sum(os.path.getsize(p) for p in paths), "downloaded_here": owned},
                           parts, {"endpoint": hub_endpoint(), "repo": self.ref.repo_id, "file": self.file.name,
                                   "revision": self.commit})

    def _fetch_one(self, file: HubFile, first: bool, progress, should_stop) -> str:
        """One file downloaded and verified: a GGUF (checked from its first bytes), or removed."""
        cached = _cached(self.ref.repo_id, file.name)
        if cached is None:
            _check_space(file)
        path = download_file(self.ref.repo_id, file, progress=progress, should_stop=should_stop)
        refused = not_gguf(path, f"{self.ref.repo_id}/{file.name}")
        if refused is not None:
            if cached is None:   # ours to remove; a file that was in the cache before is someone else's
                remove_hub_file(Path(path))
            raise refused
        return path


def _cached(repo_id: str, name: str) -> str | None:
    """The file's path in Hugging Face's cache when it is there already."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, name, cache_dir=str(hub_cache_dir()), revision="main")
    return found if isinstance(found, str) else None


def _check_space(file: HubFile) -> None:
    """StorageError when the file does not fit the disk of Hugging Face's cache."""
    folder = hub_cache_dir()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if file.size is not None and file.size + (256 << 20) > free:
        raise StorageError(f"{file.name} has {file.size} bytes and the disk of {hub_cache_dir()} has {free} free")


def plan_hub(ref: ModelRef, should_stop: Callable[[], bool] | None = None) -> HubPull:
    """Settle which file a Hub reference means (one request: the repository's file list)."""
    commit, files = repo_files(ref.repo_id, should_stop=should_stop)
    names = list(files)
    chosen = choose_glob(names, ref.pattern, ref.repo_id) if ref.pattern else choose_quant(names, ref.tag, ref.repo_id)
    for name in chosen:
        check_declared_size(files[name].size, f"{ref.repo_id}/{name}")
    tag = tag_for_file(_SPLIT.sub(r"\1.gguf", chosen[0])) if ref.pattern else ref.tag or "latest"
    return HubPull(ref.with_tag(tag), commit, [files[name] for name in chosen])
