"""Which SGLang server a request goes to, when a process may ask several (`target.sglang.url` lists them, with the
`mooncake` transport): round robin from the process's own rank, so the ranks spread over the servers, and past a
server that died or stopped answering, which is retried after `retry_after_s` (a restarted server rejoins).

A request that failed on a server is sent again to the next one whole: the caller plans its batches, so a
failover changes which machine computes a batch, never which samples it holds (none lost, none trained twice).
"""

from __future__ import annotations

import http.client
import logging
import socket
import time
import urllib.error

from eagle3.targets.sglang_server import ServerError

log = logging.getLogger("eagle3")


def server_gone(e: BaseException) -> bool:
    """Whether an error of a request means the server is not there for it (dead, unreachable, not answering, or
    answering 5xx while it goes down), as opposed to a request the server refused (4xx) or answered wrongly."""
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500
    if isinstance(e, RuntimeError) and " HTTP 5" in str(e):  # eagle3.targets.sglang_server.http_json's
        return True
    return isinstance(e, (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError,
                          socket.timeout, OSError))


class ServerPool:
    """The servers one process asks, in turn, skipping those that failed recently."""

    def __init__(self, urls: list[str], start: int = 0, retry_after_s: float = 60.0, wait_s: float = 600.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.retry_after_s, self.wait_s = retry_after_s, wait_s
        self._next = start % len(self.urls)
        self._down: dict[str, float] = {}
        self.failovers = 0

    def pick(self) -> str:
        """The next server to ask; when every one failed recently, the one that failed first, once `retry_after_s`
        has passed since (at most `wait_s` in all: then there is no server to ask)."""
        t0 = time.monotonic()
        while True:
            now = time.monotonic()
            for i in range(len(self.urls)):
                url = self.urls[(self._next + i) % len(self.urls)]
                if self._down.get(url, 0.0) <= now:
                    self._next = (self._next + i + 1) % len(self.urls)
                    return url
            if now - t0 > self.wait_s:
                raise ServerError(f"none of the {len(self.urls)} SGLang server(s) of target.sglang.url answers "
                                  f"({', '.join(self.urls)}); {self.failovers} failover(s) so far: restart them "
                                  "(`eagle3 sglang serve --config ...`) and re-run the same command to resume")
            time.sleep(min(1.0, max(0.05, min(self._down.values()) - now)))

    def failed(self, url: str, why: BaseException | str) -> None:
        """`url` did not serve a request: its next ones go to the others for `retry_after_s`."""
        self.failovers += 1
        self._down[url] = time.monotonic() + self.retry_after_s
        others = len(self.urls) - 1
        log.warning("SGLang server %s failed a request (%s): %s (%d failover(s) so far)", url, why,
                    f"sent to the other {others} server(s)" if others else
                    f"retried in {self.retry_after_s:.0f} s", self.failovers)

    def alive(self, url: str) -> None:
        self._down.pop(url, None)
