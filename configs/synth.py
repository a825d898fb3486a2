"""K2 agentic data synthesis configs: `tiny` (CPU smoke run against the embedded random tiny model)
and `default` (a real run against an OpenAI-compatible endpoint serving a strong model).

  python launch/synth.py --config=configs/synth.py:tiny --out=/tmp/synth
  python launch/synth.py --config=configs/synth.py:default --out=W/synth \
      --config.llm_url=http://sglang:30000 --config.num_agents=2000 --config.concurrency=256

With `llm_url` empty the launcher serves `serve_model` (a workdir/HF dir, or `tiny-random`) with the
embedded k2jax engine on a free local port. Each stage writes OUT/<stage>.jsonl and
OUT/<stage>.rejected.jsonl; rerunning the same command resumes. OUT/sft.jsonl is SFT data
(`--config.data.kind=sft --config.data.path=OUT/sft.jsonl` in configs/k2.py).
"""

import os

from ml_collections import config_dict

VARIANTS = ("tiny", "default")
EXAMPLE_MCP_TOOLS = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "k2jax", "synth", "examples", "mcp_tools.json"
)


def get_config(arg: str = "tiny") -> config_dict.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"configs/synth.py: unknown variant {arg!r}; choose one of {VARIANTS}")
  c = config_dict.ConfigDict()
  # The LLM endpoint (every role: generators, simulated user, agent, tool simulator, judge).
  c.llm_url = ""  # OpenAI-compatible root or .../v1; '' = serve serve_model locally
  c.serve_model = "tiny-random"  # used only without llm_url: workdir / HF dir / tiny-random
  c.serve_max_seq_len = 1024
  c.model = "default"  # `model` field of the requests
  c.api_key = ""  # Bearer token ('' = none)
  c.temperature = 0.7
  c.max_tokens = 512  # per request, every role but the agent
  c.agent_max_tokens = 512
  c.timeout_s = 120.0
  c.concurrency = 8  # requests in flight to the endpoint
  c.max_retries = 3
  c.workers = 8  # stage units processed at once
  # (a) tools: real MCP specs + hierarchical evolution.
  c.mcp_tool_files = (EXAMPLE_MCP_TOOLS,)
  c.categories = ("financial trading", "software applications", "robot control")
  c.domains_per_category = 3
  c.tools_per_domain = 4
  c.dedup_threshold = 0.8  # description word-set Jaccard within a domain
  # (b) agents, (c) tasks.
  c.num_agents = 8
  c.tools_per_agent = 4
  c.cross_domain_tools = 1
  c.tasks_per_agent = 2
  # (d) trajectories: simulated user x agent x tool simulator.
  c.max_turns = 6
  c.p_failure = 0.15
  c.p_edge_case = 0.15
  c.default_persona = "a busy professional who writes short, direct messages"
  # (e) judge.
  c.judge_min_score = 7.0
  c.stages = ("tools", "agents", "tasks", "trajectories", "sft")
  c.seed = 0
  if arg == "tiny":
    c.max_tokens = 32
    c.agent_max_tokens = 32
    c.categories = ("software applications",)
    c.domains_per_category = 1
    c.num_agents = 2
    c.tasks_per_agent = 1
    c.max_turns = 2
    c.workers = 2
    c.concurrency = 2
  c.lock()
  return c
