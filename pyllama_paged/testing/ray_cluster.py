"""A Ray cluster of real nodes on this machine for the scale-out tests and benchmark: a
head and workers, each its own `ray start --block` process (the node's raylet and agents
are its children, and stop with it), and `pyllama-paged serve --ray` against it."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from .serving import free_ports, stop_server, wait_healthy


def ray_cli() -> str:
    """The `ray` console script beside this interpreter (the venv's)."""
    return str(Path(sys.executable).with_name("ray"))


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to `ray start --block` (it stops the node's processes), then SIGKILL to what
    is left of its process group (a node that failed to start leaves its agents behind):
    only processes that `ray start` started."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class RayCluster:
    """Head plus `workers` worker nodes of `cpus` CPUs each; close() stops them. Processes
    that join it (nodes, `serve --ray`) need its env: token authentication with a token of
    its own, so nothing else on the network can submit work to it, and no token file is
    left in ~/.ray."""

    def __init__(self, workers: int = 1, cpus: int = 1, object_store_bytes: int = 100 * 2**20,
                 timeout: float = 180, keep_logs: bool = False):
        # short: Ray's socket paths live under it and must fit a Unix socket name
        self.temp_dir = tempfile.mkdtemp(prefix="rpp", dir="/tmp")
        self.keep_logs = keep_logs
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        # The head's port, and Serve's HTTP proxy's: one port for every `serve --ray` on this
        # cluster, since Serve keeps the http_options of its first start. Both are bound only
        # later, while Ray's own processes bind port 0: so from below the ephemeral range.
        self.port, self.http_port = free_ports(2, below_ephemeral=True)
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        common = ["--num-cpus", str(cpus), "--object-store-memory", str(object_store_bytes),
                  "--disable-usage-stats", "--block"]
        try:
            self._start(["--head", "--port", str(self.port), "--temp-dir", self.temp_dir,
                         "--include-dashboard", "false", *common], 1, timeout)
            for i in range(workers):
                self._start(["--address", self.address, *common], 2 + i, timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, args: list[str], nodes: int, timeout: float, tries: int = 3) -> None:
        """One `ray start`, waited for until the cluster has `nodes` nodes. Ray gives a new
        raylet 30 s to register; on a loaded machine that can run out, so a node that
        exits while starting is started again."""
        for attempt in range(tries):
            log = Path(self.temp_dir) / f"node{len(self.nodes)}.{attempt}.log"
            with open(log, "wb") as out:
                # a session of its own: close() can end the node's process group, and a Ctrl-C
                # at the terminal reaches the test, not the nodes; no stdin (a background job
                # that reads the terminal is stopped); its workers start in temp_dir, away from
                # a source tree whose pyllama_paged has no built library
                proc = subprocess.Popen([ray_cli(), "start", *args], stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
                                        cwd=self.temp_dir)
            self.logs.append(log)
            try:
                up = self._wait_nodes(proc, nodes, timeout)
            except BaseException:
                _stop(proc)
                raise
            if up:
                self.nodes.append(proc)
                return
            _stop(proc)
        raise RuntimeError(f"a ray node did not start in {tries} tries; see {', '.join(map(str, self.logs))}")

    def alive_nodes(self) -> int:
        """The nodes `ray status` counts as active (0 when it cannot answer yet)."""
        try:
            out = subprocess.run([ray_cli(), "status", "--address", self.address], stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=60, env=self.env).stdout
        except subprocess.SubprocessError:
            return 0
        active = out.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in out else ""
        return len(re.findall(r"node_[0-9a-f]+", active))

    def _wait_nodes(self, proc: subprocess.Popen, n: int, timeout: float) -> bool:
        """Whether the cluster counts n nodes before proc (the newest node) exits; a node up
        but not counted within timeout is an error."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(p.poll() is not None for p in self.nodes):
                raise RuntimeError(f"a ray node exited; see {', '.join(map(str, self.logs))}")
            if proc.poll() is not None:
                return False
            if self.alive_nodes() >= n:
                return True
            time.sleep(1)
        raise RuntimeError(f"{n} ray node(s) not up after {timeout} s; see {', '.join(map(str, self.logs))}")

    def close(self) -> None:
        """Stop the workers, then the head (and drop their logs unless keep_logs)."""
        for proc in reversed(self.nodes):
            _stop(proc)
        self.nodes.clear()
        if not self.keep_logs:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_ray_server(cluster: RayCluster, extra_args: list[str], log: Path, timeout: float = 600):
    """`pyllama-paged serve --ray` on cluster with extra_args, waited for until every
    replica answers on /ray/replicas; (process, url)."""
    url = f"http://127.0.0.1:{cluster.http_port}"
    cmd = [str(Path(sys.executable).with_name("pyllama-paged")), "serve", "--ray", cluster.address,
           "--host", "127.0.0.1", "--port", str(cluster.http_port), *extra_args]
    out = open(log, "wb")
    # run away from any source tree (whose pyllama_paged lacks the built library) like the nodes
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env=cluster.env, cwd=cluster.temp_dir)
    out.close()
    replicas = int(extra_args[extra_args.index("--replicas") + 1]) if "--replicas" in extra_args else 2
    try:
        wait_healthy(url, proc, "/health", timeout, log)
        wait_replicas(url, replicas, timeout)
    except BaseException:
        stop_ray_server(proc)
        raise
    return proc, url


def wait_replicas(url: str, n: int, timeout: float = 300) -> list[dict]:
    """/ray/replicas once it lists n replicas."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            found = httpx.get(url + "/ray/replicas", timeout=30).json()["replicas"]
            if len(found) >= n:
                return found
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{n} replicas not listed at {url}/ray/replicas after {timeout} s")


def stop_ray_server(proc: subprocess.Popen, timeout: float = 120) -> int:
    """SIGINT (drain, delete the app, exit), killed if it has not exited within timeout; its
    exit code."""
    stop_server(proc, timeout)
    return proc.returncode
