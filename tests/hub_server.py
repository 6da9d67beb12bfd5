"""A local stand-in for the Hugging Face hub, serving hub-layout repositories over HTTP.

No machine here reaches huggingface.co, so the online download path (``hf_hub_download`` and lopt's
use of it) runs against this server instead: ``huggingface_hub`` sends its requests to
``constants.ENDPOINT`` (``HF_ENDPOINT``), and the server answers them as the hub does (the requests
and headers below are those of the installed huggingface_hub's ``file_download.py``):

* ``HEAD``/``GET /{owner}/{name}/resolve/{revision}/{filename}``: a small file (``config.json``)
  is answered directly (``200``, ``ETag``, ``Content-Length``, ``X-Repo-Commit``); a large file
  (``*.safetensors``, stored with Git LFS on the hub) is a ``302`` redirect to a CDN on another
  origin, carrying ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size``, as the hub's is. A
  missing repository, revision or file is a ``404`` with the hub's ``X-Error-Code``
  (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).
* ``GET /blobs/{sha256}`` on the CDN (a second listener, so another origin: huggingface_hub does
  not follow a redirect off the hub's origin for the metadata, and downloads from the ``Location``),
  with ``Range: bytes=N-`` (``206``), which huggingface_hub sends to resume a broken download.
* ``GET /api/models/{owner}/{name}/revision/{revision}``: the repository's commit and files (what
  ``snapshot_download`` and ``model_info`` ask for; lopt's path does not).

Faults are injected per request (``fail``): an HTTP status, a body cut off half-way (the
connection is closed after half the bytes), a short body with a consistent ``Content-Length``.
Every request is recorded (``requests``) so that tests can say what went over the wire.

The server binds 127.0.0.1 only, on ports the OS picks, serves from daemon threads, and stops
itself after ``lifetime_s`` even if a test forgets to (``with HubServer() as hub:`` stops it at once).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin")  # stored with Git LFS on the hub: served through the CDN redirect
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)$")
_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<revision>[^/]+)$")
_BLOB = re.compile(r"^/blobs/(?P<sha256>[0-9a-f]{64})$")


def closed_port_endpoint() -> str:
    """``http://127.0.0.1:PORT`` of a port nothing listens on: connections to it are refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class Request:
    method: str
    path: str
    server: str  # "hub" or "cdn"
    range: str | None  # the Range header, when sent
    status: int = 0  # what was answered


@dataclass
class Fault:
    """Answer matching requests with ``action`` instead of the file, ``times`` times (None: always)."""

    method: str | None  # "HEAD", "GET" or None (both)
    server: str | None  # "hub", "cdn" or None (both)
    filename: str | None  # a file name (resolve or blob of that file), or None (every request)
    action: str  # "status", "cut" (half the body, then the connection closes), "short" (half the body, consistent)
    status: int = 500
    times: int | None = 1
    used: int = field(default=0)


class _Repo:
    def __init__(self):
        self.revisions: dict[str, str] = {}  # branch or tag -> commit
        self.commits: dict[str, dict[str, bytes]] = {}  # commit -> {filename: bytes}


class HubServer:
    """``add(repo_id, files, revision)`` then point ``HF_ENDPOINT`` (huggingface_hub's constants) at ``endpoint``."""

    def __init__(self, lifetime_s: float = 300.0):
        self._repos: dict[str, _Repo] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes (the CDN's store)
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._servers = []
        self._lifetime_s = lifetime_s
        self._timer = None

    # --------------------------------------------------------------------------------- contents

    def add(self, repo_id: str, files: dict, revision: str = "main") -> str:
        """Publish ``files`` ({filename: bytes}) as a new commit of ``repo_id`` at ``revision``; return the commit."""
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            commit = hashlib.sha1(f"{repo_id}@{revision}#{len(repo.commits)}".encode()
                                  + b"".join(hashlib.sha256(files[n]).digest() for n in sorted(files))).hexdigest()
            repo.commits[commit] = dict(files)
            repo.revisions[revision] = commit
            for data in files.values():
                self._blobs[hashlib.sha256(data).hexdigest()] = data
            return commit

    def fail(self, *, action: str = "status", status: int = 500, method: str | None = None, server: str | None = None,
             filename: str | None = None, times: int | None = 1) -> Fault:
        fault = Fault(method, server, filename, action, status, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def count(self, method: str | None = None, filename: str | None = None, server: str | None = None) -> int:
        """How many requests (of ``method``, for ``filename``, to ``server``) were received."""
        return sum(1 for r in list(self.requests)
                   if (method is None or r.method == method) and (server is None or r.server == server)
                   and (filename is None or self._filename_of(r.path) == filename))

    # ---------------------------------------------------------------------------------- serving

    @property
    def endpoint(self) -> str:
        return self._url("hub")

    def _url(self, which: str) -> str:
        server = self._servers[0 if which == "hub" else 1]
        return f"http://127.0.0.1:{server.server_address[1]}"

    def start(self) -> "HubServer":
        for name in ("hub", "cdn"):
            server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, name))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                             name=f"hub-server-{name}").start()
            self._servers.append(server)
        self._timer = threading.Timer(self._lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        """Stop listening (later connections are refused); safe to call twice."""
        servers, self._servers = self._servers, []
        for server in servers:
            server.shutdown()
            server.server_close()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------- answers

    def _filename_of(self, path: str) -> str | None:
        match = _RESOLVE.match(path.split("?")[0])
        if match:
            return match["filename"]
        match = _BLOB.match(path.split("?")[0])
        if match:
            with self._lock:
                for repo in self._repos.values():
                    for files in repo.commits.values():
                        for name, data in files.items():
                            if hashlib.sha256(data).hexdigest() == match["sha256"]:
                                return name
        return None

    def _fault_for(self, method: str, server: str, path: str) -> Fault | None:
        filename = self._filename_of(path)
        with self._lock:
            for fault in self._faults:
                if fault.times is not None and fault.used >= fault.times:
                    continue
                if fault.method not in (None, method) or fault.server not in (None, server):
                    continue
                if fault.filename not in (None, filename):
                    continue
                if fault.action in ("cut", "short") and method != "GET":
                    continue
                fault.used += 1
                return fault
        return None

    def _resolve_commit(self, repo: _Repo, revision: str) -> str | None:
        if revision in repo.revisions:
            return repo.revisions[revision]
        return revision if revision in repo.commits else None


def _handler(hub: HubServer, server_name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: after stop() nothing is served
        timeout = 10  # a client that stops reading cannot hold a thread for long

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer("HEAD")

        def do_GET(self):
            self._answer("GET")

        # ------------------------------------------------------------------------------------

        def _answer(self, method: str) -> None:
            record = Request(method, self.path, server_name, self.headers.get("Range"))
            hub.requests.append(record)
            fault = hub._fault_for(method, server_name, self.path)
            if fault is not None and fault.action == "status":
                record.status = fault.status
                return self._send(fault.status, {"X-Error-Message": "injected fault"}, b"injected fault", method)
            path = self.path.split("?")[0]
            if server_name == "cdn":
                match = _BLOB.match(path)
                data = hub._blobs.get(match["sha256"]) if match else None
                if data is None:
                    record.status = 404
                    return self._send(404, {}, b"not found", method)
                return self._send_file(record, method, data, {}, fault)
            match = _API.match(path)
            if match:
                return self._api(record, method, match)
            match = _RESOLVE.match(path)
            if not match:
                record.status = 404
                return self._send(404, {}, b"not found", method)
            repo = hub._repos.get(match["repo"])
            if repo is None:
                record.status = 404
                return self._send(404, {"X-Error-Code": "RepoNotFound",
                                        "X-Error-Message": "Repository not found"}, b"Repository not found", method)
            commit = hub._resolve_commit(repo, match["revision"])
            if commit is None:
                record.status = 404
                return self._send(404, {"X-Error-Code": "RevisionNotFound",
                                        "X-Error-Message": "Invalid rev id"}, b"Invalid rev id", method)
            files = repo.commits[commit]
            filename = match["filename"]
            if filename not in files:
                record.status = 404
                return self._send(404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit,
                                        "X-Error-Message": "Entry not found"}, b"Entry not found", method)
            data = files[filename]
            sha256 = hashlib.sha256(data).hexdigest()
            if filename.endswith(LFS_SUFFIXES):
                # as the hub: a redirect to the CDN, the LFS object's sha256 and size in X-Linked-* headers
                record.status = 302
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
                return self._send(302, {"Location": f"{hub._url('cdn')}/blobs/{sha256}?signed=1",
                                        "X-Repo-Commit": commit, "X-Linked-Etag": f'"{sha256}"',
                                        "X-Linked-Size": str(len(data)),
                                        "ETag": f'"{hashlib.sha1(pointer).hexdigest()}"'}, b"", method)
            git_sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            return self._send_file(record, method, data, {"X-Repo-Commit": commit, "ETag": f'"{git_sha}"'}, fault)

        def _api(self, record, method, match):
            repo = hub._repos.get(match["repo"])
            commit = hub._resolve_commit(repo, match["revision"]) if repo is not None else None
            if commit is None:
                record.status = 404
                code = "RepoNotFound" if repo is None else "RevisionNotFound"
                return self._send(404, {"X-Error-Code": code}, b"{}", method)
            body = json.dumps({"id": match["repo"], "modelId": match["repo"], "sha": commit,
                               "siblings": [{"rfilename": n} for n in sorted(repo.commits[commit])]}).encode()
            record.status = 200
            return self._send(200, {"Content-Type": "application/json"}, body, method)

        def _send_file(self, record, method, data: bytes, headers: dict, fault: Fault | None) -> None:
            start = 0
            requested = self.headers.get("Range")
            match = re.fullmatch(r"bytes=(\d+)-", requested or "")
            if match and method == "GET":
                start = int(match[1])
                if start >= len(data):
                    record.status = 416
                    return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"", method)
                headers = dict(headers, **{"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
            status = 206 if start else 200
            record.status = status
            body = data[start:]
            if fault is not None and fault.action == "short":  # a consistent, shorter answer
                body = body[: len(body) // 2]
            if fault is not None and fault.action == "cut":  # the full length announced, half sent, connection gone
                self.send_response(status)
                for key, value in dict(headers, **{"Content-Length": str(len(body)), "Accept-Ranges": "bytes"}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            return self._send(status, dict(headers, **{"Accept-Ranges": "bytes"}), body, method)

        def _send(self, status: int, headers: dict, body: bytes, method: str) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if method != "HEAD" and body:
                self.wfile.write(body)

    return Handler
