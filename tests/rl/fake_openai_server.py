"""A scripted OpenAI-compatible chat server on 127.0.0.1 (free port): `script(prompt_text) -> reply text`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
  def __init__(self, script):
    self.script = script
    self.requests: list[dict] = []
    outer = self

    class Handler(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        outer.requests.append(body)
        if self.path != "/v1/chat/completions":
          self.send_response(404)
          self.send_header("Content-Length", "0")
          self.end_headers()
          return
        text = outer.script(body["messages"][-1]["content"])
        data = json.dumps(
          {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
          }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._httpd.daemon_threads = True

  @property
  def url(self):
    return f"http://127.0.0.1:{self._httpd.server_address[1]}"

  def __enter__(self):
    threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()
    return self

  def __exit__(self, *exc):
    self._httpd.shutdown()
    self._httpd.server_close()
