"""The docs (README.md, BUILD.md, docs/*.md) point at things that exist and their quick commands work.

- every relative link resolves (file, and heading anchor when it names one);
- every repository path they name (`k2jax/...`, `launch/...`, `configs/...`, ...) exists, and every
  `python -m MODULE` is a module of this repository or a known third-party one;
- every flag a documented `launch/`, `bench/` or `scripts/` command passes is one that program defines (absl or
  argparse), and every `--config.KEY`
  is a knob of the config file the command names (of any config file where none is named);
- every command of a ```bash block is either run here (RUN: seconds on CPU, its output checked) or listed in
  NOT_RUN with the reason it is not.
"""

import functools
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
  "README.md",
  "BUILD.md",
  *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
]

# Commands run by this test: the exact command as the docs write it -> a regex its output must match.
RUN = {
  "python launch/train.py --config=configs/k2.py:1t --dry_run": r"params_total=1026408209408[\s\S]*fits=True",
  "python scripts/recipe_data.py --check": r"matches \(heldout.jsonl, rl_train.jsonl, sft_train.jsonl\)",
  "TPU_POD_DRY_RUN=1 bash launch/tpu_pod.sh create k2-v5p us-east5-a v5p-1024 v2-alpha-tpuv5": (
    r"gcloud compute tpus tpu-vm create k2-v5p --zone=us-east5-a --accelerator-type=v5p-1024 "
    r"--version=v2-alpha-tpuv5"
  ),
}

_TRAINS = (
  "trains or runs RL for minutes; tests/train, tests/rl and tests/test_recipe.py run these launchers on tiny configs"
)
_ACCEL = "needs a GPU, a TPU or a pod (untested there)"
_CLUSTER = "needs cluster credentials and machines (gcloud, SLURM, Kubernetes, Docker)"
_INSTALL = "installs packages or creates a venv; scripts/test.sh (CI) does it"
_SERVER = "starts a long-running server or needs one (tests/serve and tests/engine start them on tiny models)"
_DATA = "reads data or checkpoints you provide (paths such as /data, /shared, /ckpt, /mnt, W)"
_PY312 = "needs the Python 3.12 venv with jax[tpu] / sglang-jax (docs/install.md); those tests skip on CI's 3.11"
_SUITE = "runs the test suite or part of it"

# Commands not run here: a regex over the command -> why not. A new guide's command that fits none of these is
# listed by test_every_command_is_run_or_says_why_not: run it in RUN (seconds on CPU) or give it a reason here.
NOT_RUN = [
  (r"^bash scripts/test\.sh$|python -m pytest", _SUITE),
  (r"^bash scripts/(demo|recipe)\.sh", _TRAINS),
  (r"^python launch/(train|rl)\.py (?!.*--(dry_run|aot))", _TRAINS),
  (
    r"^python launch/rl\.py --config=configs/rl\.py:1t --dry_run$",
    "builds the 1T memory plan (~10 s); tests/rl covers --dry_run",
  ),
  (r"--aot=", "compiles for a TPU slice: needs jax[tpu] (Python 3.12; tests/train/test_aot.py skips without libtpu)"),
  (
    r"^XLA_FLAGS=--xla_force_host_platform_device_count=2 python launch/train\.py",
    "two processes training; tests/train/test_multihost.py runs them",
  ),
  (
    r"^python launch/sweep\.py",
    "runs (or prints) one training per setting; tests/train/test_scripts.py covers launch/sweep.py",
  ),
  (r"^python launch/synth\.py", "synthesis against a model, minutes; tests/agentic runs the pipeline"),
  (r"^python launch/rephrase\.py", "needs an LLM endpoint; tests/data/test_rephrase.py uses a local fake"),
  (r"^python launch/convert\.py|^\$POD ", _DATA),
  (r"^python launch/eval\.py|^python launch/plot\.py --compare", _DATA),
  (
    r"^python launch/swe_build\.py|^python -m k2jax\.swe\.grade|^scripts/swe_sources\.sh",
    "builds or grades SWE tasks (minutes, or downloads); tests/swe runs them on the toy repository",
  ),
  (
    r"^python launch/serve\.py|^python -m k2jax\.agentic\.envs|launch/sglang_server\.sh|^lm_eval |curl |^kill %1",
    _SERVER,
  ),
  (r"^python bench/", "a benchmark: minutes, and its figures are in docs/results.md"),
  (r"^bash launch/tpu_pod\.sh|^POD=|sbatch |^docker |kustomize |^kubectl ", _CLUSTER),
  (r"nvidia-smi|pip install .*gpu", _ACCEL),
  (r"^python3(\.12)? -m venv|^\$\(pyenv root\)|pip install|^git clone", _INSTALL),
  (
    r"^\.venv312/bin/python|^JAX_PLATFORMS=cpu (XLA_FLAGS=\S+ )?\.venv312|^PYTHON=\.venv312|^mkdir -p /tmp/fleet",
    _PY312,
  ),
  (r"^echo .*> /tmp/eval_tasks\.json$", "writes a file for the next command, which reads your data"),
  (r"^ruff format \.$", "rewrites the tree; tests/test_style.py runs `ruff format --check`"),
  (
    r"^python scripts/config_reference\.py$",
    "rewrites docs/config-reference.md; tests/test_config_reference.py checks it",
  ),
  (r"^\. \.venv/bin/activate", _SUITE),
]

PATH_PREFIXES = ("k2jax", "tests", "bench", "launch", "configs", "scripts", "data", "deploy", "docs")
_PATH = re.compile(r"(?<![\w/.~$<-])((?:%s)/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/])" % "|".join(PATH_PREFIXES))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_MODULE = re.compile(r"python3?(?:\.\d+)? -m ([A-Za-z_][\w.]*)")
EXTERNAL_MODULES = {"pytest", "venv", "pip", "sgl_jax.launch_server", "sglang.launch_server"}
ABSL_FLAGS = {"helpfull", "help", "flagfile", "logtostderr", "alsologtostderr", "v", "verbosity"}


@functools.cache
def _text(doc: str) -> str:
  with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
    return f.read()


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return s.replace(" ", "-")


@functools.cache
def _anchors(doc: str) -> frozenset:
  seen, out = {}, set()
  for line in _text(doc).splitlines():
    m = re.match(r"#{1,6} (.*)", line)
    if m:
      base = _slug(m.group(1))
      n = seen.get(base, 0)
      out.add(base if n == 0 else f"{base}-{n}")
      seen[base] = n + 1
  return frozenset(out)


def _prose(doc: str) -> str:
  """The doc without its fenced blocks' contents."""
  return re.sub(r"```.*?```", "", _text(doc), flags=re.S)


def _commands(doc: str) -> list[str]:
  """Each command line of the doc's ```bash blocks: continuations joined, trailing comments dropped."""
  out = []
  for block in re.findall(r"```bash\n(.*?)```", _text(doc), flags=re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = re.sub(r"(^|\s)#.*$", "", line)
      line = re.sub(r"\s+", " ", line).strip()
      if line:
        out.append(line)
  return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
  bad = []
  for target in _LINK.findall(_prose(doc)):
    if re.match(r"[a-z]+:", target):
      continue
    path, _, anchor = target.partition("#")
    rel = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
    if not os.path.exists(os.path.join(ROOT, rel)):
      bad.append(f"{target}: no file {rel}")
    elif anchor and rel.endswith(".md") and anchor not in _anchors(rel):
      bad.append(f"{target}: no heading #{anchor} in {rel}")
  assert not bad, f"{doc}: broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_and_modules_exist(doc):
  text, bad = _text(doc), []
  for path in sorted(set(_PATH.findall(text))):
    path = path.rstrip("/")
    if "*" in path:
      if not glob.glob(os.path.join(ROOT, path)):
        bad.append(f"{path}: matches nothing")
    elif not os.path.exists(os.path.join(ROOT, path)):
      bad.append(f"{path}: no such file or directory")
  for module in sorted(set(_MODULE.findall(text))):
    if module in EXTERNAL_MODULES:
      continue
    base = os.path.join(ROOT, *module.split("."))
    if not (os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__main__.py"))):
      bad.append(f"python -m {module}: not a runnable module of this repository (nor a known third-party one)")
  assert not bad, f"{doc}:\n" + "\n".join(bad)


@functools.cache
def _launcher_flags(launcher: str) -> frozenset:
  with open(os.path.join(ROOT, launcher)) as f:
    src = f.read()
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", src)) | set(re.findall(r"add_argument\(\s*\"--([\w-]+)\"", src))
  names |= set(re.findall(r"(?m)^\s+--([\w-]+)[=)|]", src)) if launcher.endswith(".sh") else ABSL_FLAGS
  if "compile_cache.define_flag()" in src:
    names |= {"compile_cache_dir", "compile_log_min_secs"}
  return frozenset(names)


@functools.cache
def _config_keys(config: str | None) -> frozenset:
  """Dotted keys of a config file's presets (all config files' when None); `tasks.<name>.x` as a pattern."""
  gen = sys.modules.get("config_reference")  # tests/test_config_reference.py's, when the same process ran it
  if gen is None:
    spec = importlib.util.spec_from_file_location(
      "config_reference", os.path.join(ROOT, "scripts", "config_reference.py")
    )
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up there
    spec.loader.exec_module(gen)
  files = [config] if config else sorted(gen.ROOTS)
  return frozenset(row.key for rel in files for row in gen.reference_for(rel)[1])


def _is_knob(key: str, keys: frozenset) -> bool:
  return key in keys or any(re.fullmatch(re.escape(k).replace(r"<name>", r"[^.]+"), key) for k in keys if "<name>" in k)


@pytest.mark.parametrize("doc", DOCS)
def test_launcher_flags_and_config_keys_exist(doc):
  bad = []
  inline = re.findall(r"`((?:python3? )?(?:launch|bench|scripts)/\w+\.(?:py|sh) [^`]*)`", _prose(doc))
  for cmd in _commands(doc) + inline:
    m = re.search(r"((?:launch|bench|scripts)/\w+\.(?:py|sh))(.*)", cmd)
    if not m:
      continue
    launcher, rest = m.groups()
    if launcher.endswith(".sh") and not _launcher_flags(launcher):
      continue  # a script of positional arguments, or one that hands its flags to another program
    config = re.search(r"--config=(configs/[\w/]+\.py)", rest)
    for flag in re.findall(r"(?<!\S)--(\w[\w.-]*)", rest.split(" -- ")[0]):
      if flag.startswith("config."):
        if not _is_knob(flag[len("config.") :], _config_keys(config.group(1) if config else None)):
          bad.append(f"{cmd}: --{flag} is not a knob of {config.group(1) if config else 'any config'}")
      elif flag not in _launcher_flags(launcher) and not (
        flag.startswith("no") and flag[2:] in _launcher_flags(launcher)
      ):
        bad.append(f"{cmd}: {launcher} defines no --{flag}")
  for key in re.findall(r"`--config\.([\w.]+)=", _prose(doc)):
    if not _is_knob(key, _config_keys(None)):
      bad.append(f"--config.{key}: not a knob of any config file")
  assert not bad, f"{doc}:\n" + "\n".join(bad)


def test_every_command_is_run_or_says_why_not():
  unlisted = []
  for doc in DOCS:
    for cmd in _commands(doc):
      if cmd not in RUN and not any(re.search(pattern, cmd) for pattern, _ in NOT_RUN):
        unlisted.append(f"{doc}: {cmd}")
  assert not unlisted, "commands neither run by tests/test_docs.py (RUN) nor listed with a reason (NOT_RUN):\n" + (
    "\n".join(unlisted)
  )
  documented = {cmd for doc in DOCS for cmd in _commands(doc)}
  assert set(RUN) <= documented, f"RUN names commands no doc has: {set(RUN) - documented}"


@pytest.mark.parametrize("cmd", sorted(RUN))
def test_documented_command_runs(cmd):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  text = out.stdout + out.stderr
  assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{text[-3000:]}"
  assert re.search(RUN[cmd], text), f"{cmd}: output does not match {RUN[cmd]!r}\n{text[-3000:]}"
