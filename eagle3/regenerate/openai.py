"""OpenAI-compatible chat backend (SGLang, vLLM, any `/v1/chat/completions` server), standard library only.

Threads + urllib rather than asyncio + httpx: requests to an LLM server last seconds, so a thread per in-flight
conversation costs nothing next to the server's work, and the package needs no extra dependency. Each worker
walks one conversation turn by turn (an answer must exist before the next turn can be asked); `concurrency`
workers run at once and each request goes to the least busy endpoint (ties round-robin).

Retries with exponential backoff (plus jitter; `Retry-After` honoured) on timeouts, dropped or refused
connections, 5xx and 429; any other 4xx is the request's fault and fails at once. A conversation that still
fails is reported as failed, never dropped.

Tools: a conversation's `tools` go in every request's body, its history in the OpenAI shape (assistant
`tool_calls` with id, type and function; `tool` messages with `tool_call_id` and `name`; with thinking, each answer's
`reasoning_content`), and the reply's `message.tool_calls` become the answer's calls, arguments kept as the JSON text
the server returned. The server parses the calls out of the model's text: start it with the target's tool-call
parser (Kimi-K2.5: SGLang `--tool-call-parser kimi_k2`, vLLM `--enable-auto-tool-choice --tool-call-parser kimi_k2`;
eagle3.regenerate).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

from eagle3.config import RegenerateConfig
from eagle3.data.types import ToolCall, Turn
from eagle3.regenerate.dialogue import Answer, Dialogue, Outcome, openai_messages, split_reasoning

log = logging.getLogger("eagle3")


class RequestError(Exception):
    """A request that failed; `retryable` says whether trying again could help."""

    def __init__(self, message: str, retryable: bool, retry_after_s: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0


class EndpointPool:
    """Picks the endpoint with the fewest requests in flight; ties go round-robin so load spreads evenly.

    Least-busy alone would pick a dead server every time (a refused connection frees its slot at once), so an
    endpoint that fails in a way retrying could fix is benched for a cooldown that doubles with each consecutive
    failure (`cooldown_s` .. 60 s); benched endpoints are used only when every endpoint is benched.
    """

    def __init__(self, urls: list[str], cooldown_s: float = 1.0):
        if not urls:
            raise ValueError("regenerate.endpoints: no endpoint to send requests to")
        self.endpoints = [_Endpoint(u.rstrip("/")) for u in urls]
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._next = 0

    def acquire(self) -> _Endpoint:
        with self._lock:
            n = len(self.endpoints)
            now = time.monotonic()
            order = [(self._next + i) % n for i in range(n)]
            up = [j for j in order if self.endpoints[j].down_until <= now]
            if up:
                i = min(up, key=lambda j: self.endpoints[j].in_flight)
            else:
                i = min(order, key=lambda j: self.endpoints[j].down_until)
            self._next = (i + 1) % n
            ep = self.endpoints[i]
            ep.in_flight += 1
            ep.requests += 1
            return ep

    def release(self, ep: _Endpoint, error: RequestError | None = None) -> None:
        with self._lock:
            ep.in_flight -= 1
            if error is None:
                ep.consecutive_failures = 0
                return
            ep.failures += 1
            if error.retryable:
                ep.consecutive_failures += 1
                cooldown = min(60.0, self.cooldown_s * 2 ** (ep.consecutive_failures - 1))
                ep.down_until = time.monotonic() + cooldown


def _request(url: str, body: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
    """One HTTP exchange, with every failure mapped to a RequestError that says whether to retry."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key := os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace") if e.fp else ""
        retry_after = _retry_after(e.headers.get("Retry-After") if e.headers else None)
        retryable = e.code == 429 or e.code >= 500
        raise RequestError(f"HTTP {e.code} from {url}: {detail.strip()}", retryable, retry_after) from None
    except urllib.error.URLError as e:  # refused, DNS, or a timeout while connecting
        raise RequestError(f"cannot reach {url}: {e.reason}", retryable=True) from None
    except TimeoutError:
        raise RequestError(f"no answer from {url} within {timeout_s:g}s (regenerate.timeout_s)", True) from None
    except (ConnectionError, HTTPException, OSError) as e:  # server closed the socket, reset, torn body
        raise RequestError(f"connection to {url} failed: {type(e).__name__}: {e}", retryable=True) from None
    try:
        out = json.loads(raw)
    except ValueError:
        raise RequestError(f"{url} sent a body that is not JSON: {raw[:200]!r}", retryable=True) from None
    if not isinstance(out, dict):
        raise RequestError(f"{url} sent {type(out).__name__}, expected a JSON object", retryable=True)
    return out


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class OpenAIBackend:
    """Regenerates conversations through OpenAI-compatible chat servers."""

    def __init__(self, cfg: RegenerateConfig, backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        self.cfg = cfg
        self.pool = EndpointPool(cfg.endpoints, cooldown_s=backoff_s)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.model = cfg.model or self._discover_model()

    # ------------------------------------------------------------------------------------------- preflight
    def _discover_model(self) -> str:
        """The first model the first reachable server lists (and a clear error when none answers)."""
        errors = []
        for ep in self.pool.endpoints:
            try:
                listing = self._with_retries(lambda ep=ep: _request(f"{ep.url}/models", None, self.cfg.timeout_s))[0]
                models = [m["id"] for m in listing.get("data", []) if isinstance(m, dict) and "id" in m]
                if models:
                    log.info("regenerate: using model %r served at %s", models[0], ep.url)
                    return models[0]
                errors.append(f"{ep.url}: lists no model")
            except RequestError as e:
                errors.append(str(e))
        raise RuntimeError("regenerate: no endpoint answered GET /models (set regenerate.model to skip this "
                           "check):\n  " + "\n  ".join(errors))

    # ------------------------------------------------------------------------------------------- requests
    def _with_retries(self, fn) -> tuple[Any, int]:
        """fn() retried with exponential backoff on retryable errors; returns (result, attempts)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn(), attempt
            except RequestError as e:
                if not e.retryable or attempt > self.cfg.max_retries:
                    e.attempts = attempt  # type: ignore[attr-defined]
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                delay = max(delay * (0.5 + random.random() / 2), min(e.retry_after_s or 0.0, self.max_backoff_s))
                log.warning("regenerate: %s; retry %d/%d in %.1fs", e, attempt, self.cfg.max_retries, delay)
                time.sleep(delay)

    def body(self, history: list[Turn], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        c = self.cfg
        body: dict[str, Any] = {
            "model": self.model,
            # With thinking, every answer's reasoning goes back as `reasoning_content`, as an agent sends it: the
            # server's template keeps what K2.5 keeps (an agent loop's calls' thinking) and drops the rest, so each
            # prompt is the one prepare renders for that turn (eagle3.data.templates).
            "messages": openai_messages(history, keep_reasoning=c.thinking),
            "temperature": c.temperature,
            "top_p": c.top_p,
            "max_tokens": c.max_tokens,
            # Kimi-K2.5 and DeepSeek-V3.1 read `thinking`, Qwen3 reads `enable_thinking`; templates ignore the rest.
            "chat_template_kwargs": {"thinking": c.thinking, "enable_thinking": c.thinking},
            "stream": False,
        }
        if tools:
            body["tools"] = tools
        return body

    def answer(self, history: list[Turn], tools: list[dict[str, Any]] | None = None) -> tuple[Answer, int]:
        """One assistant answer (with retries); returns (answer, attempts)."""
        body = self.body(history, tools)

        def once() -> Answer:
            ep = self.pool.acquire()
            try:
                ans = _parse_reply(_request(f"{ep.url}/chat/completions", body, self.cfg.timeout_s), ep.url)
            except RequestError as e:
                self.pool.release(ep, e)
                raise
            except BaseException:
                self.pool.release(ep)
                raise
            self.pool.release(ep)
            return ans

        return self._with_retries(once)

    def regenerate_one(self, dialogue: Dialogue) -> Outcome:
        attempts = 0
        try:
            while (history := dialogue.next_prompt()) is not None:
                ans, n = self.answer(history, dialogue.tools)
                attempts += n
                dialogue.add_answer(ans)
        except Exception as e:  # noqa: BLE001 - recorded as this conversation's failure, never lost in a thread
            attempts += getattr(e, "attempts", 1)
            turn = sum(t.role == "assistant" for t in dialogue.history) + 1
            msg = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
            if not isinstance(e, RequestError):
                log.exception("regenerate: conversation %r: unexpected error", dialogue.source.id)
            return Outcome(dialogue.source.id, error=f"answer {turn}: {msg}", attempts=attempts)
        return dialogue.outcome(attempts)

    def outcomes(self, dialogues: Iterable[Dialogue]) -> Iterator[Outcome]:
        """Outcomes in completion order; at most `concurrency` conversations in flight, a bounded queue behind."""
        limit = self.cfg.concurrency
        with ThreadPoolExecutor(max_workers=limit, thread_name_prefix="regen") as pool:
            pending: set[Future[Outcome]] = set()
            try:
                for d in dialogues:
                    if len(pending) >= 2 * limit:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                        yield from (f.result() for f in done)
                    pending.add(pool.submit(self.regenerate_one, d))
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    yield from (f.result() for f in done)
            finally:
                for f in pending:
                    f.cancel()


def _parse_reply(reply: dict[str, Any], url: str) -> Answer:
    try:
        choice = reply["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestError(f"{url}: reply has no choices[0].message: {str(reply)[:200]}", retryable=True) from None
    if not isinstance(message, dict):
        raise RequestError(f"{url}: reply's choices[0].message is not an object: {str(reply)[:200]}", True)
    content, reasoning = split_reasoning(message.get("content"), message.get("reasoning_content")
                                         or message.get("reasoning"))
    calls = _tool_calls(message.get("tool_calls"))
    usage = reply.get("usage") or {}
    prompt = usage.get("prompt_tokens")
    return Answer(content, reasoning, choice.get("finish_reason"), int(usage.get("completion_tokens") or 0),
                  int(prompt) if isinstance(prompt, int) else None, calls or (),
                  malformed_tool_calls=calls is None)


def _tool_calls(raw: Any) -> tuple[ToolCall, ...] | None:
    """`message.tool_calls` as calls; None when any of them is malformed (no function name, arguments that are not
    a JSON object: `prepare` could not read such a record back), so the answer is kept as its text alone."""
    if not raw:
        return ()
    if not isinstance(raw, list):
        return None
    calls = []
    for c in raw:
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            return None
        args = fn.get("arguments")
        if isinstance(args, dict):  # a server that sends the object instead of its text
            args = json.dumps(args, ensure_ascii=False)
        try:
            if not isinstance(args, str) or not isinstance(json.loads(args or "{}"), dict):
                return None
        except ValueError:
            return None
        cid = c.get("id")
        calls.append(ToolCall(name, args or "{}", cid if isinstance(cid, str) and cid else None))
    return tuple(calls)
