"""A real two-node Slurm cluster on this one machine, for the tests and for trying the recipes.

    python tests/slurm_cluster.py up|down|status [--dir DIR]

Expects Debian's `slurm-wlm` and `munge` packages (`apt-get install -y slurm-wlm munge`) and root
(the daemons run as root; `n1 n2` are added to /etc/hosts when they do not resolve). `up` writes a
munge key, `slurm.conf` and the state, spool and log folders under DIR (default
$TMPDIR/pretrain-slurm), then starts `munged` (its own socket and key there), one `slurmctld` and
two `slurmd` (`-N n1`, `-N n2`), and waits until both nodes are idle. Both nodes are this machine
(NodeAddr=127.0.0.1, one port each), 2 CPUs each whatever the machine has (`config_overrides`).
`up` on a running cluster changes nothing; `down` cancels its jobs, then stops every daemon by the
pid in its pid file and waits until each is gone. Commands for the cluster need
`SLURM_CONF=DIR/slurm.conf` (`env()`).

Three settings differ from a production cluster, for the tests' time and load: a requeued job may
start again after 6 s (`cred_expire=5`; Slurm's default is 120 s), the schedulers look at the
queue every 1-2 s, and a daemon waits 60 s for another's answer (`MessageTimeout`, default 10 s:
on a loaded 2-core machine slurmd answered slurmctld's kill of a failed job late, and slurmctld's
retry a minute later killed the job's requeued start on that node). A node can be given its own environment, as a node set up differently would have: the
`export NAME=value` lines in DIR/node-env/<node> reach every task on that node (Slurm's TaskProlog;
`node_env()` writes the file).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
DEFAULT_DIR = Path(tempfile.gettempdir()) / "pretrain-slurm"
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")


class ClusterError(RuntimeError):
    """The cluster could not be started; the message names what and where its log is."""


def missing_commands() -> list[str]:
    """The Slurm/munge commands not on PATH (or /usr/sbin)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [c for c in COMMANDS if shutil.which(c, path=path) is None]


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def env(root: Path = DEFAULT_DIR, base: dict | None = None) -> dict:
    """`base` (default os.environ) with SLURM_CONF pointing at the cluster under `root`."""
    return {**(os.environ if base is None else base), "SLURM_CONF": str(root / "slurm.conf")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_files(root: Path) -> dict[str, Path]:
    """daemon name -> its pid file, in the order `down` stops them."""
    files = {f"slurmd-{n}": root / "run" / f"slurmd-{n}.pid" for n in NODES}
    return {
        **files,
        "slurmctld": root / "run" / "slurmctld.pid",
        "munged": root / "run" / "munged.pid",
    }


def _running_pid(pid_file: Path) -> int | None:
    """The pid in `pid_file` if that process is alive (and not a zombie), else None."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


def status(root: Path = DEFAULT_DIR) -> dict[str, int | None]:
    """daemon name -> pid if running, else None."""
    return {name: _running_pid(path) for name, path in _pid_files(root).items()}


def _ensure_hosts() -> None:
    """`n1 n2` resolve to 127.0.0.1: appended to /etc/hosts once when they do not resolve;
    ClusterError when one resolves elsewhere or /etc/hosts cannot be written."""
    unresolved = []
    for node in NODES:
        try:
            addr = socket.gethostbyname(node)
        except OSError:
            unresolved.append(node)
            continue
        if addr != "127.0.0.1":
            raise ClusterError(f"node name {node} resolves to {addr}, not 127.0.0.1 (/etc/hosts)")
    if not unresolved:
        return
    line = f"127.0.0.1 {' '.join(unresolved)}"
    try:
        with open("/etc/hosts", "a") as hosts:
            hosts.write(f"{line}  # tests/slurm_cluster.py\n")
    except OSError as e:
        raise ClusterError(f"{e}: add '{line}' to /etc/hosts as root") from None


def _config(root: Path) -> str:
    host = socket.gethostname().split(".")[0]
    run, spool, logs = root / "run", root / "spool", root / "log"
    ctld, ports = _free_port(), [_free_port() for _ in NODES]
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS_PER_NODE} "
        "RealMemory=4000 State=UNKNOWN"
        for n, p in zip(NODES, ports, strict=True)
    )
    return f"""# written by tests/slurm_cluster.py
ClusterName=pretrain-local
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge.socket,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=60
MessageTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=300
SchedulerParameters=bf_interval=1,sched_interval=2
TaskProlog={root}/task_prolog.sh
{nodes}
PartitionName=local Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def node_env(root: Path, node: str, variables: dict[str, str] | None) -> None:
    """Give every task started on `node` from now on these environment variables on top of the
    job's (None: none)."""
    path = root / "node-env" / node
    if variables is None:
        path.unlink(missing_ok=True)
        return
    path.write_text("".join(f"export {k}={v}\n" for k, v in variables.items()))


def _prepare(root: Path) -> None:
    """Folders, munge key, task prolog and slurm.conf (kept when present: ports stay the same)."""
    for sub in ("run", "log", "state", "node-env", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    prolog = root / "task_prolog.sh"
    prolog.write_text(f'#!/bin/sh\ncat "{root}/node-env/$SLURMD_NODENAME" 2>/dev/null\nexit 0\n')
    prolog.chmod(0o755)
    os.chmod(root / "run", 0o755)
    key = root / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
    conf = root / "slurm.conf"
    if not conf.exists():
        conf.write_text(_config(root))


def _start(name: str, cmd: list[str], root: Path) -> None:
    if _running_pid(_pid_files(root)[name]) is not None:
        return
    result = subprocess.run(cmd, env=env(root), capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ClusterError(f"{name} did not start ({' '.join(cmd)}): {result.stderr.strip()}")


def _wait(predicate, what: str, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise ClusterError(f"{what} within {timeout:.0f} s (logs in {root / 'log'})")


def nodes_idle(root: Path) -> bool:
    """Both nodes idle: no job on them, none still being cleaned up."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t"], env=env(root), capture_output=True, text=True
    ).stdout.split()
    states = dict(zip(out[::2], out[1::2], strict=False))
    return all(states.get(n) == "idle" for n in NODES)


def up(root: Path = DEFAULT_DIR) -> None:
    """Start whatever of the cluster under `root` is not running; return once both nodes are
    idle. ClusterError (naming the daemon and the log folder) if that does not happen."""
    missing = missing_commands()
    if missing:
        raise ClusterError(
            f"not installed: {' '.join(missing)} (apt-get install -y slurm-wlm munge)"
        )
    _ensure_hosts()
    _prepare(root)
    run, logs = root / "run", root / "log"
    munged = [_sbin("munged"), "--force", f"--socket={run}/munge.socket"]
    munged += [f"--key-file={root}/munge.key", f"--pid-file={run}/munged.pid"]
    munged += [f"--log-file={logs}/munged.log", f"--seed-file={root}/munged.seed"]
    _start("munged", munged, root)
    _wait(lambda: (run / "munge.socket").exists(), "munged opened no socket", root)
    _start("slurmctld", [_sbin("slurmctld")], root)
    for node in NODES:
        _start(f"slurmd-{node}", [_sbin("slurmd"), "-N", node], root)
    _wait(lambda: nodes_idle(root), f"nodes {' '.join(NODES)} were not idle", root)


def _cancel_jobs(root: Path, timeout: float) -> None:
    """scancel every job still queued or running, and wait (up to `timeout` s) until none is
    left, so that no job step (slurmstepd and its tasks) outlives the daemons."""

    def jobs() -> list[str]:
        cmd = ["squeue", "-h", "-o", "%i"]
        return subprocess.run(cmd, env=env(root), capture_output=True, text=True).stdout.split()

    if jobs():
        subprocess.run(["scancel", *jobs()], env=env(root), capture_output=True, timeout=30)
        deadline = time.monotonic() + timeout
        while jobs() and time.monotonic() < deadline:
            time.sleep(0.2)


def down(root: Path = DEFAULT_DIR, timeout: float = 30) -> None:
    """Cancel the cluster's jobs, then SIGTERM every daemon by its pid file (slurmd, slurmctld,
    munged), SIGKILL any left after `timeout` s, and wait until each is gone. Nothing running:
    nothing done."""
    if _running_pid(_pid_files(root)["slurmctld"]) is not None:
        _cancel_jobs(root, timeout)
    for name, pid_file in _pid_files(root).items():
        pid = _running_pid(pid_file)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _running_pid(pid_file) == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        if _running_pid(pid_file) == pid:
            os.kill(pid, signal.SIGKILL)
            while _running_pid(pid_file) == pid:
                time.sleep(0.1)
        print(f"stopped {name} (pid {pid})")


def main(argv: list[str] | None = None) -> int:
    """The command line: up, down or status of the cluster under --dir."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    if args.action == "up":
        try:
            up(root)
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"cluster up: export SLURM_CONF={root / 'slurm.conf'}")
    elif args.action == "down":
        down(root)
    for name, pid in status(root).items():
        print(f"{name}: {'running, pid ' + str(pid) if pid else 'not running'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
