"""The K2 agentic data-synthesis pipeline, stage by stage (K2 §3.1.1; reference k2-data-and-synthesis §3):

  tools        import MCP specs + evolve synthetic tools (categories -> domains -> tools), deduplicate
  agents       system prompts with tool subsets
  tasks        per agent, tasks with rubrics and user personas
  trajectories simulated user x agent x tool simulator (world state, injected failures/edge cases)
  sft          LLM judge against the rubric (and, for a task with code `tests`, the code verifier on the
               final answer's program: `verifiable.py`); passing trajectories become SFT records (`sft.jsonl`)

Each stage writes `<stage>.jsonl` and `<stage>.rejected.jsonl` in the output directory and skips units
already in either, so a rerun resumes where the last one stopped and every decision can be inspected.
`stats.json` holds per-stage counts and the LLM's call / invalid-output counters.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os

from k2jax.synth import agents as agents_lib
from k2jax.synth import tools as tools_lib
from k2jax.synth import verifiable
from k2jax.synth.judge import judge
from k2jax.synth.llm import LLM
from k2jax.synth.store import StageStore, run_units
from k2jax.synth.trajectories import make_trajectory
from k2jax.llm_client import ChatConfig
from k2jax import configlib
from k2jax.configlib import knob

log = logging.getLogger(__name__)
STAGES = ("tools", "agents", "tasks", "trajectories", "sft")
EXAMPLE_MCP_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "mcp_tools.json")
_POSITIVE = {"check": lambda v: v >= 1, "rule": "must be >= 1"}


def _stages(v: tuple[str, ...]) -> bool:
  return all(s in STAGES for s in v)


@dataclasses.dataclass(frozen=True)
class SynthConfig:
  llm: ChatConfig
  mcp_tool_files: tuple[str, ...] = ()
  categories: tuple[str, ...] = ("financial trading", "software applications", "robot control")
  domains_per_category: int = 3
  tools_per_domain: int = 4
  dedup_threshold: float = 0.8
  num_agents: int = 8
  tools_per_agent: int = 4
  cross_domain_tools: int = 1
  tasks_per_agent: int = 2
  max_turns: int = 6
  p_failure: float = 0.15  # injected tool failures
  p_edge_case: float = 0.15  # injected edge cases
  agent_max_tokens: int = 512
  judge_min_score: float = 7.0
  code_min_score: float = 1.0  # tasks with code tests: the verifier's least pass rate of the final answer
  default_persona: str = "a busy professional who writes short, direct messages"
  stages: tuple[str, ...] = STAGES  # run a prefix/subset to stop early; later stages read earlier files
  workers: int = 8  # units processed at once (LLM concurrency is ChatConfig.concurrency)
  seed: int = 0

  def __post_init__(self):
    bad = [s for s in self.stages if s not in STAGES]
    if bad:
      raise ValueError(f"SynthConfig.stages: unknown {bad}; known {STAGES}")


@dataclasses.dataclass(frozen=True)
class SynthSpec:
  """configs/synth.py, typed: the single declaration of every synthesis knob (default, type, doc, check);
  configs/synth.py starts from `configlib.config_dict(SynthSpec)` and its presets only change fields."""

  # The LLM endpoint (every role: generators, simulated user, agent, tool simulator, judge).
  llm_url: str = knob("", "OpenAI-compatible root or .../v1; '' = serve serve_model locally")
  serve_model: str = knob("tiny-random", "used only without llm_url: workdir / HF dir / tiny-random")
  serve_max_seq_len: int = knob(1024, "without llm_url: the local engine's prompt + response tokens", **_POSITIVE)
  model: str = knob("default", "`model` field of the requests")
  api_key: str = knob("", "Bearer token ('' = none)")
  temperature: float = knob(0.7, "sampling temperature of every role")
  max_tokens: int = knob(512, "per request, every role but the agent", **_POSITIVE)
  agent_max_tokens: int = knob(512, "per agent turn", **_POSITIVE)
  timeout_s: float = knob(120.0, "per request attempt", check=lambda v: v > 0, rule="must be > 0")
  concurrency: int = knob(8, "requests in flight to the endpoint", **_POSITIVE)
  max_retries: int = knob(3, "attempts = 1 + max_retries", check=lambda v: v >= 0, rule="must be >= 0")
  workers: int = knob(8, "stage units processed at once", **_POSITIVE)
  # (a) tools: real MCP specs + hierarchical evolution.
  mcp_tool_files: tuple[str, ...] = knob((EXAMPLE_MCP_TOOLS,), "MCP tool spec files imported as real tools")
  categories: tuple[str, ...] = knob(
    ("financial trading", "software applications", "robot control"), "tool categories evolved into domains"
  )
  domains_per_category: int = knob(3, "synthetic domains per category")
  tools_per_domain: int = knob(4, "synthetic tools per domain")
  dedup_threshold: float = knob(0.8, "description word-set Jaccard within a domain above which tools are dropped")
  # (b) agents, (c) tasks.
  num_agents: int = knob(8, "agents synthesized")
  tools_per_agent: int = knob(4, "tools each agent is given")
  cross_domain_tools: int = knob(1, "of those, tools from other domains")
  tasks_per_agent: int = knob(2, "rubric tasks per agent")
  # (d) trajectories: simulated user x agent x tool simulator.
  max_turns: int = knob(6, "user turns per trajectory")
  p_failure: float = knob(0.15, "probability of an injected tool failure")
  p_edge_case: float = knob(0.15, "probability of an injected edge case")
  default_persona: str = knob("a busy professional who writes short, direct messages", "simulated user persona")
  # (e) judge.
  judge_min_score: float = knob(7.0, "trajectories scoring below this are rejected")
  code_min_score: float = knob(
    1.0,
    "tasks with code tests: trajectories whose final program passes a smaller share of them are rejected",
    check=lambda v: 0 <= v <= 1,
    rule="must be in [0, 1]",
  )
  stages: tuple[str, ...] = knob(
    STAGES,
    "stages to run (a prefix/subset stops early; later stages read earlier files)",
    check=_stages,
    rule=f"each one of {STAGES}",
  )
  seed: int = knob(0, "sampling seed of every stage")


def run_synth(cfg: SynthConfig, out_dir: str) -> dict:
  """Runs the configured stages into `out_dir` (resumable); returns and writes the stats."""
  llm = LLM(cfg.llm)
  stats: dict = {s: {} for s in STAGES}
  with concurrent.futures.ThreadPoolExecutor(cfg.workers, thread_name_prefix="synth") as pool:
    if "tools" in cfg.stages:
      _tools(cfg, llm, out_dir, pool, stats["tools"])
    if "agents" in cfg.stages:
      _agents(cfg, llm, out_dir, pool, stats["agents"])
    if "tasks" in cfg.stages:
      _tasks(cfg, llm, out_dir, pool, stats["tasks"])
    if "trajectories" in cfg.stages:
      _trajectories(cfg, llm, out_dir, pool, stats["trajectories"])
    if "sft" in cfg.stages:
      _sft(cfg, llm, out_dir, pool, stats["sft"])
  stats["llm"] = dict(sorted(llm.counts.items()))
  stats["sft_records"] = len(StageStore(out_dir, "sft").records())
  with open(os.path.join(out_dir, "stats.json"), "w") as f:
    json.dump(stats, f, indent=1, sort_keys=True)
  log.info("synth stats: %s", stats)
  return stats


def _tools(cfg, llm, out, pool, st) -> None:
  imported = tools_lib.import_mcp(cfg.mcp_tool_files, StageStore(out, "tools_import"))
  domains = StageStore(out, "domains")
  run_units(
    [
      (c, lambda c=c: {"category": c, "domains": tools_lib.evolve_domains(llm, c, cfg.domains_per_category)})
      for c in cfg.categories
    ],
    domains,
    pool,
    st.setdefault("domains", {}),
  )
  units = StageStore(out, "tool_units")
  work = [
    (f"{r['category']}/{d}", lambda c=r["category"], d=d: _tool_unit(llm, c, d, cfg.tools_per_domain))
    for r in domains.records()
    for d in r["domains"]
  ]
  run_units(work, units, pool, st.setdefault("units", {}))
  repo, dropped = tools_lib.build_repository(imported, units.records(), cfg.dedup_threshold)
  _rewrite(os.path.join(out, "tools.jsonl"), repo)
  st.update(
    imported=len(imported),
    synthetic=len(repo) - sum(r["source"] == "mcp" for r in repo),
    duplicates_dropped=dropped,
    repository=len(repo),
  )


def _tool_unit(llm, category, domain, n) -> dict:
  tools, invalid = tools_lib.evolve_tools(llm, category, domain, n)
  return {"category": category, "domain": domain, "tools": tools, "invalid_tools": invalid}


def _agents(cfg, llm, out, pool, st) -> None:
  repo = StageStore(out, "tools").records()
  st["repository"] = len(repo)
  if not repo:
    return
  work = [
    (
      f"agent{i}",
      lambda i=i: agents_lib.make_agent(
        llm, agents_lib.pick_tools(repo, i, cfg.seed, cfg.tools_per_agent, cfg.cross_domain_tools)
      ),
    )
    for i in range(cfg.num_agents)
  ]
  run_units(work, StageStore(out, "agents"), pool, st)


def _tasks(cfg, llm, out, pool, st) -> None:
  store = StageStore(out, "tasks")
  work = [
    (a["id"], lambda a=a: {"agent_id": a["id"], "tasks": agents_lib.make_tasks(llm, a, cfg.tasks_per_agent)})
    for a in StageStore(out, "agents").records()
  ]
  run_units(work, store, pool, st)
  st["tasks"] = sum(len(r["tasks"]) for r in store.records())


def _trajectories(cfg, llm, out, pool, st) -> None:
  agents = {a["id"]: a for a in StageStore(out, "agents").records()}
  tasks = StageStore(out, "tasks")
  work = []
  for rec in tasks.records():
    for j, task in enumerate(rec["tasks"]):
      tid = f"{rec['agent_id']}/task{j}"
      verifiable.check_tests(task, f"{tasks.path}: task {tid}")
      work.append(
        (
          tid,
          lambda t={**task, "id": tid}, a=agents[rec["agent_id"]]: make_trajectory(
            llm,
            t,
            a,
            seed=cfg.seed,
            max_turns=cfg.max_turns,
            p_failure=cfg.p_failure,
            p_edge=cfg.p_edge_case,
            agent_max_tokens=cfg.agent_max_tokens,
            default_persona=cfg.default_persona,
          ),
        )
      )
  run_units(work, StageStore(out, "trajectories"), pool, st)


def _sft(cfg, llm, out, pool, st) -> None:
  work = [(t["id"], lambda t=t: _graded(cfg, llm, t)) for t in StageStore(out, "trajectories").records()]
  run_units(work, StageStore(out, "sft"), pool, st)


def _graded(cfg, llm, trajectory) -> dict:
  """The SFT record: the code verifier first (no judge call for a wrong program), then the judge."""
  tests = trajectory["task"].get("tests") is not None
  code = verifiable.grade(trajectory, cfg.code_min_score) if tests else {}
  return {**judge(llm, trajectory, cfg.judge_min_score), **code}


def _rewrite(path: str, records: list[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def from_config_dict(c, llm_url: str) -> SynthConfig:
  """The typed config from configs/synth.py (a ConfigDict or plain dict; `llm_url` resolved by the launcher):
  `configlib.build` checks it against SynthSpec (errors name the key); every SynthConfig and ChatConfig field
  takes the knob of the same name."""
  spec = configlib.build(SynthSpec, c)
  knobs = dataclasses.asdict(spec)
  chat = {f.name: knobs[f.name] for f in dataclasses.fields(ChatConfig) if f.name in knobs}
  llm = ChatConfig(**{**chat, "url": llm_url, "api_key": spec.api_key or None})
  return SynthConfig(llm=llm, **{f.name: knobs[f.name] for f in dataclasses.fields(SynthConfig) if f.name != "llm"})
