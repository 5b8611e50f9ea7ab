"""A local stand-in for the Hugging Face Hub's HTTP API (what `huggingface_hub` calls for
`list_repo_tree`, `repo_info`, `snapshot_download` and `hf_hub_download`), serving files from
memory on 127.0.0.1: brisk's Hub downloads are tested against it through `HF_ENDPOINT`, with no
network. It records requests and the byte offsets of resumed downloads, and can drop a download's
connection partway."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[str] = []
        self.ranges: list[tuple[str, int]] = []  # (file, first byte) of each resumed download
        self.drop_after: dict[str, int] = {}  # file -> bytes after which its next download's connection drops
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "HubStandIn":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _serve(self, head: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                api = re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(/.*)?$", path)
                if api:
                    return self._api(api.group(1), api.group(2))
                resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if resolve:
                    return self._file(resolve.group(1), resolve.group(3), head)
                self._json(404, {"error": "not found"})

            def _json(self, status: int, body, headers: dict | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _api(self, repo: str, kind: str):
                files = hub.repos.get(repo)
                if files is None:
                    return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                if kind == "revision":
                    return self._json(200, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                            "siblings": [{"rfilename": f} for f in files]})
                return self._json(200, [{"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                                         "path": f} for f, data in files.items()])

            def _file(self, repo: str, filename: str, head: bool):
                data = hub.repos.get(repo, {}).get(filename)
                if data is None:
                    return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                start = 0
                ranged = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if ranged and not head:
                    start = int(ranged.group(1))
                    hub.ranges.append((filename, start))
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                cut = hub.drop_after.pop(filename, None)
                if cut is not None:  # the network drops mid-file
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        return Handler
