"""A real uvicorn server on a loopback port for the HTTP tests, and waits on its pool."""

import socket
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A uvicorn server on a thread; stopped by close()."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + 120   # a deadline for a hang, not a timing assumption
        while time.monotonic() < end:
            if self.server.started:
                return
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


def pool_used(url) -> int:
    return httpx.get(f"{url}/api/pool").json()["stats"]["blocks_used"]


def wait_pool_empty(url, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pool_used(url) == 0:
            return True
        time.sleep(0.1)
    return False
