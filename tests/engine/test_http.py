"""HTTP engine client against a local misbehaving SGLang-API server."""

import socket
import threading
import time
import types

import pytest

from k2jax.engine.base import UNKNOWN_VERSION, EngineCapabilities, EngineIncapable, GenerateRequest, SamplingParams
from k2jax.engine.fake import FakeEngine, FakeEngineConfig
from k2jax.engine.http import HttpEngine, HttpEngineConfig
from k2jax.grading.base import Prompt, RewardResult, per_sample
from k2jax.rl.rollout import RolloutConfig, RolloutManager
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


def test_abort_before_prefill_is_an_empty_aborted_result(server):
  server.faults.append("abort_before_prefill")
  eng = _client(server, retry=NO_RETRY)
  res = eng.generate(REQ)
  assert res.finish_reason == "abort" and res.output_ids == () and res.output_logprobs == ()
  assert res.completion_tokens == 0 and eng.metrics() == {"abort_before_prefill": 1}


def test_abort_before_prefill_is_resubmitted_by_the_rollout_manager():
  with FakeSglangServer(_fake(length=6)) as server:
    server.faults.extend(["abort_before_prefill"] * 3)
    eng = _client(server, retry=NO_RETRY, timeout=10)
    prompts = iter([Prompt(f"p{i}", "default", (i + 2, 7)) for i in range(4)])
    cfg = RolloutConfig(group_size=2, target_groups=4, launch_groups=4, max_concurrency=8)
    batch, stats = RolloutManager(cfg, eng, prompts, per_sample(lambda p, c: RewardResult(1.0, "ok"))).collect(0)
    assert batch.num_groups == 4 and batch.response_lengths_B.tolist() == [6] * 8
    assert stats["engine_abort_before_prefill"] == 3 and server.calls["generate"] == 8 + 3


def test_sglang_jax_duplicated_logprobs_are_repaired_only_when_exact():
  long_req = GenerateRequest("r60", (5, 6, 7), SamplingParams(max_new_tokens=100, seed=3))
  with FakeSglangServer(_fake(length=60)) as server:
    eng = _client(server, retry=NO_RETRY)
    direct = _fake(length=60).generate(long_req)
    server.faults.append("dup50")
    res = eng.generate(long_req)
    assert res.output_ids == direct.output_ids and len(res.output_logprobs) == 60
    assert res.output_logprobs == pytest.approx(direct.output_logprobs)
    server.faults.append("dup50_mismatch")
    with pytest.raises(InvalidResponse, match="leading 50 are no repeat"):
      eng.generate(long_req)
    server.faults.extend(["dup50_mismatch", "dup_logprobs"])  # rejected, then the retry's answer also
    with pytest.raises(InvalidResponse):
      _client(server, retry=RetryPolicy(max_retries=1, backoff_initial_s=0.01)).generate(long_req)
    assert eng.metrics() == {"logprobs_dup_repaired": 1, "logprobs_dup_rejected": 1}


def test_ids_the_detokenizer_dropped_are_restored_from_the_logprob_entries():
  long_req = GenerateRequest("r60", (5, 6, 7), SamplingParams(max_new_tokens=100, seed=3))
  with FakeSglangServer(_fake(length=60)) as server:
    eng = _client(server, retry=NO_RETRY)
    direct = _fake(length=60).generate(long_req)
    server.faults.extend(["detok_dropped_id", "dup50", "detok_dropped_id"])
    for _ in range(3):
      res = eng.generate(long_req)
      assert res.output_ids == direct.output_ids and res.output_logprobs == pytest.approx(direct.output_logprobs)
    assert eng.metrics() == {"output_ids_restored": 2, "logprobs_dup_repaired": 1}
    server.faults.append("bad_count")  # one more token counted than the entries hold: still rejected
    with pytest.raises(InvalidResponse):
      eng.generate(long_req)


def test_missing_weight_version_gives_unknown_versions_not_a_guess(server):
  server.faults.append("no_version")
  eng = _client(server)
  res = eng.generate(REQ)
  assert res.weight_versions == (UNKNOWN_VERSION,) * 10
  assert eng.metrics() == {"replies_without_weight_version": 1}
  assert eng.generate(REQ).weight_versions == (0,) * 10  # "default": the server's launch weights


@pytest.mark.parametrize("deterministic", [True, False])
def test_handshake_identifies_sglang_and_sglang_jax(deterministic):
  with FakeSglangServer(_fake(), flavor="sglang", deterministic=deterministic) as server:
    caps = _client(server).capabilities()
    assert caps == EngineCapabilities("sglang", "0.5.0", ("disk",), True, deterministic, True)
    caps.require("RL with weight sync", weight_update=True, weight_version=True, abort=True)
  with FakeSglangServer(_fake(), flavor="sglang-jax", deterministic=deterministic) as server:
    eng = _client(server)
    caps = eng.capabilities()
    assert caps == EngineCapabilities("sglang-jax", "0.0.3rc98", (), False, deterministic, True)
    with pytest.raises(EngineIncapable) as e:
      caps.require("RL with weight sync", server.url, weight_update=True, weight_version=True, abort=True)
    assert str(e.value) == (
      f"RL with weight sync needs weight update from disk (/update_weights_from_disk), weight-version reporting "
      f"(meta_info.weight_version), which the engine at {server.url} (sglang-jax 0.0.3rc98) lacks"
    )
    with pytest.raises(EngineIncapable, match="restart the server on an export instead"):
      eng.update_weights("/nowhere", 1)
    assert server.calls["update_weights_from_disk"] == 1  # the GET probe only, never a POST
    res = eng.generate(REQ)  # generation itself works; tokens carry no invented version
    assert res.weight_versions == (UNKNOWN_VERSION,) * 10


def test_learner_refuses_a_server_without_weight_updates(tmp_path):
  from k2jax.rl.rollout_engine import make_engine

  with FakeSglangServer(_fake(), flavor="sglang-jax") as server:
    lc = types.SimpleNamespace(engine_url=server.url, worker_urls=())
    with pytest.raises(EngineIncapable, match="RL with weight sync needs weight update from disk"):
      make_engine(lc, None, None)
