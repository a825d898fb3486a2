"""The shared JSON-over-HTTP client: kept-alive connections per thread, jittered retry sleeps, no redirects."""

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k2jax import transport
from k2jax.transport import RequestRejected, RetryPolicy, call_json


class _Server:
  """Answers POST/GET with {"n": request count}; `statuses` queues non-200 answers; records client ports."""

  def __init__(self):
    self.ports, self.statuses, self.close_after = [], [], set()
    outer = self

    class H(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *a):
        pass

      def do_GET(self):
        self.do_POST()

      def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        outer.ports.append(self.client_address[1])
        status, headers = outer.statuses.pop(0) if outer.statuses else (200, {})
        body = json.dumps({"n": len(outer.ports)}).encode()
        self.send_response(status)
        for k, v in headers.items():
          self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if len(outer.ports) in outer.close_after:  # the server ends the kept-alive connection while idle
          self.close_connection = True

    self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    self.httpd.daemon_threads = True
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture()
def server():
  srv = _Server()
  yield srv
  srv.httpd.shutdown()
  srv.httpd.server_close()


NO_RETRY = RetryPolicy(max_retries=0)


def test_one_thread_reuses_one_connection_and_replaces_one_the_server_closed(server):
  got = [call_json(server.url + "/x", {"i": i}, timeout_s=5, retry=NO_RETRY)["n"] for i in range(4)]
  assert got == [1, 2, 3, 4] and len(set(server.ports)) == 1  # four requests, one TCP connection
  server.close_after.add(5)
  got = [call_json(server.url + "/x", None, timeout_s=5, retry=NO_RETRY)["n"] for _ in range(3)]
  assert got == [5, 6, 7] and len(set(server.ports)) == 2  # the closed one was found idle and replaced
  seen = []
  t = threading.Thread(target=lambda: seen.append(call_json(server.url, {}, timeout_s=5, retry=NO_RETRY)))
  t.start()
  t.join()
  assert seen == [{"n": 8}] and len(set(server.ports)) == 3  # another thread, its own connection


def test_retry_sleeps_are_jittered_below_the_exponential_ceiling(server, monkeypatch):
  sleeps = []
  monkeypatch.setattr(transport.time, "sleep", sleeps.append)
  monkeypatch.setattr(transport, "_RNG", random.Random(0))
  policy = RetryPolicy(max_retries=4, backoff_initial_s=0.1, backoff_max_s=0.4)
  server.statuses += [(503, {})] * 4
  assert call_json(server.url, {}, timeout_s=5, retry=policy) == {"n": 5}
  ceilings = [0.1, 0.2, 0.4, 0.4]
  draws = random.Random(0)
  assert sleeps == pytest.approx([c * (1 - draws.random()) for c in ceilings])
  assert all(0 <= s <= c for s, c in zip(sleeps, ceilings)) and len(set(sleeps)) == 4
  # Two clients failing together sleep differently (the herd spreads); jitter 0 is the old fixed schedule.
  assert policy.sleep_s(0, 0.25) != policy.sleep_s(0, 0.75)
  fixed = RetryPolicy(backoff_initial_s=0.1, backoff_max_s=0.4, jitter=0.0)
  assert [fixed.sleep_s(k, 0.9) for k in range(3)] == pytest.approx([0.1, 0.2, 0.4])
  with pytest.raises(ValueError, match="jitter must be in"):
    RetryPolicy(jitter=1.5)


def test_a_redirect_is_refused_by_name_and_not_followed(server):
  server.statuses.append((302, {"Location": "http://10.0.0.1/elsewhere"}))
  with pytest.raises(RequestRejected, match=r"HTTP 302 .*'http://10.0.0.1/elsewhere' not followed"):
    call_json(server.url + "/start", {}, timeout_s=5, retry=RetryPolicy(max_retries=2))
  assert len(server.ports) == 1  # not retried, not followed
