"""Stand-ins for the Hugging Face Hub and an Ollama registry on a loopback port, for the
download tests: the endpoints huggingface_hub and our registry client call (model info
with file sizes and sha256, resolve with the Hub's headers, manifests, blobs behind a
redirect), HTTP Range, and faults on demand (a connection cut after N bytes, a digest
that is not the content's)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Seen:
    """One request the server answered."""

    method: str
    path: str
    range: str | None


@dataclass
class Sources:
    """What the server holds and how it misbehaves (tests change it between pulls)."""

    hub: dict[str, dict[str, bytes]] = field(default_factory=dict)         # repo -> file -> bytes
    published_sha: dict[tuple[str, str], str] = field(default_factory=dict)  # (repo, file) -> a wrong sha256
    manifests: dict[tuple[str, str, str], dict] = field(default_factory=dict)   # (ns, name, tag) -> manifest
    blobs: dict[str, bytes] = field(default_factory=dict)                   # digest -> bytes
    cuts: dict[str, list[int]] = field(default_factory=dict)                # path suffix -> bytes before each cut
    stalls: dict[str, tuple[int, threading.Event]] = field(default_factory=dict)   # suffix -> (bytes, go on)
    trickles: dict[str, float] = field(default_factory=dict)               # suffix -> seconds between bytes
    blob_location: str | None = None   # where blob redirects point (None: this server's /cdn/)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sources: Sources

    def log_message(self, *args):   # quiet: the tests read .seen instead
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _json(self, status: int, doc, headers: dict | None = None, body: bool = True) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(raw)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(raw)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        src = self.sources
        with src.lock:
            src.seen.append(Seen(self.command, path, self.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._model_info("/".join(parts[2:4]), body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), "/".join(parts[4:]), body)
        if parts[0] == "v2" and len(parts) == 5 and parts[3] == "manifests":
            manifest = src.manifests.get((parts[1], parts[2], parts[4]))
            if manifest is None:
                return self._json(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]},
                                  body=body)
            return self._json(200, manifest, {"Content-Type": MANIFEST_TYPE}, body)
        if parts[0] == "v2" and len(parts) == 5 and parts[3] == "blobs":
            if parts[4] not in src.blobs:
                return self._json(404, {"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]}, body=body)
            # the real registry sends blobs from a CDN behind a redirect
            self.send_response(307)
            self.send_header("Location", f"{src.blob_location or '/cdn'}/{parts[4]}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if parts[0] == "cdn" and len(parts) == 2 and parts[1] in src.blobs:
            return self._send_file(path, src.blobs[parts[1]], {}, body)
        return self._json(404, {"error": f"no route {path}"}, body=body)

    def _model_info(self, repo: str, body: bool) -> None:
        files = self.sources.hub.get(repo)
        if files is None:
            return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}, body)
        siblings = []
        for name, data in files.items():
            sha = self.sources.published_sha.get((repo, name), sha256_of(data))
            siblings.append({"rfilename": name, "size": len(data), "blobId": sha[:40],
                             "lfs": {"sha256": sha, "size": len(data), "pointerSize": 134}})
        self._json(200, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings},
                   body=body)

    def _resolve(self, repo: str, name: str, body: bool) -> None:
        files = self.sources.hub.get(repo)
        if files is None:
            return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}, body)
        if name not in files:
            return self._json(404, {"error": "Entry not found"},
                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)
        data = files[name]
        sha = self.sources.published_sha.get((repo, name), sha256_of(data))
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(len(data))}
        self._send_file(f"/{repo}/resolve/{name}", data, headers, body)

    def _send_file(self, key: str, data: bytes, headers: dict, body: bool) -> None:
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(206 if m else 200)
        for k, v in headers.items():
            self.send_header(k, v)
        if m:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body or self.command == "HEAD":
            return
        trickle = next((v for k, v in self.sources.trickles.items() if key.endswith(k)), None)
        if trickle is not None:
            return self._trickle(data[start:], trickle)
        cut = self._take_cut(key)
        stall = next((v for k, v in self.sources.stalls.items() if key.endswith(k)), None)
        if stall is not None and cut is None and start < stall[0]:
            self.wfile.write(data[start:stall[0]])
            self.wfile.flush()
            stall[1].wait(60)
            start = stall[0]
        if cut is None:
            with contextlib.suppress(OSError):   # a client that went away meanwhile
                self.wfile.write(data[start:])
            return
        self.wfile.write(data[start:start + cut])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _trickle(self, data: bytes, every: float) -> None:
        """One byte at a time, slowly, until the client goes away (or a minute passes)."""
        end = time.monotonic() + 60
        with contextlib.suppress(OSError):
            for i in range(len(data)):
                if time.monotonic() > end:
                    break
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
                time.sleep(every)
        self.close_connection = True

    def _take_cut(self, key: str) -> int | None:
        with self.sources.lock:
            for suffix, cuts in self.sources.cuts.items():
                if key.endswith(suffix) and cuts:
                    return cuts.pop(0)
        return None


class ModelSources(contextlib.AbstractContextManager):
    """A fake Hub and Ollama registry on a loopback port (url); close() stops it."""

    def __init__(self):
        self.sources = Sources()
        handler = type("Handler", (_Handler,), {"sources": self.sources})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add_hub_file(self, repo: str, name: str, data: bytes, published_sha: str | None = None) -> None:
        """A file of a Hub repository; published_sha: a sha256 the Hub claims instead of the real one."""
        self.sources.hub.setdefault(repo, {})[name] = data
        if published_sha:
            self.sources.published_sha[(repo, name)] = published_sha

    def add_registry_model(self, name: str, tag: str, gguf: bytes, namespace: str = "library",
                           template: str | None = None, params: dict | None = None,
                           wrong_digest: bool = False, declared_size: int | None = None) -> str:
        """A registry model; returns the GGUF layer's digest (with wrong_digest, one that is not
        the content's; with declared_size, the manifest claims that size for it)."""
        digest = "sha256:" + sha256_of(gguf + b"x" if wrong_digest else gguf)
        self.sources.blobs[digest] = gguf
        layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": digest,
                   "size": len(gguf) if declared_size is None else declared_size}]
        for media_type, text in (("template", template), ("params", json.dumps(params) if params else None)):
            if text is not None:
                raw = text.encode()
                d = "sha256:" + sha256_of(raw)
                self.sources.blobs[d] = raw
                layers.append({"mediaType": f"application/vnd.ollama.image.{media_type}", "digest": d,
                               "size": len(raw)})
        config = b"{}"
        self.sources.manifests[(namespace, name, tag)] = {
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": "sha256:" + sha256_of(config), "size": len(config)},
            "layers": layers}
        return digest

    def cut(self, path_suffix: str, *after_bytes: int) -> None:
        """Cut the next GETs of a file whose path ends with path_suffix after these many bytes."""
        with self.sources.lock:
            self.sources.cuts.setdefault(path_suffix, []).extend(after_bytes)

    def stall(self, path_suffix: str, after_bytes: int) -> threading.Event:
        """Hold GETs of a file whose path ends with path_suffix after these many bytes until
        the returned event is set."""
        go_on = threading.Event()
        self.sources.stalls[path_suffix] = (after_bytes, go_on)
        return go_on

    def trickle(self, path_suffix: str, every: float) -> None:
        """Send GETs of a file whose path ends with path_suffix one byte every `every` seconds."""
        self.sources.trickles[path_suffix] = every

    def seen(self, method: str | None = None, contains: str = "") -> list[Seen]:
        """The requests answered so far (of a method, with a path containing some text)."""
        with self.sources.lock:
            return [s for s in self.sources.seen if (method is None or s.method == method) and contains in s.path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __exit__(self, *exc) -> None:
        self.close()
