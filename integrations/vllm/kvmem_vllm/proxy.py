"""Prefill/decode split behind one endpoint: ``python -m kvmem_vllm.proxy --prefill URL --decode URL``.

Two vLLM servers share kvmem's tiers (the same ``path`` on one machine, or the same Redis): one with
``kv_role="kv_producer"`` computes prompts, the other with ``"kv_consumer"`` decodes them with the prompt's KV
loaded through kvmem. For each completion request this proxy (the shape of vLLM's disaggregated-serving
examples):

1. sends it to the prefill server with ``max_tokens=1`` (no streaming): the prompt is computed and its
   chunks saved; the reply's ``kv_transfer_params`` say how many of its blocks were stored;
2. sends the request as it came, with those ``kv_transfer_params``, to the decode server, which waits for
   those blocks (its saves may still be on their way: ``handoff_wait_s``), loads them and decodes; its reply
   (streamed or not) is the client's.

``POST /v1/completions`` and ``/v1/chat/completions`` take that path; every other request goes to the decode
server as it is. Standard library only: one thread a request.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ProxyServer", "main"]

_SPLIT = ("/v1/completions", "/v1/chat/completions")
_TIMEOUT_S = 600.0
_HOP_HEADERS = frozenset({"connection", "transfer-encoding", "keep-alive", "content-length"})


class ProxyServer(ThreadingHTTPServer):
    """An HTTP server that splits completion requests between a prefill and a decode vLLM server.

    Args:
        address: ``(host, port)`` to listen on.
        prefill: the prefill server's base URL (``http://host:port``).
        decode: the decode server's base URL.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str) -> None:
        super().__init__(address, _Handler)
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._relay(self._request(self.server.decode, None))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.split("?")[0]
        if path not in _SPLIT:
            self._relay(self._request(self.server.decode, body))
            return
        try:
            request = json.loads(body)
        except json.JSONDecodeError as exc:
            self._error(400, f"the request body is not JSON: {exc}")
            return
        if not isinstance(request, dict):
            self._error(400, "the request body is not a JSON object")
            return
        prefill = {**request, "max_tokens": 1, "stream": False}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        try:
            with urllib.request.urlopen(self._request(self.server.prefill, prefill), timeout=_TIMEOUT_S) as reply:
                params = json.loads(reply.read()).get("kv_transfer_params")
        except urllib.error.HTTPError as exc:  # NOTE: a bad request: the client gets the prefill server's answer
            self._relay_response(exc)
            return
        except OSError as exc:
            self._error(502, f"the prefill server at {self.server.prefill} failed: {exc}")
            return
        self._relay(self._request(self.server.decode, {**request, "kv_transfer_params": params}))

    def _request(self, base: str, body: bytes | dict[str, Any] | None) -> urllib.request.Request:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}
        return urllib.request.Request(base + self.path, data=data, headers=headers, method=self.command)

    def _relay(self, request: urllib.request.Request) -> None:
        """Send ``request`` and pass its reply on as it comes (a stream chunk by chunk)."""
        try:
            reply = urllib.request.urlopen(request, timeout=_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            self._relay_response(exc)
            return
        except OSError as exc:
            self._error(502, f"the decode server at {self.server.decode} failed: {exc}")
            return
        with reply:
            self._relay_response(reply)

    def _relay_response(self, reply: Any) -> None:
        self.send_response(reply.status)
        for key, value in reply.headers.items():
            if key.lower() not in _HOP_HEADERS:
                self.send_header(key, value)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while chunk := reply.read1(65536) if hasattr(reply, "read1") else reply.read(65536):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _error(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "code": status}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # NOTE: no access log on stderr per request
        pass


def main(argv: Sequence[str] | None = None) -> None:
    """Run the proxy until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill (kv_producer) server, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="the decode (kv_consumer) server, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = ProxyServer((args.host, args.port), args.prefill, args.decode)
    print(
        f"kvmem_vllm.proxy on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}", flush=True
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
