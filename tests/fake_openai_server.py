"""A tiny OpenAI-compatible chat server on 127.0.0.1 for tests: scripted failures, deterministic answers.

    python tests/fake_openai_server.py --port 8011 --delay 0.1     # standalone, Ctrl-C to stop

In tests:

    with FakeOpenAIServer(delay_s=0.1) as srv:
        srv.script.extend(["500", "drop"])   # the next two chat requests fail that way, then all succeed
        ... cfg.regenerate.endpoints = [srv.url] ...

Actions for one chat request: `ok`, `500`, `503`, `429` (with Retry-After: 0), `400`, `timeout` (hang `hang_s`
seconds before answering), `drop` (close the socket without a response), `garbage` (200 with a non-JSON body).
Triggers in the last user message override the script: `ALWAYS_500`, `ALWAYS_400` (every attempt fails),
`LONG` (finish_reason "length"). The answer to a request is `A<k>: <last user message>`, where k counts the
assistant turns already in the history + 1, so a test can check what history each request carried.
With `chat_template_kwargs.thinking` the reply carries reasoning as `reasoning_style` says: `field`
(message.reasoning_content), `tags` (`<think>…</think>` in content) or `open` (`…</think>`: the prompt already
ended with `<think>`).

Tool calls, as a server started with a tool-call parser returns them: when the request carries `tools` and its
last message (a user turn or a tool result) says `CALL <name> <json object>` (several: parallel calls), the reply
is those calls (content null, finish_reason `tool_calls`, arguments the JSON text as written, ids
`functions.<name>:<n>` with n counting the calls in the history, as SGLang's kimi_k2 parser issues them);
`BAD_CALL` makes one whose arguments are not JSON (after the text `let me call`). A reply to tool results without a trigger is the text
`A<k>: after <result> + <result>...` (the results that end the history), so a test can see what was replayed.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAIServer:
    def __init__(self, delay_s: float = 0.0, hang_s: float = 2.0, model: str = "fake-model",
                 reasoning_style: str = "field", port: int = 0):
        self.delay_s, self.hang_s, self.model, self.reasoning_style = delay_s, hang_s, model, reasoning_style
        self.script: deque[str] = deque()
        self.requests: list[dict[str, Any]] = []
        """Every chat request: {"body", "action", "time"}."""
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def chat_bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r["body"] for r in self.requests]

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------------ replies
    def _next_action(self, body: dict[str, Any]) -> str:
        last_user = next((m["content"] for m in reversed(body.get("messages", [])) if m["role"] == "user"), "")
        with self.lock:
            action = self.script.popleft() if self.script else "ok"
            if "ALWAYS_500" in last_user:
                action = "500"
            elif "ALWAYS_400" in last_user:
                action = "400"
            self.requests.append({"body": body, "action": action, "time": time.time()})
        return action

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages", [])
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        k = sum(m["role"] == "assistant" for m in messages) + 1
        answer = f"A{k}: {last_user}"
        results = []
        for m in reversed(messages):
            if m["role"] != "tool":
                break
            results.insert(0, m["content"])
        if results:
            answer = f"A{k}: after {' + '.join(results)}"
        calls = _calls(messages[-1]["content"] or "", sum(len(m.get("tool_calls") or []) for m in messages)) \
            if body.get("tools") and messages else []
        if calls:
            tokens = sum(len(c["function"]["arguments"].split()) for c in calls)
            content = "let me call" if calls[0]["function"]["name"] == "broken" else None
            return self._completion({"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls",
                                    tokens)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        if (body.get("chat_template_kwargs") or {}).get("thinking"):
            thought = f"thinking about {last_user}"
            if self.reasoning_style == "field":
                message["reasoning_content"] = thought
            elif self.reasoning_style == "tags":
                message["content"] = f"<think>{thought}</think>\n\n{answer}"
            else:
                message["content"] = f"{thought}</think>{answer}"
        finish = "length" if "LONG" in last_user else "stop"
        tokens = len(message["content"].split()) + len(message.get("reasoning_content", "").split())
        return self._completion(message, finish, tokens)

    def _completion(self, message: dict[str, Any], finish: str, tokens: int) -> dict[str, Any]:
        return {"id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def _send(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                action = server._next_action(body)
                if server.delay_s:
                    time.sleep(server.delay_s)
                if action == "ok":
                    self._send(200, server.reply(body))
                elif action in ("500", "503", "400"):
                    self._send(int(action), {"error": {"message": f"scripted {action}"}})
                elif action == "429":
                    self._send(429, {"error": {"message": "rate limited"}}, {"Retry-After": "0"})
                elif action == "timeout":
                    time.sleep(server.hang_s)
                    self._send(200, server.reply(body))
                elif action == "drop":
                    self.close_connection = True  # no status line at all: the client sees the socket close
                elif action == "garbage":
                    self._send(200, b"<html>not json")
                else:
                    raise ValueError(f"unknown scripted action {action!r}")

        return Handler


_CALL = re.compile(r"CALL ([\w.\-]+) ")


def _calls(text: str, earlier: int) -> list[dict[str, Any]]:
    """The calls a message's `CALL <name> <json>` triggers ask for (`BAD_CALL`: one with broken arguments)."""
    if "BAD_CALL" in text:
        return [{"id": f"functions.broken:{earlier}", "type": "function",
                 "function": {"name": "broken", "arguments": "{city: nowhere"}}]
    out = []
    decoder = json.JSONDecoder()
    for m in _CALL.finditer(text):
        _, end = decoder.raw_decode(text, m.end())
        out.append({"id": f"functions.{m[1]}:{earlier + len(out)}", "type": "function",
                    "function": {"name": m[1], "arguments": text[m.end():end]}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--delay", type=float, default=0.0, help="seconds before every chat reply")
    p.add_argument("--reasoning-style", choices=["field", "tags", "open"], default="field")
    args = p.parse_args()
    srv = FakeOpenAIServer(delay_s=args.delay, reasoning_style=args.reasoning_style, port=args.port)
    print(f"fake OpenAI server at {srv.url}", flush=True)
    try:
        srv.httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
