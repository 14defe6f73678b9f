"""A real ``redis-server`` for the remote tier's tests: loopback, a free port, a temp dir, no mock.

``.ci/run`` (scripts/test.sh) installs redis-server where it is missing; elsewhere the tests that
need it are skipped with the reason. :class:`RedisServer` starts, kills (SIGKILL, as a crash) and
restarts one server on the same port; ``args`` are redis-server options (``--requirepass``,
``--maxmemory``, TLS files, ...).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_redis() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis package is not installed (pip install redis)")
    return exe


class RedisServer:
    def __init__(self, folder: Path, *args: str, tls: bool = False):
        self.exe = need_redis()
        self.folder = folder
        self.args = list(args)
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def argv(self) -> list[str]:
        port = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        cmd = [self.exe, *port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        return cmd + ["--dir", str(self.folder), *self.args]

    def start(self) -> None:
        cmd = self.argv
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {' '.join(cmd)}") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start in 20 s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self, **kwargs):  # noqa: ANN003, ANN201
        import redis

        return redis.Redis.from_url(self.url, **kwargs)

    def used_memory(self) -> int:
        return int(self.client(**self.auth).info("memory")["used_memory"])

    @property
    def auth(self) -> dict:
        if "--requirepass" in self.args:
            return {"password": self.args[self.args.index("--requirepass") + 1]}
        return {}


@pytest.fixture
def redis_server(tmp_path):  # noqa: ANN001, ANN201
    server = RedisServer(tmp_path)
    yield server
    server.kill()
