"""Soak of ``kvtier serve``: packed pages + the prefix store (RAM, disk, Redis) under load and faults.

One ``kvtier serve smollm2-135m --pages default --store default`` server (vLLM's OpenAI server,
its default multiprocessing: API server, engine core, worker) with a small RAM budget, a disk budget
small enough to force evictions and a Redis tier on a ``redis-server`` of this script's own
(loopback, no persistence). ``--clients`` threads send streaming completions for at least
``--minutes`` and at least ``--requests`` requests:

- prompts are token ids of the books in ../shared/data/pg (read there): a pool of ``--docs``
  windows picked with Zipf weights, a random length (log-uniform), and a quarter of them a shared
  prefix of one window followed by another window, so prompts share prefixes and the store hits;
  random ``max_tokens`` (``ignore_eos``), greedy or sampled;
- ``--abort-share`` (10 %) of the requests are closed by the client after their first chunk(s)
  (they ask for 64-128 tokens, so the disconnect reaches the server while it generates);
- Redis is killed (SIGKILL) and restarted ``--redis-kills`` times (at 25 % and 70 % of the run),
  down ``--redis-down-s`` seconds each: the server must keep serving;
- once, at half time, the clients pause and ``POST /reset_prefix_cache`` (``VLLM_SERVER_DEV_MODE=1``)
  empties vLLM's own prefix cache, so what follows hits kvtier's store.

A request that is not aborted fails when its status is not 200, its stream carries an error, ends
without ``[DONE]``, or returns another number of tokens than ``max_tokens``: the target is 0. The
aborted ones must be missing from vLLM's finished-request counts (stopped in the server, not run to
their end), and no request may be left running. Sampled requests carry no ``seed``: vLLM 0.32's CPU
runner dies on a seeded request whose chunked prefill shares a step with a decoding request.
Every ``--sample-s`` seconds: the RSS of the server's processes (API server, engine core, worker;
/proc), ``/dev/shm`` in use (statvfs: the whole volume), the block folder and Redis's memory; the
slope after the warm-up (least squares, bytes per minute) is reported. Afterwards: the server's
``/metrics`` (kvtier's store counters) against the block files on disk (written - disk evictions -
corrupt = files) and the records in Redis (writes since its last restart = records, bytes = bytes),
and after shutdown no process, temporary block file or ``/dev/shm`` file left behind (block files
stay: they are the store's disk tier). Then the ``exact`` check: ``kvtier serve --store exact`` (and
``--pages exact --store exact``) vs a plain vLLM server on ``--exact-prompts`` prompts, greedy:
kvtier's computed tokens must equal vLLM's computed ones, and its tokens from the store after
``reset_prefix_cache`` must equal vLLM's own prefix hit (vLLM's hit may differ from its computed
prompt in bf16: reported too).

Progress line every 30 s; ends with one JSON line (``--out`` also writes it to
benchmarks/results/serve-soak-<date>.json). Run with the vLLM venv (scripts/test-vllm.sh sets it up)::

    .venv-vllm/bin/python benchmarks/serve_soak.py --minutes 3 --requests 300      # short
    nohup .venv-vllm/bin/python benchmarks/serve_soak.py --out > /tmp/soak.log 2>&1 &  # 30 min, 5,000

The run goes on until both targets are met: on a busy 2-core machine (~0.12 requests/s) 5,000
requests take hours, so size ``--requests`` to the machine. kvtier is imported from wherever the
venv finds it (an editable install: the working tree); ``PYTHONPATH=<snapshot>/src`` pins a commit.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PG = HERE.parents[1] / "shared" / "data" / "pg"
MODEL = "smollm2-135m"
MAX_MODEL_LEN = 4608
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}
KV = "vllm:kvtier_store_"
SERVER_PROCS = ("api_server", "engine_core", "worker")  # the server's processes counted in rss:total
_RUNNING: list = []  # servers and redis-servers started here, stopped on any exit


# --- small helpers ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_call(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{name (without _total): sum over labels}``, plus ``name{label=value}``
    entries for vLLM's finished_reason."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2) or "", float(m.group(3))
        if name.endswith("_created"):  # prometheus_client's creation timestamps
            continue
        out[name] = out.get(name, 0.0) + value
        reason = re.search(r'finished_reason="([^"]+)"', labels)
        if reason:
            key = f"{name}{{{reason.group(1)}}}"
            out[key] = out.get(key, 0.0) + value
    return out


def store_counters(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix(KV): v for k, v in metrics.items() if k.startswith(KV)}


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, value)`` points, per minute."""
    if len(points) < 3:
        return None
    ts, vs = [p[0] for p in points], [p[1] for p in points]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den


def proc_tree(root: int) -> list[int]:
    """``root`` and its descendants (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if Path(f"/proc/{pid}").exists():
            out.append(pid)
        todo += parents.get(pid, [])
    return out


def proc_mem(pid: int) -> dict[str, int] | None:
    """VmRSS / RssAnon / RssShmem in bytes, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
        m = re.search(rf"^{key}:\s+(\d+) kB", text, flags=re.M)
        out[key] = int(m.group(1)) * 1024 if m else 0
    return out


def proc_label(pid: int, root: int) -> str:
    if pid == root:
        return "api_server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid{pid}"
    if "EngineCore" in cmd or "engine_core" in cmd:
        return "engine_core"
    if "Worker" in cmd:
        return "worker"
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return cmd.split(" ", 1)[0].rsplit("/", 1)[-1][:24] or f"pid{pid}"


def shm_state() -> dict[str, int]:
    st = os.statvfs("/dev/shm")
    names = os.listdir("/dev/shm")
    return {"used": (st.f_blocks - st.f_bfree) * st.f_frsize, "files": len(names)}


def folder_state(path: Path) -> dict[str, object]:
    """Block files (``*.kvb``) under ``path``: count, bytes, distinct sizes; temporary files."""
    files = sizes = 0
    tmp = []
    seen_sizes: set[int] = set()
    if path.exists():
        for p in path.rglob("*"):
            if not p.is_file():
                continue
            if p.name.endswith(".kvb") and not p.name.startswith("."):
                try:
                    size = p.stat().st_size
                except FileNotFoundError:  # evicted by the store since the listing
                    continue
                files += 1
                sizes += size
                seen_sizes.add(size)
            else:
                tmp.append(p.name)
    return {"files": files, "bytes": sizes, "sizes": sorted(seen_sizes)[:5], "other": tmp[:10], "others": len(tmp)}


def log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# --- Redis ------------------------------------------------------------------------------------
class RedisProc:
    """A redis-server of our own on 127.0.0.1 (no persistence: a restart starts empty)."""

    def __init__(self, workdir: Path, maxmemory: int):
        self.port = free_port()
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, db: int = 0):  # noqa: ANN201
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, db=db, socket_timeout=5, socket_connect_timeout=2)

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            sys.exit("redis-server not found: apt-get install -y redis-server")
        cmd = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(self.dir), "--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        cmd += ["--protected-mode", "yes", "--logfile", str(self.dir / f"redis-{self.starts}.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.starts += 1
        if self not in _RUNNING:
            _RUNNING.append(self)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                sys.exit(f"redis-server did not start on port {self.port}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def records(self, prefix: str, db: int = 0) -> dict[str, int]:
        """Records (distinct ``kvtier:<ns>:<key>``), parts and bytes under ``prefix``, Redis's evictions."""
        r = self.client(db)
        names: dict[str, int] = {}
        parts = 0
        total = 0
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.strlen(k)
        for k, n in zip(keys, pipe.execute()):
            name = k.decode().rsplit(":", 1)[0]
            names[name] = names.get(name, 0) + 1
            parts += 1
            total += int(n)
        info = r.info()
        commands = r.info("commandstats")
        return {
            "records": len(names),
            "parts": parts,
            "bytes": total,
            "parts_per_record": sorted(set(names.values())),
            # one MULTI/EXEC per record write since this redis-server started: writes that landed
            "exec_calls": int(commands.get("cmdstat_exec", {}).get("calls", 0)),
            "used_memory": int(info.get("used_memory", 0)),
            "evicted_keys": int(info.get("evicted_keys", 0)),
            "expired_keys": int(info.get("expired_keys", 0)),
        }


# --- servers ----------------------------------------------------------------------------------
class Server:
    """A vLLM OpenAI server (``kvtier serve`` or plain) in a process of its own."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default
        env.update(BASE_ENV)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pids: set[int] = set()
        self.extra_requests = 0  # non-streaming requests of this script (settle): in vLLM's finished counts
        _RUNNING.append(self)

    def wait_ready(self, timeout: float = 900) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} server exited ({self.proc.returncode}):\n{log_tail(self.log)}")
            if time.monotonic() - t0 > timeout:
                self.stop()
                sys.exit(f"{self.name} server not ready in {timeout:.0f} s:\n{log_tail(self.log)}")
            try:
                if http_call(self.port, "GET", "/health", timeout=5)[0] == 200:
                    self.pids = set(proc_tree(self.proc.pid))
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)

    def metrics(self) -> dict[str, float]:
        status, body = http_call(self.port, "GET", "/metrics", timeout=60)
        if status != 200:
            raise RuntimeError(f"/metrics: HTTP {status}")
        return parse_metrics(body.decode())

    def memory(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for pid in proc_tree(self.proc.pid):
            self.pids.add(pid)
            mem = proc_mem(pid)
            if mem is not None:
                label = proc_label(pid, self.proc.pid)
                if label in out:
                    label = f"{label}-{pid}"
                out[label] = mem
        return out

    def stop(self, timeout: float = 120) -> dict:
        """SIGTERM, wait; returns the exit status, seconds, and processes of the server still alive."""
        t0 = time.monotonic()
        self.pids |= set(proc_tree(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        deadline = time.monotonic() + 20
        while True:
            left = [p for p in self.pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return {"exit": self.proc.returncode, "seconds": round(time.monotonic() - t0, 1), "left_processes": left}


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kvtier_cmd(
    port: int, pages: str | None, store: str, cpu_bytes: int, disk: Path, disk_bytes: int | None, remote: str | None
) -> list[str]:
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", MODEL]
    if pages:
        cmd += ["--pages", pages]
    cmd += ["--store", store, "--cpu-bytes", str(cpu_bytes), "--disk", str(disk)]
    if disk_bytes:
        cmd += ["--disk-bytes", str(disk_bytes)]
    if remote:
        cmd += ["--remote", remote]
    return cmd + vllm_flags(port)


def _shown(cmd: list[str]) -> str:
    """A server command as results show it: no path of this machine (temp folder, model folder)."""
    from kvtier.models import cache_root

    text = " ".join(cmd[2:]).replace(tempfile.gettempdir(), "$TMPDIR")
    return text.replace(str(cache_root()), "$KVTIER_MODELS")


def plain_cmd(port: int) -> list[str]:
    """vLLM's own OpenAI server on the model, no kvtier (its pages, its prefix cache)."""
    from kvtier.models import model_dir

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir(MODEL))]
    return cmd + ["--served-model-name", MODEL, "--enforce-eager"] + vllm_flags(port)


def vllm_flags(port: int) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
    ]


# --- prompts ----------------------------------------------------------------------------------
def book_tokens(model_path: str, chars: int) -> list[list[int]]:
    """Token ids of each book in ../shared/data/pg (``chars`` characters after the first 20,000)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    books = sorted(PG.glob("*.txt"))
    if not books:
        sys.exit(f"no books in {PG}")
    return [tok(b.read_text(encoding="utf-8")[20_000 : 20_000 + chars])["input_ids"] for b in books]


class Prompts:
    """Random prompts over a pool of windows of the books (Zipf-popular windows: shared prefixes)."""

    def __init__(self, books: list[list[int]], docs: int, min_len: int, max_len: int, seed: int):
        rng = random.Random(seed)
        self.docs = []
        for i in range(docs):
            ids = books[i % len(books)]
            at = rng.randrange(0, max(1, len(ids) - max_len))
            self.docs.append(ids[at : at + max_len])
        self.weights = [1.0 / (i + 1) for i in range(docs)]
        self.min_len, self.max_len = min_len, max_len

    def length(self, rng: random.Random) -> int:
        return int(math.exp(rng.uniform(math.log(self.min_len), math.log(self.max_len))))

    def draw(self, rng: random.Random) -> list[int]:
        doc = rng.choices(self.docs, self.weights)[0]
        n = self.length(rng)
        if rng.random() < 0.25 and n > 256:  # a shared prefix, then another window
            cut = rng.randrange(128, n - 64)
            other = rng.choice(self.docs)
            return doc[:cut] + other[: n - cut]
        return doc[:n]


# --- the load ---------------------------------------------------------------------------------
class Load:
    """Client threads sending streaming completions; counts, failures, latencies."""

    def __init__(self, port: int, prompts: Prompts, args: argparse.Namespace):
        self.port, self.prompts, self.args = port, prompts, args
        self.lock = threading.Lock()
        self.issued = 0
        self.stats = {"ok": 0, "aborted": 0, "abort_too_late": 0, "failed": 0, "prompt_tokens": 0, "new_tokens": 0}
        self.failures: list[dict] = []
        self.fail_kinds: dict[str, int] = {}
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.stop = threading.Event()
        self.pause = threading.Event()
        self.conns: set[http.client.HTTPConnection] = set()  # open requests (closed by halt)
        self.inflight = 0
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(args.clients)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def halt(self) -> None:
        """Stop issuing and close every open request (a failed run: the server then shuts down
        without waiting for streams that will never end)."""
        self.stop.set()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass

    def done(self) -> int:
        s = self.stats
        return s["ok"] + s["aborted"] + s["abort_too_late"] + s["failed"]

    def quiesce(self, timeout: float = 600) -> None:
        """Stop issuing new requests and wait until none is in flight."""
        self.pause.set()
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.2)

    def _next(self) -> int | None:
        while self.pause.is_set() and not self.stop.is_set():
            time.sleep(0.1)
        with self.lock:
            if self.stop.is_set():
                return None
            k = self.issued
            self.issued += 1
            self.inflight += 1
            return k

    def _client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        while True:
            k = self._next()
            if k is None:
                return
            share = self.args.abort_share
            abort = math.floor((k + 1) * share) > math.floor(k * share)  # exactly `share` of the requests
            try:
                kind, info = self._one(rng, abort)
            except Exception as err:  # noqa: BLE001 - every fault of a request is a failure to report
                kind, info = "failed", {"kind": type(err).__name__, "detail": str(err)[:300]}
            with self.lock:
                self.inflight -= 1
                self.stats[kind] += 1
                if kind == "failed":
                    self.fail_kinds[info["kind"]] = self.fail_kinds.get(info["kind"], 0) + 1
                    if len(self.failures) < 20:
                        self.failures.append({"t": round(time.monotonic() - self.t0, 1), **info})
                elif kind == "ok":
                    self.ttft.append(info["ttft"])
                    self.latency.append(info["latency"])
                    self.stats["prompt_tokens"] += info["prompt_tokens"]
                    self.stats["new_tokens"] += info["new_tokens"]

    def _one(self, rng: random.Random, abort: bool) -> tuple[str, dict]:
        ids = self.prompts.draw(rng)
        top = self.args.max_tokens
        # an aborted request asks for many more tokens than it reads (64-128: seconds of decoding here), so the
        # client's disconnect reaches the server while it generates: vLLM must stop it there
        max_tokens = rng.randint(max(64, top), max(128, 2 * top)) if abort else rng.randint(1, top)
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if rng.random() < 0.5:
            body["temperature"] = 0.0
        else:
            # no per-request `seed`: on vLLM 0.32's CPU runner a seeded request whose prefill is chunked
            # kills the engine (gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset")
            body.update(temperature=0.8, top_p=0.95)
        abort_after = rng.randint(1, 3)
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.args.request_timeout)
        with self.lock:
            self.conns.add(conn)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return "failed", {"kind": f"http_{resp.status}", "detail": resp.read()[:300].decode(errors="replace")}
            chunks, tokens, ttft, finish, usage, done = 0, 0, None, None, None, False
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return "failed", {"kind": "stream_error", "detail": json.dumps(obj)[:300]}
                usage = obj.get("usage") or usage
                for c in obj.get("choices") or []:
                    tokens += len(c.get("token_ids") or [])
                    finish = c.get("finish_reason") or finish
                if obj.get("choices"):
                    chunks += 1
                    ttft = time.monotonic() - t0 if ttft is None else ttft
                if abort and chunks >= abort_after and finish is None:
                    try:
                        conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                    except OSError:
                        pass
                    return "aborted", {}
            if not done:
                return "failed", {"kind": "no_done", "detail": f"stream ended after {chunks} chunks, {tokens} tokens"}
            if tokens != max_tokens or finish != "length":
                return "failed", {"kind": "wrong_length", "detail": f"{tokens}/{max_tokens} tokens, finish {finish}"}
            if usage and usage.get("completion_tokens") != max_tokens:
                return "failed", {"kind": "wrong_usage", "detail": json.dumps(usage)}
            info = {"ttft": ttft, "latency": time.monotonic() - t0, "prompt_tokens": len(ids), "new_tokens": tokens}
            return ("abort_too_late" if abort else "ok"), info
        finally:
            with self.lock:
                self.conns.discard(conn)
            conn.close()


class Sampler(threading.Thread):
    """Memory of the server's processes, /dev/shm, the block folder and Redis every ``every`` seconds."""

    def __init__(self, server: Server, redis: RedisProc, disk: Path, every: float, t0: float):
        super().__init__(daemon=True)
        self.server, self.redis, self.disk, self.every, self.t0 = server, redis, disk, every, t0
        self.samples: list[dict] = []
        self.errors: list[str] = []  # samples that failed (a process or file gone mid-read)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.samples.append(self.sample())
            except Exception as err:  # noqa: BLE001 - one bad sample never ends the series
                self.errors.append(f"{time.monotonic() - self.t0:.0f} s: {type(err).__name__}: {err}")
            self.halt.wait(self.every)

    def sample(self) -> dict:
        mem = self.server.memory()
        row = {"t": time.monotonic() - self.t0, "shm": shm_state()["used"], "disk": folder_state(self.disk)["bytes"]}
        for label, m in mem.items():
            row[f"rss:{label}"] = m["VmRSS"]
            row[f"anon:{label}"] = m["RssAnon"]
        row["rss:total"] = sum(m["VmRSS"] for label, m in mem.items() if label in SERVER_PROCS)
        if self.redis.up():
            try:
                row["redis"] = int(self.redis.client().info("memory")["used_memory"])
            except Exception:  # noqa: BLE001 - killed between the check and the call
                pass
        return row


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def settle(server: Server, timeout: float = 120) -> dict[str, float]:
    """Wait until kvtier's counters stop moving (the store's thread done, stats reported: a tiny
    request makes the engine report); returns the last /metrics."""
    last = None
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(3)
        http_call(server.port, "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1})
        server.extra_requests += 1
        m = server.metrics()
        now = store_counters(m)
        now.pop("ram_bytes", None)
        if now == last or time.monotonic() > deadline:
            return m
        last = now


# --- the phases -------------------------------------------------------------------------------
def soak(args: argparse.Namespace, work: Path, prompts: Prompts) -> dict:
    redis = RedisProc(work, args.redis_maxmemory)
    redis.start()
    disk = work / "blocks"
    shm_before = set(os.listdir("/dev/shm"))
    port = free_port()
    if args.plain:  # the control: the same load on vLLM alone
        cmd = plain_cmd(port)
    else:
        cmd = kvtier_cmd(port, args.pages, args.store, args.cpu_bytes, disk, args.disk_bytes, redis.url + "/0")
    server = Server("kvtier", cmd, port, work / "soak-server.log")
    print(f"soak: starting {' '.join(cmd[2:])}", flush=True)
    ready_s = server.wait_ready()
    print(f"soak: server ready in {ready_s:.0f} s (pids {sorted(server.pids)}), redis on {redis.url}", flush=True)

    load = Load(port, prompts, args)
    _RUNNING.append(load)
    sampler = Sampler(server, redis, disk, args.sample_s, time.monotonic())
    total_s = args.minutes * 60
    events = []  # (time, what) in order
    for i in range(args.redis_kills):
        at = total_s * (0.25 + 0.45 * i / max(1, args.redis_kills - 1))
        events.append((at, "redis_kill"))  # its restart is scheduled when it happens
    events.append((total_s * 0.5, "reset_prefix_cache"))
    events.sort()
    log: list[dict] = []
    writes_at_restart = 0.0
    bytes_at_restart = 0.0
    errors_at_restart = 0.0
    sampler.t0 = load.t0 = time.monotonic()
    sampler.start()
    load.start()
    next_progress = 30.0
    last_metrics: dict[str, float] = {}
    while True:
        t = time.monotonic() - load.t0
        if server.proc.poll() is not None:
            load.halt()
            sys.exit(f"soak: the server died at {t:.0f} s:\n{log_tail(server.log)}")
        while events and events[0][0] <= t:
            at, what = events.pop(0)
            row = {"t": round(t, 1), "event": what}
            if what == "redis_kill":
                redis.kill()
                events = sorted(events + [(t + args.redis_down_s, "redis_start")])
            elif what == "redis_start":
                m = store_counters(server.metrics())
                writes_at_restart, bytes_at_restart = m.get("remote_writes", 0.0), m.get("remote_bytes_written", 0.0)
                errors_at_restart = m.get("remote_errors", 0.0)
                redis.start()
            else:
                load.quiesce()
                tries = 0
                while True:
                    tries += 1
                    status, body = http_call(port, "POST", "/reset_prefix_cache")
                    ok = status == 200 and json.loads(body).get("success") is True
                    if ok or tries >= 20:
                        break
                    time.sleep(1)
                row.update(status=status, success=ok, tries=tries, paused_s=round(time.monotonic() - load.t0 - t, 1))
                load.pause.clear()
            log.append(row)
            print(
                f"soak: [{row['t']:.0f} s] {what}" + (f" -> {row}" if what == "reset_prefix_cache" else ""), flush=True
            )
        if t >= next_progress:
            next_progress += 30
            try:
                last_metrics = server.metrics()
            except Exception as err:  # noqa: BLE001 - reported, the run goes on
                print(f"soak: /metrics failed: {err}", flush=True)
            c = store_counters(last_metrics)
            s = sampler.samples[-1] if sampler.samples else {}
            st = load.stats
            print(
                f"soak: {t / 60:5.1f} min  {load.done():5d} done ({st['ok']} ok, {st['aborted']} aborted, "
                f"{st['failed']} failed)  {load.done() / max(t, 1):.2f} req/s  RSS API/engine/worker "
                f"{mib(s.get('rss:api_server'))}/{mib(s.get('rss:engine_core'))}/{mib(s.get('rss:worker'))} MiB  "
                f"shm {mib(s.get('shm'))} MiB  "
                f"store: {c.get('blocks_stored', 0):.0f} stored, {c.get('lookup_hits', 0):.0f} hits "
                f"({c.get('disk_hits', 0):.0f} disk, {c.get('remote_hits', 0):.0f} redis), "
                f"disk {mib(s.get('disk'))} MiB, {c.get('disk_evicted', 0):.0f} files evicted, "
                f"redis errors {c.get('remote_errors', 0):.0f}",
                flush=True,
            )
        if t >= total_s and load.issued >= args.requests and not events:
            break
        time.sleep(0.2)
    load.stop.set()
    for th in load.threads:
        th.join(args.request_timeout + 30)
    run_s = time.monotonic() - load.t0
    print(f"soak: load done in {run_s / 60:.1f} min; settling the store's counters ...", flush=True)
    metrics = settle(server)
    sampler.halt.set()
    sampler.join(30)
    samples = sampler.samples

    # the store's counters vs the files and the Redis records
    c = store_counters(metrics)
    namespaces = [p for p in disk.iterdir() if p.is_dir()] if disk.exists() else []
    folder = folder_state(disk)
    ns = namespaces[0].name if len(namespaces) == 1 else None
    rec = redis.records(f"kvtier:{ns}:" if ns else "kvtier:")
    record_bytes = folder["sizes"][0] if len(folder["sizes"]) == 1 else None
    written = c.get("disk_bytes_written", 0.0)
    files_written = written / record_bytes if record_bytes else None
    expected_files = (
        None if files_written is None else files_written - c.get("disk_evicted", 0) - c.get("corrupt_files", 0)
    )
    redis_writes = c.get("remote_writes", 0.0) - writes_at_restart
    redis_errors = c.get("remote_errors", 0.0) - errors_at_restart
    consistency = {
        "namespaces": [p.name for p in namespaces],
        "disk_files": folder["files"],
        "disk_bytes": folder["bytes"],
        "disk_budget": args.disk_bytes,
        "disk_within_budget": folder["bytes"] <= args.disk_bytes,
        "record_bytes": record_bytes,
        "files_written": files_written,
        "files_expected": expected_files,  # written - disk_evicted - corrupt
        "files_match": expected_files is not None and abs(expected_files - folder["files"]) < 0.5,
        "temporary_files": folder["others"],
        "redis": rec,
        "redis_writes_since_restart": redis_writes,
        "redis_bytes_since_restart": c.get("remote_bytes_written", 0.0) - bytes_at_restart,
        # every write counted since the restart landed (Redis's EXEC count), none was evicted, and
        # Redis holds whole records; a block stored again (its key already there: its prefix's
        # block was lost with a restart, so the lookup stopped before it) is a write, not a record
        "redis_overwrites": rec["exec_calls"] - rec["records"],
        # a write whose reply came after the store's timeout (remote_timeout) counts as an error there and
        # may still have landed: Redis's EXECs lie between the writes counted and those plus the errors
        "redis_errors_since_restart": redis_errors,
        "redis_match": rec["evicted_keys"] == 0
        and redis_writes - 0.5 < rec["exec_calls"] < redis_writes + redis_errors + 0.5
        and rec["records"] <= rec["exec_calls"]
        and (record_bytes is None or rec["bytes"] == rec["records"] * record_bytes),
        "ram_bytes": c.get("ram_bytes"),
        "ram_within_budget": c.get("ram_bytes", 0) <= args.cpu_bytes,
        "requests_running_after": metrics.get("vllm:num_requests_running"),
        "requests_waiting_after": metrics.get("vllm:num_requests_waiting"),
    }
    finished = {k.split("{")[1].rstrip("}"): v for k, v in metrics.items() if k.startswith("vllm:request_success{")}
    # vLLM counts finished requests by reason and leaves aborted ones out: every request the client
    # closed must be missing there (it was stopped, not run to its end)
    completed = load.stats["ok"] + load.stats["abort_too_late"] + server.extra_requests
    consistency["server_finished_equals_completed"] = sum(finished.values()) == completed
    consistency["server_completed_expected"] = completed

    # memory trends after the warm-up
    warm = args.warmup_s if args.warmup_s is not None else min(300.0, 0.2 * run_s)
    keys = sorted({k for s in samples for k in s if k.startswith(("rss:", "anon:")) or k in ("shm", "redis", "disk")})
    trends = {}
    for k in keys:
        pts = [(s["t"], s[k]) for s in samples if k in s and s["t"] >= warm]
        allv = [s[k] for s in samples if k in s]
        late = [(t, v) for t, v in pts if t >= run_s / 2]
        trends[k] = {
            "slope_bytes_per_min": None if (v := slope_per_min(pts)) is None else round(v),
            "slope_last_half_bytes_per_min": None if (v := slope_per_min(late)) is None else round(v),
            "first": allv[0] if allv else None,
            "after_warmup": pts[0][1] if pts else None,
            "last": allv[-1] if allv else None,
            "max": max(allv) if allv else None,
        }

    stop = server.stop()
    redis.stop()
    time.sleep(1)
    after = folder_state(disk)
    shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    shutdown = {
        **stop,
        "shm_files_left": shm_left,
        "temporary_files_left": after["other"],
        "block_files_after": after["files"],
        "block_files_unchanged": after["files"] == folder["files"],
    }
    lat = sorted(load.latency)
    ttft = sorted(load.ttft)

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    s = load.stats
    return {
        # the temporary folder is this machine's: named by its place, not its path
        "server": _shown(cmd),
        "ready_s": round(ready_s, 1),
        "run_s": round(run_s, 1),
        "requests": load.done(),
        "ok": s["ok"],
        "aborted": s["aborted"],
        "abort_too_late": s["abort_too_late"],
        "failed": s["failed"],
        "failure_kinds": load.fail_kinds,
        "failures": load.failures,
        "req_per_s": round(load.done() / run_s, 3),
        "prompt_tokens": s["prompt_tokens"],
        "new_tokens": s["new_tokens"],
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "latency_p50_s": pct(lat, 0.5),
        "latency_p95_s": pct(lat, 0.95),
        "faults": log,
        "server_finished": finished,
        "store_counters": c,
        "vllm_prefix_cache": {
            "queries": metrics.get("vllm:prefix_cache_queries"),
            "hits": metrics.get("vllm:prefix_cache_hits"),
        },
        "consistency": consistency,
        "warmup_s": round(warm, 1),
        "samples": len(samples),
        "sample_errors": sampler.errors[:20],
        "memory": trends,
        "shutdown": shutdown,
        "series": [{k: (round(v, 1) if k == "t" else v) for k, v in s_.items()} for s_ in samples],
    }


def exact_check(args: argparse.Namespace, work: Path, prompts: Prompts, books: list[list[int]]) -> dict:
    """Greedy tokens of kvtier ``exact`` servers (computed, then from the store after a reset of
    vLLM's prefix cache) vs a plain vLLM server's."""
    rng = random.Random(args.seed + 7)
    sample = []
    for i in range(args.exact_prompts):
        ids = books[i % len(books)]
        n = rng.randint(300, 2400)
        at = rng.randrange(len(ids) // 2, len(ids) - n)  # not the soak's windows
        sample.append(ids[at : at + n])
    body = {
        "model": MODEL,
        "max_tokens": args.exact_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    def run_all(server: Server) -> list[list[int]]:
        out = []
        for ids in sample:
            status, data = http_call(server.port, "POST", "/v1/completions", {**body, "prompt": ids}, timeout=600)
            if status != 200:
                raise RuntimeError(f"{server.name}: HTTP {status}: {data[:300]!r}")
            out.append(json.loads(data)["choices"][0]["token_ids"])
        return out

    configs = {"vllm": None}
    for name in args.exact_configs.split(","):
        configs[{"store": "kvtier-store-exact", "pages": "kvtier-pages-exact+store-exact"}[name]] = name
    results: dict[str, dict] = {}
    for name, kind in configs.items():
        port = free_port()
        if kind is None:
            cmd = plain_cmd(port)
        else:
            disk = work / f"exact-{kind}"
            cmd = kvtier_cmd(port, "exact" if kind == "pages" else None, "exact", 256 << 20, disk, None, None)
        server = Server(name, cmd, port, work / f"{name}.log")
        ready = server.wait_ready()
        computed = run_all(server)
        row = {"ready_s": round(ready, 1), "computed": computed}
        if kind is not None:
            settle(server)
            before = store_counters(server.metrics())
            status, data = http_call(port, "POST", "/reset_prefix_cache")
            row["reset"] = json.loads(data).get("success") if status == 200 else status
            row["from_store"] = run_all(server)
            after = store_counters(server.metrics())
            row["store_hits"] = after.get("lookup_hits", 0) - before.get("lookup_hits", 0)
            row["blocks_loaded"] = after.get("blocks_loaded", 0) - before.get("blocks_loaded", 0)
        else:
            row["own_prefix_hit"] = run_all(server)
        row["stop"] = server.stop()
        results[name] = row
        print(f"exact: {name} done (ready in {ready:.0f} s)", flush=True)
    computed_ref, hit_ref = results["vllm"]["computed"], results["vllm"]["own_prefix_hit"]

    def agree(a: list[list[int]], ref: list[list[int]]) -> dict:
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(q)) for p, q in zip(a, ref)]
        return {"equal": sum(f == args.exact_tokens for f in first), "of": len(ref), "first_diff": first}

    out = {
        "prompts": len(sample),
        "prompt_tokens": [len(p) for p in sample],
        "new_tokens": args.exact_tokens,
        # vLLM itself: its own prefix hit vs its computed prompt (bf16: may differ)
        "vllm_own_prefix_hit_vs_computed": agree(hit_ref, computed_ref),
    }
    for name, row in results.items():
        if name == "vllm":
            continue
        out[name] = {
            "computed_vs_vllm": agree(row["computed"], computed_ref),
            "from_store_vs_vllm_prefix_hit": agree(row["from_store"], hit_ref),
            "from_store_vs_vllm_computed": agree(row["from_store"], computed_ref),
            "reset": row["reset"],
            "store_hits": row["store_hits"],
            "blocks_loaded": row["blocks_loaded"],
            "ready_s": row["ready_s"],
            "stop": row["stop"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="run at least this long")
    ap.add_argument("--requests", type=int, default=5000, help="and at least this many requests")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--abort-share", type=float, default=0.10)
    ap.add_argument("--redis-kills", type=int, default=2)
    ap.add_argument("--redis-down-s", type=float, default=15.0)
    ap.add_argument("--redis-maxmemory", type=int, default=1 << 30)
    ap.add_argument("--pages", default="default", help="page policy of the soak server ('' for vLLM's pages)")
    ap.add_argument("--store", default="default", help="store policy of the soak server")
    ap.add_argument("--cpu-bytes", type=int, default=64 << 20, help="the store's RAM budget (bytes)")
    ap.add_argument(
        "--disk-bytes", type=int, default=96 << 20, help="the store's disk budget (bytes): forces evictions"
    )
    ap.add_argument("--docs", type=int, default=256, help="windows of the books prompts are drawn from")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument(
        "--warmup-s", type=float, default=None, help="left out of the slopes (default 20 %% of the run, <= 5 min)"
    )
    ap.add_argument("--exact-prompts", type=int, default=8)
    ap.add_argument("--exact-tokens", type=int, default=32)
    ap.add_argument(
        "--exact-configs", default="store,pages", help="'store' (--store exact), 'pages' (+ --pages exact); '' skips"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--plain",
        action="store_true",
        help="the control: the same load on plain vLLM (no kvtier) for its memory trends; the store's checks "
        "do not apply (pass --redis-kills 0 --exact-configs '')",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folder (server logs, block files)")
    ap.add_argument(
        "--out",
        nargs="?",
        const="",
        default=None,
        help="also write the JSON line to this file (default benchmarks/results/serve-soak-<date>.json)",
    )
    args = ap.parse_args()
    if args.disk_bytes <= 0 or args.cpu_bytes <= 0:
        sys.exit("--cpu-bytes and --disk-bytes must be > 0")

    from kvtier.models import model_dir

    t0 = time.monotonic()
    books = book_tokens(str(model_dir(MODEL)), 240_000)
    prompts = Prompts(
        books, args.docs, args.min_prompt, min(args.max_prompt, MAX_MODEL_LEN - args.max_tokens), args.seed
    )
    print(
        f"soak: {len(books)} books, {sum(map(len, books)):,} tokens; {args.docs} windows; {args.clients} clients, "
        f">= {args.minutes} min and >= {args.requests} requests",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("soak: terminated"))
    try:
        result = soak(args, work, prompts)
        exact = exact_check(args, work, prompts, books) if args.exact_configs else None
    except BaseException:
        print(f"soak: work folder kept: {work}", flush=True)
        raise
    finally:
        for proc in reversed(_RUNNING):  # whatever is still running (a failed phase): clients, servers, Redis
            if isinstance(proc, Load):
                proc.halt()
            else:
                proc.stop()
    cons, sd = result["consistency"], result["shutdown"]
    mem = result["memory"]
    checks = {
        "no_failed_requests": result["failed"] == 0,
        "aborts_share": round(result["aborted"] / max(1, result["requests"]), 3),
        "redis_restarts_survived": sum(e["event"] == "redis_start" for e in result["faults"]),
        "reset_prefix_cache_ok": any(e.get("success") for e in result["faults"]),
        "disk_evictions": result["store_counters"].get("disk_evicted", 0) > 0,
        "files_match_counters": cons["files_match"],
        "redis_match_counters": cons["redis_match"],
        "disk_within_budget": cons["disk_within_budget"],
        "no_request_left_running": cons["requests_running_after"] == 0,
        "aborts_stopped_in_server": cons["server_finished_equals_completed"],
        "clean_shutdown": sd["exit"] == 0 and not sd["left_processes"],
        "no_shm_file_left": not sd["shm_files_left"],
        "no_temporary_file_left": not sd["temporary_files_left"] and not cons["temporary_files"],
    }
    if exact:
        for name, row in exact.items():
            if isinstance(row, dict) and "computed_vs_vllm" in row:
                hit = row["from_store_vs_vllm_prefix_hit"]
                checks[f"{name}_equals_vllm"] = (
                    row["computed_vs_vllm"]["equal"] == row["computed_vs_vllm"]["of"] and hit["equal"] == hit["of"]
                )
    print(
        f"\nsoak: {result['requests']} requests in {result['run_s'] / 60:.1f} min ({result['req_per_s']:.2f}/s): "
        f"{result['ok']} ok, {result['aborted']} aborted, {result['failed']} failed; faults {len(result['faults'])}",
    )
    for k in ("rss:api_server", "rss:engine_core", "rss:worker", "rss:total", "anon:engine_core", "shm", "redis"):
        if k in mem:
            m = mem[k]
            print(
                f"  {k:18s} slope after warm-up {mib(m['slope_bytes_per_min'])} MiB/min, last half "
                f"{mib(m['slope_last_half_bytes_per_min'])} MiB/min "
                f"(first {mib(m['first'])}, after warm-up {mib(m['after_warmup'])}, last {mib(m['last'])} MiB)"
            )
    print(f"  checks: {json.dumps(checks)}")
    line = json.dumps(
        {
            "benchmark": "serve_soak",
            "date": datetime.date.today().isoformat(),
            "model": MODEL,
            "args": {k: v for k, v in vars(args).items() if k not in ("out", "keep")},
            "wall_s": round(time.monotonic() - t0, 1),
            "checks": checks,
            "soak": result,
            "exact": exact,
        }
    )
    print(line, flush=True)
    if args.out is not None:
        out = Path(args.out) if args.out else HERE / "results" / f"serve-soak-{datetime.date.today().isoformat()}.json"
        out.write_text(line + "\n")
        print(f"soak: wrote {out}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
