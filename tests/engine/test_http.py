"""HTTP engine client against a local misbehaving SGLang-API server."""

import socket
import threading
import time

import pytest

from k2jax.engine.base import GenerateRequest, SamplingParams
from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.transport import InvalidResponse, RequestRejected, RetryPolicy, ServiceUnreachable

from .fake_sglang_server import FakeSglangServer

FAST_RETRY = RetryPolicy(max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.02)
NO_RETRY = RetryPolicy(max_retries=0)
REQ = GenerateRequest("r0", (5, 6, 7), SamplingParams(max_new_tokens=16, seed=3))


def _fake(length=10, latency=1e-4):
  return FakeEngine(FakeEngineConfig(per_token_latency_s=latency), lambda req: length)


@pytest.fixture
def server():
  with FakeSglangServer(_fake(), hang_s=2.0) as s:
    yield s


def _client(server, retry=FAST_RETRY, timeout=1.0):
  return HttpEngine(HttpEngineConfig(server.url, generate_timeout_s=timeout, control_timeout_s=timeout, retry=retry))


def test_generate_roundtrip_matches_engine(server):
  res = _client(server).generate(REQ)
  direct = _fake().generate(REQ)
  assert res.output_ids == direct.output_ids and len(res.output_ids) == 10
  assert res.output_logprobs == pytest.approx(direct.output_logprobs)
  assert res.finish_reason == "stop" and res.prompt_tokens == 3 and res.completion_tokens == 10
  assert res.weight_versions == (0,) * 10
  assert res.matched_stop == direct.matched_stop == 1 and res.abort_message is None  # the fake's EOS id


@pytest.mark.parametrize(
  "fault", ["malformed_json", "short_logprobs", "dup_logprobs", "wrong_ids", "bad_finish", "bad_count"]
)
def test_invalid_response_raises_without_retry(server, fault):
  server.faults.append(fault)
  with pytest.raises(InvalidResponse, match=server.url):
    _client(server, retry=RetryPolicy(max_retries=2, retry_invalid_responses=False)).generate(REQ)
  assert server.calls["generate"] == 1


@pytest.mark.parametrize("fault", ["malformed_json", "dup_logprobs", "drop", "http500", "hang"])
def test_transient_faults_are_retried(server, fault):
  server.faults.extend([fault, fault])
  res = _client(server, timeout=0.5).generate(REQ)
  assert len(res.output_ids) == 10
  assert server.calls["generate"] == 3
  if fault == "hang":  # a timed-out generate is aborted on the server before the retry
    assert server.calls["abort_request"] == 2


def test_retries_exhausted_and_4xx_not_retried(server):
  server.faults.extend(["drop"] * 3)
  with pytest.raises(ServiceUnreachable, match="after 3 attempts"):
    _client(server).generate(REQ)
  server.faults.append("http400")
  with pytest.raises(RequestRejected, match="HTTP 400"):
    _client(server).generate(REQ)


def test_backoff_is_exponential():
  p = RetryPolicy(max_retries=5, backoff_initial_s=0.1, backoff_max_s=0.5, backoff_multiplier=2)
  assert [p.delay_s(k) for k in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_unreachable_url_is_named():
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
  eng = HttpEngine(HttpEngineConfig(url, retry=FAST_RETRY, generate_timeout_s=1))
  with pytest.raises(ServiceUnreachable, match=url):
    eng.generate(REQ)
  assert not eng.health()


def test_abort_returns_partial_output_from_another_thread():
  with FakeSglangServer(_fake(length=10_000, latency=1e-3)) as server:
    eng = _client(server, timeout=30)
    out = {}
    req = GenerateRequest("long", (1, 2), SamplingParams(max_new_tokens=20_000, seed=1))
    t = threading.Thread(target=lambda: out.setdefault("r", eng.generate(req)))
    t.start()
    time.sleep(0.3)
    eng.abort(["long"])
    t.join(10)
    res = out["r"]
    assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 10_000
    assert len(res.output_logprobs) == len(res.output_ids)


def test_control_routes(server):
  eng = _client(server)
  assert eng.health()
  assert eng.model_info()["model_path"] == "fake"
  eng.flush_cache()
  eng.wait_until_healthy(1.0)
