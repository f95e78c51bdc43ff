"""Run a script as n processes of one jax.distributed job on this machine (CPU collectives over
loopback): `python -m rhino_jax.launch -n 2 --local-devices 4 script.py [args...]`.

Each process gets `--local-devices` emulated CPU devices (or the machine's own devices when the
option is not given), joins the job before the script runs (coordinator on 127.0.0.1), and runs
the script as `__main__`; a script that calls `jax.distributed.initialize()` itself, as it would
on a cluster, runs unchanged (the call is answered by the launcher's initialization). Output
lines are prefixed with the process index. When a process fails, the launcher stops the others
and exits with its code, so a job never hangs on a dead peer; `--timeout` bounds the whole run.

On a GPU cluster there is no launcher to run: start the script once per host (SLURM `srun`,
`mpirun`, ...) and call `jax.distributed.initialize()` in it, which detects those environments.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings

_CHILD = "RHINO_JAX_LAUNCH_CHILD"  # "process_id,num_processes,coordinator,heartbeat_s" in a child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rhino_jax.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    parser.add_argument("--local-devices", type=int, help="emulated CPU devices per process (default: the real ones)")
    parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout", type=float, help="seconds before the whole job is stopped")
    parser.add_argument("--heartbeat", type=int, default=10,
                        help="seconds without a heartbeat before jax.distributed declares a process dead")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    if opts.num_processes < 1:
        parser.error("-n must be at least 1")
    if opts.local_devices is not None and opts.local_devices < 1:
        parser.error("--local-devices must be at least 1")
    if not os.path.isfile(opts.script):
        parser.error(f"no script {opts.script!r}")
    coordinator = f"127.0.0.1:{opts.port or _free_port()}"
    children = []
    for pid in range(opts.num_processes):
        env = dict(os.environ, **{_CHILD: f"{pid},{opts.num_processes},{coordinator},{opts.heartbeat}"})
        if opts.local_devices:
            flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={opts.local_devices}".strip()
            env["JAX_PLATFORMS"] = "cpu"
        child = subprocess.Popen([sys.executable, "-m", "rhino_jax.launch", opts.script, *opts.args], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        for stream, to in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            threading.Thread(target=_relay, args=(pid, stream, to), daemon=True).start()
        children.append(child)
    return _wait(children, opts.timeout)


def _relay(pid: int, stream, to) -> None:
    for line in stream:
        to.write(f"[{pid}] {line}")
        to.flush()


def _wait(children: list[subprocess.Popen], timeout: float | None) -> int:
    """Every child's exit; the first failure (or the time-out) stops the others."""
    start = time.monotonic()
    while True:
        codes = [c.poll() for c in children]
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed or (timeout is not None and time.monotonic() - start > timeout):
            why = (f"process {failed[0][0]} exited with code {failed[0][1]}" if failed
                   else f"the job ran past --timeout {timeout:g} s")
            _stop([c for c, code in zip(children, codes) if code is None])
            print(f"rhino_jax.launch: {why}; stopped the other processes", file=sys.stderr, flush=True)
            return failed[0][1] if failed else 124
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)


def _stop(children: list[subprocess.Popen]) -> None:
    for c in children:
        c.terminate()
    deadline = time.monotonic() + 5
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(spec: str, script: str, args: list[str]) -> None:
    """Join the job, then run the script as __main__."""
    pid, n, coordinator, heartbeat = spec.split(",")
    import jax

    if os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, int(n), int(pid), heartbeat_timeout_seconds=int(heartbeat),
                               initialization_timeout=120)

    def joined(*_args, **_kwargs) -> None:
        warnings.warn("jax.distributed.initialize(): already initialized by rhino_jax.launch", stacklevel=2)

    jax.distributed.initialize = joined
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as e:  # noqa: BLE001 (every failure must end this process now)
        _exit_now(e)


def _exit_now(error: BaseException) -> None:
    """End a failed child at once: a normal exit runs jax.distributed's shutdown barrier, which
    waits (minutes) for peers still blocked in a collective with this process, so the launcher
    would not see the failure and the job would hang until its --timeout."""
    if isinstance(error, SystemExit):
        if error.code in (None, 0):
            raise error
        code = error.code if isinstance(error.code, int) else 1
        if not isinstance(error.code, int):
            print(error.code, file=sys.stderr)
    else:
        traceback.print_exception(error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if _CHILD in os.environ:
        spec = os.environ.pop(_CHILD)
        _child(spec, sys.argv[1], sys.argv[2:])
    else:
        sys.exit(main())
