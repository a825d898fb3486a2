"""Run a repository's pytest tests in the sandbox and read per-test outcomes from a channel the code under
test can neither forge by accident nor reach by name.

The code under test shares its interpreter with pytest (tests call it directly), so in principle it can
reach anything pytest holds. The defence is in layers, each with its own test (tests/swe/test_exploits.py);
any breach makes the run `tampered`, with the reason in `TestRun.tamper`:
1. nothing by name: the harness (an entry file run by `sandbox.workspace.run_entry` as `python -I -S`, so
   neither PYTHONPATH, sitecustomize nor .pth files of the repository apply) is one function that removes
   itself from `__main__` before it runs; its spec and per-run nonce come on stdin (never in its source or
   environment, stdin is then /dev/null), its state lives in locals and closures only, it deletes its own
   file and makes the process non-dumpable (its own /proc/self/mem is closed to it). It puts only the
   read-only test tools on sys.path and imports pytest from there (a `pytest.py` the repository adds cannot
   shadow it), reads every test and conftest file before any repository code runs, then puts /testbed on
   sys.path and runs `pytest.main` with plugin autoloading off and a reporter plugin;
2. the plugins and hook implementations: every plugin registered after the reporter must be a module or
   class of the read-only test tools, or a conftest file of /testbed (restored from the pristine copy by the
   grader) whose hook functions are that file's code; at the session's end every hook implementation belongs
   to an accepted plugin and is the function it registered, the plugin manager's and hook callers' call
   paths are the ones they started with, and every function and class of pytest, pluggy and the other tools
   and every builtin is the object it was (the old fingerprint);
3. the tests: each collected test function's code must be the code pytest compiles (assertion rewriting
   included) from the file as read before the run, and still be that function and code at the end; no
   tracing or profiling hook may be active when a report is made; reports must be pytest's own class;
4. the records: one nonce-tagged JSON record per test phase (setup, call, teardown) and collection error,
   the list of collected tests, `checked` after the checks and `end <exit>`: every line must carry the
   nonce, START must come (else it is an infrastructure failure: pytest never ran), END must come and agree
   with the process's exit status (`os._exit(0)` or `sys.exit(0)` from the code under test, a crash, a
   timeout: no agreement), each (test, phase) has exactly one record, only collected tests have records, and
   a test is passed only with passing setup, call and teardown records.
The grader adds the layers outside the process: a static check of the patch's added lines (`hackcheck.py`)
and the test files hashed before and after the run (`grade.py`). Residual risk: code that reads the nonce
through the interpreter's internals and rewrites the whole report; each such route (frames, gc, ctypes,
sys.modules, tracing hooks, os._exit) is what the static check refuses.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Sequence

from k2jax.sandbox.runner import SandboxUnavailable
from k2jax.sandbox.workspace import WorkspaceRunConfig, run_entry

PASSED = ("passed", "xfailed", "xpassed")  # SWE-bench: XFAIL counts as passed


@dataclasses.dataclass(frozen=True)
class TestRun:
  outcomes: dict[str, str]  # node id -> passed | failed | skipped | xfailed | xpassed | error
  collect_errors: tuple[str, ...]  # node ids (files) that failed to collect
  exit_code: int
  started: bool  # pytest was imported and began (False: an infrastructure failure)
  ended: bool  # the reporter wrote END
  end_code: int | None  # pytest's exit status as the reporter saw it
  tampered: bool  # the report or the test machinery was interfered with (`tamper` says how)
  timed_out: bool
  output: str  # the end of pytest's console output
  elapsed_s: float
  tamper: tuple[str, ...] = ()  # every breach found, in words

  @property
  def reason(self) -> str:
    """Why this run gives no verdict ("" when it does)."""
    if self.tamper:
      return "tampering: " + "; ".join(self.tamper[:5])
    if not self.ended:
      return f"pytest did not finish (exit {self.exit_code}{', timed out' if self.timed_out else ''})"
    if self.end_code != self.exit_code:
      return f"pytest reported exit {self.end_code} but the process exited {self.exit_code}"
    return ""

  @property
  def consistent(self) -> bool:
    """pytest finished, its own exit status is the process's, and nothing forged records."""
    return self.started and self.ended and self.end_code == self.exit_code and not self.tampered and not self.tamper

  def passed(self, node_id: str) -> bool:
    return self.consistent and self.outcomes.get(node_id) in PASSED


class InfraError(RuntimeError):
  """The tests could not be run at all (sandbox unavailable, pytest missing): masked, never scored."""


def run_tests(
  workspace: str,
  test_ids: Sequence[str] = (),
  config: WorkspaceRunConfig = WorkspaceRunConfig(),
  touched: Sequence[str] = (),
) -> TestRun:
  """Runs `test_ids` (all of the repository's tests when empty) of the tree at `workspace`. `touched`: the
  files (relative paths) a patch under grading changed; pytest plugins may come from the repository's
  other files and its tests, never from these."""
  nonce = secrets.token_hex(16)
  args = ["-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", "-o", "addopts=", "--rootdir=/testbed"]
  try:
    import pytest_timeout  # noqa: F401  (the per-test deadline, when installed with the test tools)

    args += ["-p", "pytest_timeout", f"--timeout={max(1, int(config.timeout_s))}"]
  except ImportError:
    pass
  spec = json.dumps({"nonce": nonce, "args": args + list(test_ids), "touched": list(touched)})
  try:
    r = run_entry({"harness.py": _HARNESS}, "harness.py", workspace, config, stdin=spec)
  except SandboxUnavailable as e:
    raise InfraError(str(e)) from None
  run = _parse(r.report, nonce, r.returncode, r.timed_out, (r.stdout + r.stderr)[-6000:], r.elapsed_s)
  if not run.started:
    raise InfraError(f"pytest did not start in the sandbox ({r.reason}): {(r.stderr or r.stdout)[-500:]}")
  return run


def _parse(report: str, nonce: str, code: int, timed_out: bool, output: str, elapsed: float) -> TestRun:
  phases: dict[str, dict[str, dict]] = {}
  collect_errors, started, end_code, collected, checked = [], False, None, None, False
  tamper: list[str] = []

  def breach(why: str) -> None:
    if why not in tamper:
      tamper.append(why)

  for line in report.splitlines():
    tag, _, body = line.partition(" ")
    if tag != nonce:
      breach("a line without the run's nonce reached the report pipe")
      continue
    try:
      rec = json.loads(body)
      kind = rec["t"]
    except (json.JSONDecodeError, TypeError, KeyError):  # cut short (the report cap) or garbled: no verdict
      breach("a garbled record on the report pipe")
      continue
    if kind == "start":
      started = True
    elif kind == "end":
      end_code = int(rec["code"])
    elif kind == "collected":
      if collected is not None:
        breach("two lists of collected tests")
      collected = set(rec["ids"])
    elif kind == "collect":
      collect_errors.append(rec["id"])
    elif kind == "tamper":
      breach(str(rec["why"]))
    elif kind == "checked":
      checked = True
    elif kind == "test":
      node, when = rec["id"], rec["when"]
      if collected is not None and node not in collected:
        breach(f"a record for {node!r}, which pytest did not collect")
      if when in phases.setdefault(node, {}):
        breach(f"two {when} records for {node!r}")
      phases[node][when] = rec
  if started and end_code is not None and not checked:
    breach("pytest ended but the harness's checks did not run")
  outcomes = {node: _outcome(p) for node, p in phases.items()}
  return TestRun(
    outcomes, tuple(collect_errors), code, started, end_code is not None, end_code, bool(tamper), timed_out, output,
    elapsed, tuple(tamper),
  )  # fmt: skip


def _outcome(phases: dict[str, dict]) -> str:
  """One test's outcome from its setup, call and teardown records: passing needs all three to pass."""
  setup, call, teardown = phases.get("setup"), phases.get("call"), phases.get("teardown")
  if setup is None or setup["outcome"] == "failed":
    return "error"
  if setup["outcome"] == "skipped":
    return "xfailed" if setup.get("xfail") else "skipped"
  if call is None:  # the test never ran, or its record was suppressed
    return "error"
  if call["outcome"] == "failed":
    out = "failed"
  elif call["outcome"] == "skipped":
    out = "xfailed" if call.get("xfail") else "skipped"
  else:
    out = "xpassed" if call.get("xfail") else "passed"
  if teardown is None or teardown["outcome"] == "failed":
    return "error" if out != "failed" else out
  return out


_HARNESS = r'''
import os, sys


def _harness():
    import ast, builtins, ctypes, json, operator, pathlib, types
    raw = bytearray()
    while chunk := os.read(0, 1 << 16):
        raw += chunk
    spec = json.loads(bytes(raw))
    del raw
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    tag = spec.pop("nonce").encode() + b" "
    fd = int(os.environ.pop("K2JAX_REPORT_FD"))
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: /proc/self/mem is closed to this process
    os.unlink(__file__)
    # The harness's own tools, bound now: later rebinding of os, json or a builtin does not reach them.
    write, dumps, realpath, walk, join, _exit = os.write, json.dumps, os.path.realpath, os.walk, os.path.join, os._exit
    _id, _type, _vars, _callable, _isinstance, _getattr, _list, _sorted = (
        id, type, vars, callable, isinstance, getattr, list, sorted)
    _dict, _len, _all, _map, is_ = dict, len, all, map, operator.is_
    gettrace, getprofile, modules = sys.gettrace, sys.getprofile, sys.modules
    ModuleType, FunctionType = types.ModuleType, types.FunctionType

    def emit(rec):
        data = tag + dumps(rec).encode() + b"\n"
        while data:
            data = data[write(fd, data):]

    tools = os.environ["K2JAX_PYTHONPATH"].split(os.pathsep)[1:]
    testbed = os.environ["K2JAX_TESTBED"]
    sys.path[:0] = tools
    os.environ.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTHONDONTWRITEBYTECODE="1", HOME=os.environ["HOME"])
    os.environ.update(json.loads(os.environ.pop("K2JAX_ENV")))
    # From the read-only tools, before the repository is on the path.
    import pytest, pluggy, _pytest.reports  # noqa: E401
    from _pytest.assertion.rewrite import rewrite_asserts
    TestReport, CollectReport = _pytest.reports.TestReport, _pytest.reports.CollectReport
    emit({"t": "start"})
    tool_dirs = tuple(realpath(t) + os.sep for t in tools)
    testbed_dir = realpath(testbed) + os.sep

    tool_files = {}

    def tool_file(f):
        """Whether `f` is a file of the read-only tools. Cached per exact str: realpath per call was most of
        the checks' time, and what a path under the read-only tools resolves to cannot change."""
        if _type(f) is not str:  # a str subclass may hash or compare as it likes: never cached
            return _isinstance(f, str) and realpath(f).startswith(tool_dirs)
        hit = tool_files.get(f)
        if hit is None:
            hit = tool_files[f] = realpath(f).startswith(tool_dirs)
        return hit

    # Every test and conftest file as it is before any code of the repository runs.
    sources, size = {}, 0
    for d, dirs, names in walk(testbed):
        dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("__pycache__", "node_modules")]
        for n in names:
            parts = d[len(testbed):].split(os.sep)  # snapshot.is_test_path's rule: these are restored
            if n.endswith(".py") and (n.startswith("test_") or n.endswith("_test.py") or n == "conftest.py"
                                      or any(x in ("tests", "test", "testing") for x in parts)):
                p = realpath(join(d, n))
                if size < 64 << 20:
                    with open(p, "rb") as f:
                        sources[p] = f.read()
                    size += len(sources[p])
    compiled = {}

    def pristine_code(path, config):
        """{qualname: [code objects]} of a pre-read file, compiled as pytest does (and plain)."""
        if path not in compiled:
            out = {}
            src = sources.get(path)
            if src is not None:
                variants = []
                try:
                    tree = ast.parse(src, filename=path)
                    rewrite_asserts(tree, src, pathlib.Path(path), config)
                    variants.append(compile(tree, path, "exec", dont_inherit=True))
                except Exception:
                    pass
                try:
                    variants.append(compile(src, path, "exec", dont_inherit=True))
                except Exception:
                    pass
                stack = variants
                while stack:
                    co = stack.pop()
                    out.setdefault(co.co_qualname, []).append(co)
                    stack += [c for c in co.co_consts if _isinstance(c, _type(co))]
            compiled[path] = out
        return compiled[path]

    def snapshot():
        """Copies of the namespaces of the tools' modules and of every class they hold, builtins and sys's
        hooks: dict copies in C, so taking one costs little; `fingerprint` reads its identities."""
        mods, classes = {}, {}
        for name, mod in _list(modules.items()):
            if mod is None or not tool_file(_getattr(mod, "__file__", None)):
                continue
            ns = _dict(_vars(mod))
            held = [v for v in ns.values() if _isinstance(v, _type)]
            for cls in held:
                if _id(cls) not in classes:
                    classes[_id(cls)] = (cls, _dict(_vars(cls)))
            mods[name] = (mod, ns, held)
        hooks = {k: _getattr(sys, k, None) for k in ("settrace", "setprofile", "gettrace", "getprofile", "exit",
                                                     "_getframe", "excepthook")}
        return {"mods": mods, "classes": classes, "builtins": _dict(_vars(builtins)), "sys": hooks}

    def fingerprint(snap, names):
        """{(module, name): function or class, (module, class, member): member} of modules `names` of a
        snapshot, the identity of every function and class (and class member) they hold."""
        out = {}
        for name in names:
            entry = snap["mods"].get(name)
            if entry is None:
                continue
            for key, val in _list(entry[1].items()):
                if _callable(val):
                    out[(name, key)] = val
                    if _isinstance(val, _type):
                        for k2, v2 in _list(snap["classes"][_id(val)][1].items()):
                            if _callable(v2) or _isinstance(v2, (staticmethod, classmethod, property)):
                                out[(name, key, k2)] = v2
        return out

    def same(a, b):
        """The same keys and values, in the same order, by identity (in C): no equality a value defines."""
        return _len(a) == _len(b) and _all(_map(is_, a, b)) and _all(_map(is_, a.values(), b.values()))

    def changes(before, after):
        """What differs between two snapshots, as the full fingerprints of both would say, read in full only
        for the modules whose namespace, or a class they hold, is not the same objects as before."""
        names = []
        for name, (mod, ns, held) in _list(before["mods"].items()):
            now = after["mods"].get(name)
            if (now is None or now[0] is not mod or not same(ns, now[1]) or _len(held) != _len(now[2])
                    or not _all(_map(is_, held, now[2]))
                    or not _all(same(before["classes"][_id(c)][1], after["classes"][_id(c)][1]) for c in held)):
                names.append(name)
        old, new = fingerprint(before, names), fingerprint(after, names)
        for part in ("builtins", "sys"):
            old.update({(part, k): v for k, v in before[part].items()})
            new.update({(part, k): v for k, v in after[part].items()})
        missing = object()
        changed = [str(k) for k, v in old.items() if new.get(k, missing) is not v and not from_tools(new.get(k))]
        added = [str(k) for k, v in new.items() if k not in old and _len(k) == 2 and k[0] != "builtins"
                 and k[0] in before["mods"] and not from_tools(v)]
        return _sorted(changed + added)

    def from_tools(obj):
        """pytest's own plugins patch pytest at configure time (legacypath): with functions of the tools."""
        obj = _getattr(obj, "__func__", obj)
        code = _getattr(obj, "__code__", None)
        if code is not None:
            return tool_file(code.co_filename)
        mod = modules.get(_getattr(obj, "__module__", None) or "")
        return _isinstance(obj, _type) and mod is not None and tool_file(_getattr(mod, "__file__", None))

    state = {"pm": None, "accepted": {}, "impls": set(), "callers": {}, "items": {}}
    breaches = []

    def breach(why):
        if why not in breaches:
            breaches.append(why)
            emit({"t": "tamper", "why": why})

    touched = frozenset(realpath(join(testbed, t)) for t in spec.get("touched", ()))

    def repo_file(f):
        """A test file read before the run, or a file of the repository the patch left alone."""
        if not _isinstance(f, str):
            return False
        p = realpath(f)
        return p in sources or (p.startswith(testbed_dir) and p not in touched)

    def home_of(plugin):
        """The file a plugin's code must come from: a module's own, or its class's module's."""
        if _isinstance(plugin, ModuleType):
            return _getattr(plugin, "__file__", None)
        return _getattr(modules.get(_getattr(_type(plugin), "__module__", "")), "__file__", None)

    def verdict_on(plugin, name):
        """None when `plugin` may take part in the run, else what it is. Its hook functions are checked
        against its file at the end."""
        if plugin is None or plugin is reporter:
            return None
        f = home_of(plugin)
        if _isinstance(plugin, ModuleType):
            if tool_file(f) or repo_file(f):
                return None
            return f"module {_getattr(plugin, '__name__', '?')!r} from {f!r}"
        cls = _type(plugin)
        if tool_file(f) and _getattr(modules.get(cls.__module__), cls.__name__, None) is cls:
            return None
        if repo_file(f):
            return None
        return f"an object of class {cls.__qualname__} from {cls.__module__} ({f})"

    def impls_of(pm):
        out = set()
        for hname, caller in _list(_vars(pm.hook).items()):
            for impl in caller.get_hookimpls():
                out.add((hname, _id(impl.plugin), _id(impl.function)))
        return out

    def callers_of(pm):
        return {k: (_id(v), _id(_getattr(v, "_hookexec", None))) for k, v in _list(_vars(pm.hook).items())}

    def code_of(item):
        fn = _getattr(item, "obj", None)
        fn = _getattr(fn, "__func__", fn)
        for _ in range(16):  # decorators that keep the test function (functools.wraps, mock.patch)
            inner = _getattr(fn, "__wrapped__", None)
            if inner is None:
                break
            fn = _getattr(inner, "__func__", inner)
        return fn, _getattr(fn, "__code__", None)

    class Reporter:
        @pytest.hookimpl(tryfirst=True)
        def pytest_plugin_registered(self, plugin, manager):
            if state["pm"] is None:  # the first call is the replay of pytest's own plugins, before any conftest
                state["pm"] = manager
                state["pm_attrs"] = {k: _id(v) for k, v in _list(_vars(manager).items()) if _callable(v)}
                state["before"] = snapshot()
            why = verdict_on(plugin, manager.get_name(plugin))
            if why is not None:
                breach(f"a plugin was registered during the run: {why}")
                return
            state["accepted"][_id(plugin)] = plugin
            state.setdefault("classes", {})[_id(plugin)] = _type(plugin)
            for hname, caller in _list(_vars(manager.hook).items()):
                for impl in caller.get_hookimpls():
                    if impl.plugin is plugin:
                        state["impls"].add((hname, _id(plugin), _id(impl.function)))
            for k, v in callers_of(manager).items():
                state["callers"].setdefault(k, v)

        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(self, session):
            emit({"t": "collected", "ids": [item.nodeid for item in session.items]})
            for item in session.items:
                fn, code = code_of(item)
                state["items"][item.nodeid] = (item, _id(_getattr(item, "obj", None)), fn, code)
                if code is None:
                    continue  # not a Python function (a doctest): nothing to compare
                where = realpath(code.co_filename)
                if not where.startswith(testbed_dir):
                    continue  # a decorator's wrapper from a library: the test's own code is not in view
                if where == realpath(str(item.path)) or where in sources:  # the test's file, or a test helper's
                    ok = code in pristine_code(where, session.config).get(code.co_qualname, ())
                else:  # a wrapper from the repository's own code: only from a file the patch left alone
                    ok = where not in touched
                if not ok:
                    breach(f"the code of test {item.nodeid} is not its file's as read before the run")

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report):
            if _type(report) is not TestReport:
                breach(f"a test report of a foreign class {_type(report).__qualname__}")
            if gettrace() is not None or getprofile() is not None:
                breach("a tracing or profiling hook was active while tests ran")
            rec = {"t": "test", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
                   "xfail": _getattr(report, "wasxfail", None) is not None}
            emit(rec)

        @pytest.hookimpl(tryfirst=True)
        def pytest_collectreport(self, report):
            if _type(report) is not CollectReport:
                breach(f"a collection report of a foreign class {_type(report).__qualname__}")
            if report.failed:
                emit({"t": "collect", "id": report.nodeid or "<session>"})

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session):  # before pytest's own cleanup undoes its plugins' setattrs
            check(session)
            emit({"t": "checked"})

    def check(session):
        pm = state["pm"]
        if pm is None or session.config.pluginmanager is not pm:
            breach("the plugin manager is not the one the run started with")
            return
        changed = changes(state["before"], snapshot())
        if changed:
            breach(f"pytest, pluggy or builtins were changed during the run: {changed[:5]}")
        attrs = {k: _id(v) for k, v in _list(_vars(pm).items()) if _callable(v)}
        if attrs != state["pm_attrs"]:
            breach("the plugin manager's call path was replaced")
        now = callers_of(pm)
        moved = _sorted(k for k, v in state["callers"].items() if now.get(k) != v)
        if moved or _sorted(set(now) - set(state["callers"])):
            breach(f"hook callers were replaced or added: {(moved or _sorted(set(now) - set(state['callers'])))[:5]}")
        for hname, plugin_id, fn_id in _sorted(impls_of(pm) - state["impls"]):
            plugin = state["accepted"].get(plugin_id)
            what = pm.get_name(plugin) if plugin is not None else "a plugin never registered"
            breach(f"a hook implementation was added or replaced: {hname} of {what}")
        for hname, plugin_id, fn_id in _sorted(state["impls"] - impls_of(pm)):
            if state["accepted"].get(plugin_id) is reporter or pm.is_registered(state["accepted"].get(plugin_id)):
                breach(f"a hook implementation was removed: {hname}")
        for key, plugin in _list(state["accepted"].items()):
            if _type(plugin) is not state["classes"][key]:
                breach(f"plugin {pm.get_name(plugin)} changed class during the run (to {_type(plugin).__qualname__})")
        for plugin in _list(state["accepted"].values()):  # the repository's plugins: their own file's code
            f = home_of(plugin)
            if plugin is None or plugin is reporter or f is None or tool_file(f):
                continue
            for hname, caller in _list(_vars(pm.hook).items()):
                for impl in caller.get_hookimpls():
                    if impl.plugin is not plugin:
                        continue
                    fn = _getattr(impl.function, "__func__", impl.function)
                    co = _getattr(fn, "__code__", None)
                    ok = co is not None and realpath(co.co_filename) == realpath(f)
                    if ok and realpath(f) in sources:
                        ok = co in pristine_code(realpath(f), session.config).get(co.co_qualname, ())
                    if not ok:
                        breach(f"hook {hname} of plugin {pm.get_name(plugin)} is not the code of {f}")
        for node, (item, obj_id, fn, code) in _list(state["items"].items()):
            now_fn, now_code = code_of(item)
            if _id(_getattr(item, "obj", None)) != obj_id or now_fn is not fn or now_code is not code:
                breach(f"test {node} was changed during the run")
        if gettrace() is not None or getprofile() is not None:
            breach("a tracing or profiling hook was left active")

    reporter = Reporter()
    sys.path.insert(0, testbed)
    os.chdir(testbed)
    code = int(pytest.main(spec["args"], plugins=[reporter]))
    emit({"t": "end", "code": code})
    sys.stdout.flush()
    sys.stderr.flush()
    _exit(code)


globals().pop("_harness")()
'''
