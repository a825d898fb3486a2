"""The synthesis pipeline end to end: against a scripted server with valid content (full path to SFT
records that k2jax.data.sft loads and a few optimizer steps train on, with resume), and against the
embedded engine serving the random tiny model (mostly invalid outputs: counted and dropped)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k2jax.data import SFTDataConfig, SourceSpec, make_sft_iter
from k2jax.data.synth import SynthConfig, run_synth
from k2jax.llm_client import ChatConfig
from k2jax.optim import muonclip
from k2jax.train import ModelDef, init_state, make_train_step
from tests.agentic.scripted_llm import ScriptedLLM

MCP_TOOLS = {
  "tools": [
    {
      "name": "fs/read.file",
      "description": "Read a file from the workspace.",
      "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
      "annotations": {"readOnlyHint": True},
    },
    {
      "name": "github_create_issue",
      "description": "Open an issue in a GitHub repository.",
      "inputSchema": {
        "type": "object",
        "properties": {"repo": {"type": "string"}, "title": {"type": "string"}},
        "required": ["repo", "title"],
      },
    },
    {"name": "broken", "description": "no schema"},
  ]
}


def _config(url, **kw):
  return SynthConfig(llm=ChatConfig(url=url, max_retries=4, **kw.pop("llm", {})), **kw)


def test_scripted_pipeline_resumes_and_trains(tmp_path, tiny_model):
  mcp = tmp_path / "mcp_servers.json"
  mcp.write_text(json.dumps(MCP_TOOLS))
  out = str(tmp_path / "synth")
  llm = ScriptedLLM()
  try:
    kw = dict(
      mcp_tool_files=(str(mcp),),
      categories=("finance", "robots"),
      domains_per_category=2,
      num_agents=3,
      tasks_per_agent=3,
      seed=1,
    )
    first = run_synth(_config(llm.url, stages=("tools", "agents", "tasks"), **kw), out)
    assert first["tools"]["imported"] == 2 and first["tools"]["duplicates_dropped"] == 3  # shared_search x3
    assert first["tools"]["repository"] == 2 + 4 * 2 + 1 and first["agents"]["accepted"] == 3
    assert first["tasks"]["tasks"] == 6 and first["llm"]["invalid.task_generator"] == 3  # unknown-tool tasks
    calls_before = dict(llm.calls)
    stats = run_synth(_config(llm.url, **kw), out)  # resume: earlier stages are not redone
    assert llm.calls["ROLE: agent_designer"] == calls_before["ROLE: agent_designer"]
    assert stats["agents"]["skipped_done"] == 3 and stats["trajectories"]["accepted"] == 6
    assert stats["sft"]["accepted"] == 3 and stats["sft"]["rejected"] == 3 and stats["sft_records"] == 3
  finally:
    llm.close()
  records = [json.loads(l) for l in open(f"{out}/sft.jsonl")]
  rec = records[0]
  roles = [m["role"] for m in rec["messages"]]
  assert roles[:4] == ["system", "user", "assistant", "tool"] and rec["messages"][2]["tool_calls"]
  trajs = {t["id"]: t for t in map(json.loads, open(f"{out}/trajectories.jsonl"))}
  for t in trajs.values():  # the simulator's state persists, except when a failure was injected
    assert t["world_state"].get("calls", 0) == sum(m != "failure" for m in t["injected_modes"])
  losses = _train_on(f"{out}/sft.jsonl", tiny_model)
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def _train_on(path, model, steps=4):
  it = make_sft_iter(SFTDataConfig(sources=(SourceSpec(path),), seq_len=512, batch_size=2, num_packing_bins=4))
  batch = {k: jnp.asarray(v) for k, v in next(it).items()}
  assert int(batch["loss_mask"].sum()) > 0
  opt = muonclip(3e-3, qk_clip_tau=None)
  state = init_state(model, opt)
  step = jax.jit(
    make_train_step(
      ModelDef.from_model(model),
      opt,
      optax.constant_schedule(3e-3),
      num_microbatches=1,
      bias_update_rate=0.0,
      qk_clip_tau=None,
    )
  )
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses)


def test_pipeline_against_embedded_tiny_model(tmp_path, tiny_server):
  mcp = tmp_path / "tools.json"
  mcp.write_text(json.dumps(MCP_TOOLS))
  cfg = _config(
    tiny_server.url,
    mcp_tool_files=(str(mcp),),
    categories=("finance",),
    domains_per_category=1,
    num_agents=2,
    tasks_per_agent=1,
    max_turns=2,
    workers=2,
    llm=dict(max_tokens=12, concurrency=2),
  )
  stats = run_synth(cfg, str(tmp_path / "out"))
  llm = stats["llm"]
  assert sum(v for k, v in llm.items() if k.startswith("calls.")) >= 3
  assert sum(v for k, v in llm.items() if k.startswith("invalid.")) >= 1  # counted ...
  assert stats["tools"]["domains"].get("rejected", 0) + stats["agents"].get("rejected", 0) >= 1  # ... dropped
  assert stats["tools"]["imported"] == 2 and stats.get("sft_records", 0) >= 0
  assert not any(s.get("errors") for s in stats.values() if isinstance(s, dict))
