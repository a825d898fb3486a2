"""A scripted OpenAI-compatible chat server that plays every synthesis role with valid content,
dispatching on the `ROLE: ...` line of the system prompt (agent requests carry `tools`). Every 7th
request answers 503 so the client's retries are exercised."""

from __future__ import annotations

import collections
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _value(schema: dict):
  t = schema.get("type")
  return {"integer": 3, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(t, "x")


def _tool(name, desc, impact="read_only", props=None):
  props = props or {"query": {"type": "string"}}
  return {
    "name": name,
    "description": desc,
    "impact": impact,
    "inputSchema": {"type": "object", "properties": props, "required": list(props)},
  }


def reply(body: dict) -> dict:
  msgs = body["messages"]
  system = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else ""
  last = msgs[-1].get("content") or ""
  if body.get("tools"):  # the agent
    if not any(m["role"] == "tool" for m in msgs):
      fn = body["tools"][0]["function"]
      args = {k: _value(v) for k, v in fn["parameters"].get("properties", {}).items()}
      return {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
          {"id": "call_abc", "type": "function", "function": {"name": fn["name"], "arguments": json.dumps(args)}}
        ],
      }
    return {"role": "assistant", "content": "All done: the request is complete."}
  role = system.split("\n", 1)[0].removeprefix("ROLE: ").strip()
  if role == "domain_generator":
    cat = last.split(": ", 1)[1]
    text = json.dumps([f"{cat} desk", f"{cat} ops"])
  elif role == "tool_generator":
    domain = last.rsplit("Domain: ", 1)[1]
    slug = domain.replace(" ", "_")
    tools = [
      _tool(f"{slug}_lookup", f"Look up records in {domain}."),
      _tool(
        f"{slug}_update",
        f"Update a record in {domain}.",
        "reversible_write",
        {"record": {"type": "string"}, "value": {"type": "integer"}},
      ),
      {"name": "bad name!", "inputSchema": {"type": "object"}},  # invalid: dropped
      _tool("shared_search", "Search everything."),
    ]  # duplicate across domains
    text = "Here you go:\n```json\n" + json.dumps(tools) + "\n```"
  elif role == "agent_designer":
    text = json.dumps({"name": "helper", "system_prompt": "You are a careful assistant. Use the tools to help."})
  elif role == "task_generator":
    names = [t["name"] for t in json.loads(last.rsplit("Tools: ", 1)[1])]
    text = json.dumps(
      [
        {
          "instruction": "Please check the latest record.",
          "difficulty": "simple",
          "user_persona": "terse analyst",
          "rubric": {"success_criteria": ["record reported"], "expected_tools": names[:1], "checkpoints": ["lookup"]},
        },
        {
          "instruction": "Do the impossible thing.",
          "difficulty": "complex",
          "rubric": {"success_criteria": ["x"], "expected_tools": names[:1], "checkpoints": []},
        },
        {
          "instruction": "Use a tool that does not exist.",
          "rubric": {"success_criteria": ["y"], "expected_tools": ["no_such_tool"]},
        },
      ]
    )
  elif role == "user_simulator":
    text = "Hi, can you check the latest record for me?" if len(msgs) == 2 and "(Start" in last else "[DONE]"
  elif role == "tool_simulator":
    call = json.loads(last)
    state = dict(call["world_state"], calls=call["world_state"].get("calls", 0) + 1)
    text = json.dumps({"result": {"status": "ok", "records": [1, 2]}, "state": state})
  elif role == "judge":
    task = json.loads(last)["task"]
    text = json.dumps({"passed": "impossible" not in task, "score": 9, "reason": "criteria met"})
  else:
    raise ValueError(f"unscripted role {role!r}")
  return {"role": "assistant", "content": text}


class ScriptedLLM:
  """`answer(body) -> message` plays the roles (`reply` unless given)."""

  def __init__(self, answer=reply):
    self.calls = collections.Counter()
    self._n, lock, outer = 0, threading.Lock(), self

    class H(BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *a):
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
          outer._n += 1
          fail = outer._n % 7 == 0
        if fail:  # the client retries, after the delay the server asks for
          self._send(503, {"error": "overloaded"}, headers={"retry-after-ms": "5"})
          return
        message = answer(body)
        role = "agent" if body.get("tools") else body["messages"][0]["content"].split("\n", 1)[0]
        with lock:
          outer.calls[role] += 1
        self._send(
          200,
          {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
          },
        )

      def _send(self, status, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
          self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    self.httpd.daemon_threads = True
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()
