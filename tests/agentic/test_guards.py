"""Guards: high-impact actions need confirmation (default deny) and are logged; per-target rate limits and
the global concurrency cap hold under 1000 concurrent simulated agents; tools reach only their targets;
the egress hook refuses connections outside the allowlist (in a child process: hooks are permanent)."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k2jax.agentic import Guard, GuardConfig, Impact, RateLimit, ToolCall, ToolError, ToolSpec

SCHEMA = {"type": "object"}


class _Target:
  """A local 'external service' that records when each request arrived and the peak in-flight count."""

  def __init__(self, delay_s=0.0):
    self.times, self.inflight, self.peak, lock = [], 0, 0, threading.Lock()
    outer = self

    class H(BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with lock:
          outer.times.append(time.monotonic())
          outer.inflight += 1
          outer.peak = max(outer.peak, outer.inflight)
        time.sleep(delay_s)
        with lock:
          outer.inflight -= 1
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    self.httpd.daemon_threads = True
    self.httpd.request_queue_size = 1024
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
    self.target = f"127.0.0.1:{self.httpd.server_address[1]}"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def _call(name="t", **args):
  return ToolCall(f"functions.{name}:0", name, args)


def test_high_impact_needs_confirmation_and_is_logged(tmp_path):
  tool = ToolSpec("wire_money", "Send money.", SCHEMA, impact=Impact.IRREVERSIBLE)
  ran = []
  guard = Guard(GuardConfig(audit_path=str(tmp_path / "audit.jsonl")))
  out = guard.run(tool, _call("wire_money", amount=5), lambda a, net: ran.append(a))
  assert isinstance(out, ToolError) and out.kind == "denied" and ran == []
  ok = Guard(GuardConfig(), confirm=lambda t, c: c.arguments["amount"] < 10)
  assert ok.run(tool, _call("wire_money", amount=5), lambda a, net: "sent") == "sent"
  assert ok.run(tool, _call("wire_money", amount=50), lambda a, net: "sent").kind == "denied"
  assert [e["event"] for e in ok.audit_log] == ["confirmed", "denied"]
  logged = [json.loads(l) for l in (tmp_path / "audit.jsonl").read_text().splitlines()]
  assert logged[0]["event"] == "denied" and logged[0]["arguments"] == {"amount": 5}
  # Lower impact runs without asking; a raising confirm hook denies; a raising tool is a ToolError.
  read = ToolSpec("look", "", SCHEMA, impact=Impact.READ_ONLY)
  assert guard.run(read, _call("look"), lambda a, net: 7) == 7
  assert Guard(confirm=lambda t, c: 1 / 0).run(tool, _call("wire_money"), lambda a, n: 1).kind == "denied"
  assert guard.run(read, _call("look"), lambda a, net: {}["x"]).kind == "tool_failed"


def test_no_network_unless_target_allowed():
  srv = _Target()
  try:
    guard = Guard()
    offline = ToolSpec("offline", "", SCHEMA, impact=Impact.READ_ONLY)
    online = ToolSpec("online", "", SCHEMA, impact=Impact.READ_ONLY, targets=(srv.target,))
    fetch = lambda a, net: net.request_json(srv.target, "/x", {})
    assert guard.run(offline, _call("offline"), fetch).kind == "no_network"
    assert guard.run(online, _call("online"), fetch) == {"ok": True}
    assert len(srv.times) == 1
  finally:
    srv.close()


@pytest.mark.slow
def test_rate_limit_and_concurrency_under_1000_agents():
  rate, burst, agents = 200.0, 10, 1000
  srv = _Target(delay_s=0.02)
  try:
    guard = Guard(GuardConfig(default_rate=RateLimit(rate, burst), max_concurrency=4, max_wait_s=1.5))
    tool = ToolSpec("api", "", SCHEMA, impact=Impact.READ_ONLY, targets=(srv.target,))
    results, start = [None] * agents, threading.Event()

    def agent(i):
      start.wait()
      results[i] = guard.run(tool, _call("api", i=i), lambda a, net: net.request_json(srv.target, "/hit", a))

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(agents)]
    for t in threads:
      t.start()
    start.set()
    for t in threads:
      t.join()
    ok = sum(r == {"ok": True} for r in results)
    limited = sum(isinstance(r, ToolError) and r.kind == "rate_limited" for r in results)
    assert ok + limited == agents and ok == len(srv.times)
    assert ok >= rate * 0.5 and limited > 0, (ok, limited)  # the limiter both admits and refuses
    times = sorted(srv.times)
    per_window = max(sum(1 for u in times[i:] if u - t < 1.0) for i, t in enumerate(times))
    assert per_window <= (burst + rate) * 1.05, per_window  # calls reaching the target per second
    assert srv.peak <= 4  # the global concurrency cap
  finally:
    srv.close()


def test_egress_hook_blocks_unlisted_targets():
  srv, other = _Target(), _Target()
  code = f"""
import json, urllib.request
from k2jax.agentic import install_egress_hook
install_egress_hook({{"{srv.target}"}})
def get(t):
    try:
        urllib.request.urlopen(urllib.request.Request(f"http://{{t}}/", data=b"{{}}"), timeout=5).read()
        return "ok"
    except Exception as e:
        return type(e).__name__ + str(e)
print(json.dumps([get("{srv.target}"), get("{other.target}")]))
"""
  try:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    allowed, blocked = json.loads(out.stdout.strip().splitlines()[-1])
    assert allowed == "ok" and "egress" in blocked and "not allowed" in blocked
    assert len(other.times) == 0
  finally:
    srv.close()
    other.close()


def test_a_redirect_to_an_unchecked_target_is_not_followed():
  """urllib would follow a 302 from an allowed target to any host, past the per-target check."""
  other = _Target()
  hits = []

  class Redirect(BaseHTTPRequestHandler):
    def log_message(self, *a):
      pass

    def do_POST(self):
      hits.append(self.path)
      self.send_response(302)
      self.send_header("Location", f"http://{other.target}/elsewhere")
      self.send_header("Content-Length", "0")
      self.end_headers()

  redirector = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
  threading.Thread(target=redirector.serve_forever, daemon=True).start()
  target = f"127.0.0.1:{redirector.server_address[1]}"
  try:
    guard = Guard()
    tool = ToolSpec("api", "", SCHEMA, impact=Impact.READ_ONLY, targets=(target,))
    err = guard.run(tool, _call("api"), lambda a, net: net.request_json(target, "/start", {}))
    assert isinstance(err, ToolError) and err.kind == "no_network", err
    assert other.target in err.message and "not followed" in err.message
    assert hits == ["/start"] and other.times == []  # the redirect's target was never reached
    assert guard.audit_log[-1]["event"] == "redirect_refused"
  finally:
    redirector.shutdown()
    redirector.server_close()
    other.close()
