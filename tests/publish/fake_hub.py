"""A loopback HTTP server that speaks the part of the Hugging Face Hub API an upload uses.

Endpoints follow what huggingface_hub sends (hf_api.create_repo/create_branch, _commit_api._fetch_upload_modes,
lfs.post_lfs_batch_info + basic PUT transfer, _commit_api._send_commit NDJSON, hf_api._validate_yaml, repo_info):
it stores LFS objects by sha256 (verifying the bytes), applies commits, and records every request with the
Authorization header it carried — so tests can check what reached the "Hub" and how the token travelled.
Loopback only (127.0.0.1, OS-chosen port); one instance per test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".png")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    private: bool = False
    branches: set[str] = field(default_factory=lambda: {"main"})
    files: dict[str, dict[str, dict]] = field(default_factory=dict)  # branch -> path -> {"oid", "size", "lfs"}
    commits: list[dict] = field(default_factory=list)


@dataclass
class FakeHubState:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, authorization
    lfs_puts: list[str] = field(default_factory=list)
    fail_commits: int = 0  # answer this many commit requests with 500 (interruption)


class _Handler(BaseHTTPRequestHandler):
    state: FakeHubState
    base_url: str

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: dict | list | None = None) -> None:
        data = json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> str:
        path = urlsplit(self.path).path
        self.state.requests.append((self.command, path, self.headers.get("Authorization")))
        return path

    def do_GET(self) -> None:  # noqa: N802
        path = self._record()
        m = re.fullmatch(r"/api/models/(.+?/.+?)(?:/revision/(.+))?", path)
        if m and m.group(1) in self.state.repos:
            repo = self.state.repos[m.group(1)]
            branch = unquote(m.group(2) or "main")
            sha = repo.commits[-1]["oid"] if repo.commits else "0" * 40
            siblings = [{"rfilename": p} for p in repo.files.get(branch, {})]
            return self._send(200, {"id": m.group(1), "sha": sha, "private": repo.private, "siblings": siblings})
        self._send(404, {"error": f"not found: {path}"})

    def do_PUT(self) -> None:  # noqa: N802
        path = self._record()
        m = re.fullmatch(r"/lfs-storage/([0-9a-f]{64})", path)
        if not m:
            return self._send(404, {"error": "unknown upload url"})
        data = self._body()
        if hashlib.sha256(data).hexdigest() != m.group(1):
            return self._send(400, {"error": "sha256 mismatch"})
        self.state.lfs_objects[m.group(1)] = data
        self.state.lfs_puts.append(m.group(1))
        self._send(200)

    def do_POST(self) -> None:  # noqa: N802
        path = self._record()
        body = self._body()
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            # huggingface_hub >= 1 sends "visibility", older versions "private".
            private = bool(payload.get("private")) or payload.get("visibility") == "private"
            self.state.repos.setdefault(repo_id, FakeRepo(private=private))
            return self._send(200, {"url": f"{self.base_url}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            return self._send(200, {"errors": [], "warnings": []})
        m = re.fullmatch(r"/api/models/(.+?/.+?)/branch/(.+)", path)
        if m:
            self._repo(m.group(1)).branches.add(unquote(m.group(2)))
            return self._send(200)
        m = re.fullmatch(r"/api/models/(.+?/.+?)/preupload/(.+)", path)
        if m:
            files = self._repo(m.group(1)).files.get(unquote(m.group(2)), {})
            out = []
            for f in json.loads(body)["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES)
                remote = files.get(f["path"])
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": remote["oid"] if remote else None})
            return self._send(200, {"files": out})
        m = re.fullmatch(r"/(.+?/.+?)\.git/info/lfs/objects/batch", path)
        if m:
            objects = []
            for obj in json.loads(body)["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in self.state.lfs_objects:  # the Hub omits `actions` for blobs it already has
                    entry["actions"] = {"upload": {"href": f"{self.base_url}/lfs-storage/{obj['oid']}"}}
                objects.append(entry)
            return self._send(200, {"transfer": "basic", "objects": objects})
        m = re.fullmatch(r"/api/models/(.+?/.+?)/commit/(.+)", path)
        if m:
            if self.state.fail_commits > 0:
                self.state.fail_commits -= 1
                return self._send(500, {"error": "simulated interruption"})
            return self._commit(m.group(1), unquote(m.group(2)), body)
        self._send(404, {"error": f"not found: {path}"})

    def _repo(self, repo_id: str) -> FakeRepo:
        if repo_id not in self.state.repos:
            raise KeyError(repo_id)
        return self.state.repos[repo_id]

    def _commit(self, repo_id: str, branch: str, body: bytes) -> None:
        repo = self._repo(repo_id)
        files = repo.files.setdefault(branch, {})
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        for item in lines:
            value = item["value"]
            if item["key"] == "file":
                data = base64.b64decode(value["content"])
                files[value["path"]] = {"oid": git_blob_sha1(data), "size": len(data), "lfs": False, "data": data}
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.state.lfs_objects:
                    return self._send(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = {"oid": value["oid"], "size": value["size"], "lfs": True}
        oid = hashlib.sha1(body).hexdigest()
        repo.commits.append({"oid": oid, "branch": branch, "header": lines[0]["value"], "n": len(lines) - 1})
        self._send(200, {"commitUrl": f"{self.base_url}/{repo_id}/commit/{oid}", "commitOid": oid})


class FakeHub:
    """`with FakeHub() as hub:` → `hub.url` for HfApi(endpoint=...), `hub.state` to inspect."""

    def __init__(self) -> None:
        self.state = FakeHubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        handler.base_url = self.url
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, dict]:
        return self.state.repos[repo_id].files.get(branch, {})

    def file_bytes(self, repo_id: str, path: str, branch: str = "main") -> bytes:
        entry = self.files(repo_id, branch)[path]
        return self.state.lfs_objects[entry["oid"]] if entry["lfs"] else entry["data"]
