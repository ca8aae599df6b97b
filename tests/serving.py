"""A `pwbench serve` subprocess on a free loopback port, for the serving tests, and the one
test-only engine they inject failures with (FaultyEngine: engine moe whose step raises while a
request whose prompt starts with FAULT_MARK runs; registered only in the test's own process).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "engines" / "demo_model")
FAULT_MARK = (3, 1, 4, 1, 5, 9, 2, 6)  # a prompt starting with these ids makes FaultyEngine's step raise
# `pwbench serve` with FaultyEngine registered as engine "faulty-moe" (the CLI itself, one import earlier).
FAULTY_SERVE = ("-c", "import sys; sys.path.insert(0, 'tests'); from engines.registry import register_engine; "
                "register_engine('faulty-moe', 'serving:FaultyEngine', 'test only'); from harness.cli import main; "
                "main()")


@cache
def _faulty_engine() -> type:
    from engines.moe import MoEEngine

    class FaultyEngine(MoEEngine):
        """Engine moe whose second step with a FAULT_MARK request in flight raises (after its
        first token). Test only: never registered outside a test's server process."""

        name = "faulty-moe"

        def start(self) -> None:
            self._countdown: dict[str, int] = {}
            super().start()

        def add_request(self, request) -> None:
            super().add_request(request)
            if tuple(request.prompt_ids[:len(FAULT_MARK)]) == FAULT_MARK:
                self._countdown[request.request_id] = 2

        def step(self):
            for rid in self._countdown:
                self._countdown[rid] -= 1
                if self._countdown[rid] == 0:
                    raise RuntimeError(f"injected test fault (request {rid})")
            out = super().step()
            for o in out.outputs:
                if o.finished:
                    self._countdown.pop(o.request_id, None)
            return out

    return FaultyEngine


def __getattr__(name: str):  # the registry resolves "serving:FaultyEngine" lazily, so torch loads only then
    if name == "FaultyEngine":
        return _faulty_engine()
    raise AttributeError(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, api_key: str | None = None, faulty: bool = False) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        entry = FAULTY_SERVE if faulty else ("-m", "harness.cli")
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.log = tempfile.TemporaryFile("w+")  # the server's output, read by tests (the key must not be in it)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pwbench serve exited with {self.proc.returncode}: {self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("pwbench serve did not answer /health in 120 s")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
        req = urllib.request.Request(self.url + path, headers={**self.headers(), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def health(self) -> tuple[int, dict]:
        """(status, body) of /health; (0, {}) when nothing answers."""
        try:
            status, body = self.get("/health")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, {}
        return status, body if isinstance(body, dict) else {}

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Prometheus text -> {"name{labels}": value}."""
        req = urllib.request.Request(self.url + "/metrics", headers=self.headers())
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def post(self, path: str, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body, headers with lower-case names)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **self.headers(), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
