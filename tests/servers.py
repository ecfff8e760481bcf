"""Real HTTP servers standing in for what lies outside the machine: an OpenAI-compatible
LLM provider and the receiving side of effects (keeping a ledger per idempotency key)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                status, payload, headers = outer.handle(self.path, self.headers, body)
                # Bytes go out as they are (a proxy's HTML page); anything else as JSON.
                raw = isinstance(payload, bytes)
                data = payload if raw else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self):
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def handle(self, path, headers, body):  # pragma: no cover - overridden
        raise NotImplementedError


def completion(text: str, model: str = "fake-model") -> tuple[int, dict, dict]:
    """One scripted chat-completions answer (for ``FakeLLM.script``)."""
    return (
        200,
        {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(text.split())},
        },
        {},
    )


class FakeLLM(_Server):
    """Speaks the chat-completions wire format; counts every request by prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: Counter[str] = Counter()
        self.fail_next = 0  # answer 429 this many times
        self.delay = 0.0
        # Answers given, in order, before any other: (status, JSON body or raw bytes, headers).
        self.script: list[tuple[int, object, dict[str, str]]] = []
        self.requests: list[dict] = []  # every request body, in order

    def reset(self) -> None:
        with self.lock:
            self.prompts.clear()
            self.fail_next = 0
            self.delay = 0.0
            self.script.clear()
            self.requests.clear()

    @property
    def total(self) -> int:
        return sum(self.prompts.values())

    def handle(self, path, headers, body):
        if not path.endswith("/chat/completions"):
            return 404, {"error": {"message": "not found"}}, {}
        prompt = body["messages"][-1]["content"]
        with self.lock:
            self.requests.append(body)
            if self.script:
                return self.script.pop(0)
            if self.fail_next > 0:
                self.fail_next -= 1
                return 429, {"error": {"message": "rate limited"}}, {"Retry-After": "0.05"}
            self.prompts[prompt] += 1
        if self.delay:
            import time

            time.sleep(self.delay)
        text = f"answer to {prompt}"
        return (
            200,
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": body.get("model", "fake-model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": len(text.split()),
                    "total_tokens": len(prompt.split()) + len(text.split()),
                },
            },
            {},
        )


class EffectReceiver(_Server):
    """Keeps the outcome of the first request per idempotency key, as a provider would,
    and counts every request so tests can see duplicates."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: Counter[str] = Counter()
        self.outcomes: dict[str, dict] = {}

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.outcomes.clear()

    def handle(self, path, headers, body):
        key = headers.get("Idempotency-Key", "")
        with self.lock:
            self.requests[key] += 1
            if key not in self.outcomes:
                self.outcomes[key] = {"receipt": len(self.outcomes) + 1, "what": body.get("what")}
            return 200, self.outcomes[key], {}
