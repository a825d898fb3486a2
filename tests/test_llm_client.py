"""The one OpenAI-compatible chat client: answers, retries through the openai package, errors mapped onto
k2jax's transport errors."""

import collections
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k2jax.llm_client import ChatClient, ChatConfig
from k2jax.transport import InvalidResponse, RequestRejected, ServiceError, ServiceUnreachable


class _Server:
  """Answers /v1/chat/completions from a queue of (status, body) replies; then echoes the last user message."""

  def __init__(self):
    self.replies: collections.deque = collections.deque()
    self.requests: list[tuple[str, dict, str]] = []
    outer = self

    class H(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *a):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        outer.requests.append((self.path, body, self.headers.get("Authorization", "")))
        if outer.replies:
          status, obj = outer.replies.popleft()
        else:
          message = {"role": "assistant", "content": "echo: " + body["messages"][-1]["content"]}
          status, obj = 200, {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("retry-after-ms", "5")  # keeps the client's retries fast
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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


def _msg(text):
  return [{"role": "user", "content": text}]


def test_text_and_request_body(server):
  client = ChatClient(ChatConfig(server.url, model="m", api_key="k", temperature=0.25, max_tokens=9))
  assert client.text(_msg("hi")) == "echo: hi"
  path, body, auth = server.requests[-1]
  assert path == "/v1/chat/completions" and auth == "Bearer k"
  assert body["model"] == "m" and body["temperature"] == 0.25 and body["max_tokens"] == 9
  assert ChatClient(ChatConfig(server.url + "/v1/")).text(_msg("again"), max_tokens=3) == "echo: again"
  assert server.requests[-1][0] == "/v1/chat/completions" and server.requests[-1][1]["max_tokens"] == 3


def test_tool_calls_come_back_as_openai_dicts(server):
  call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}
  server.replies.append((200, {"choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": [call]}}]}))
  tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
  message = ChatClient(ChatConfig(server.url)).chat(_msg("use a tool"), tools=tools)
  assert message["content"] is None and message["tool_calls"] == [call]
  assert server.requests[-1][1]["tools"] == tools


def test_transient_failures_are_retried_then_reported(server):
  server.replies.extend([(503, {"error": "busy"}), (429, {"error": "slow down"})])
  assert ChatClient(ChatConfig(server.url, max_retries=2)).text(_msg("x")) == "echo: x"
  assert len(server.requests) == 3
  server.replies.extend([(500, {"error": "boom"})] * 3)
  with pytest.raises(ServiceUnreachable, match="HTTP 500"):
    ChatClient(ChatConfig(server.url, max_retries=2)).text(_msg("x"))
  assert len(server.requests) == 6


def test_client_errors_and_bad_answers_are_not_retried(server):
  server.replies.append((400, {"error": {"message": "bad max_tokens"}}))
  with pytest.raises(RequestRejected, match="HTTP 400"):
    ChatClient(ChatConfig(server.url, max_retries=3)).text(_msg("x"))
  assert len(server.requests) == 1
  server.replies.append((200, {"id": "x", "choices": []}))
  with pytest.raises(InvalidResponse, match="choices"):
    ChatClient(ChatConfig(server.url)).text(_msg("x"))


def test_unreachable_endpoint_and_bad_config():
  with pytest.raises(ServiceError, match="no answer after 1 attempts"):
    ChatClient(ChatConfig("http://127.0.0.1:9", max_retries=0, timeout_s=5)).text(_msg("x"))
  with pytest.raises(ValueError, match="http"):
    ChatConfig("localhost:30000")
