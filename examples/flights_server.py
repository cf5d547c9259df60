"""A tiny flight-search HTTP service on loopback, for the ``search_flights`` http tool.

Run it next to a workflow: ``python examples/flights_server.py &`` (port 8765), or in Python:
``with serving(): ...``. Standard library only.
"""

from __future__ import annotations

import json
import sys
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PORT = 8765


class FlightsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urlsplit(self.path)
        to = parse_qs(url.query).get("to", [""])[0]
        if url.path != "/flights":
            return self.reply(404, {"status": "error", "error": f"no such path {url.path}"})
        if not to:
            return self.reply(400, {"status": "error", "error": "give the destination as ?to="})
        code = zlib.crc32(to.lower().encode()) % 900 + 100
        flights = [f"AF{code} 08:15", f"AF{code + 1} 17:40"]
        return self.reply(200, {"status": "ok", "id": code, "to": to, "flights": flights})

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # keep the console quiet
        pass


@contextmanager
def serving(port: int = PORT) -> Iterator[ThreadingHTTPServer]:
    """The service on 127.0.0.1:``port`` in a background thread, for the block's duration."""
    server = ThreadingHTTPServer(("127.0.0.1", port), FlightsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else PORT
    print(f"flights service on http://127.0.0.1:{port}/flights", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), FlightsHandler).serve_forever()
