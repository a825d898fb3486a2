"""`python -m k2jax.agentic.envs --env=sim_tools --port=8080 [--egress_allow=host:port,...]`: one env service.

Prints `READY <port>` once serving. Without --egress_allow the process may open no outbound connection.
With --exit_on_stdin_eof (an `EnvPool` worker) it exits when its stdin closes: the pool's process holds the
other end, so a learner that dies (SIGKILL included) takes its workers with it.
"""

import os
import sys
import threading

from absl import app, flags

from k2jax.agentic.guards import install_egress_hook
from k2jax.agentic.envs.service import EnvService

_ENV = flags.DEFINE_string("env", "sim_tools", "Environment to host (sim_tools | code | swe).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Bind address (0.0.0.0 in a container).")
_PORT = flags.DEFINE_integer("port", 0, "Port (0 = any free port; printed as READY <port>).")
_EGRESS = flags.DEFINE_list("egress_allow", [], "host:port targets tools may reach (default: none).")
_TTL = flags.DEFINE_float("episode_ttl_s", 600.0, "Idle episodes are dropped after this many seconds.")
_EXIT_ON_EOF = flags.DEFINE_bool("exit_on_stdin_eof", False, "Exit when stdin closes (the parent's end of a pipe).")


def _exit_on_stdin_eof() -> None:
  while sys.stdin.buffer.read(65536):
    pass
  os._exit(0)  # its sandbox runs die with it (their launchers' PDEATHSIG)


def main(argv) -> None:
  del argv
  install_egress_hook(set(_EGRESS.value))  # no targets: no outbound connections at all
  if _EXIT_ON_EOF.value:
    threading.Thread(target=_exit_on_stdin_eof, daemon=True, name="exit-on-stdin-eof").start()
  service = EnvService(_ENV.value, host=_HOST.value, port=_PORT.value, episode_ttl_s=_TTL.value)
  print(f"READY {service.port}", flush=True)
  service.serve_forever()


if __name__ == "__main__":
  app.run(main)
