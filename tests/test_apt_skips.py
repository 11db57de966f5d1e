"""The suite on a machine without the apt packages: every test that needs one skips, naming it.

`.ci/run` installs `libaio-dev` (DeepSpeed's async_io op, NVMe offload) and `slurm-wlm` + `munge`
(the two-node Slurm cluster); a fresh machine running `make test` may have none of them. This test
runs the files that need them in a pytest of their own with the packages hidden: where they are
installed, a private mount namespace (`unshare -m`, root) lays `/dev/null` over `libaio.so` and
over each Slurm/munge command, so the linker finds no libaio and `shutil.which` no executable;
where they are missing, nothing needs hiding. Every test must then pass or skip with the install
command; none may fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import op_builds
import pytest
import slurm_cluster
from training_fixtures import REPO
from training_fixtures import test_env as clean_env

FILES = [
    "tests/test_offload_args.py",
    "tests/test_offload_nvme.py",
    "tests/test_slurm.py",
    "tests/test_slurm_launchers.py",
    "tests/test_slurm_preprocess.py",
]
"""Every test file that needs an apt package (keep in step with `.ci/run`'s list)."""


def _installed() -> list[str]:
    """The files that make the packages visible: libaio's link-time library, the commands."""
    found = []
    for name in ("libaio.so", "libaio.a"):
        path = subprocess.run(
            ["gcc", f"-print-file-name={name}"], capture_output=True, text=True
        ).stdout.strip()
        if os.path.isabs(path) and os.path.exists(path):
            found.append(os.path.realpath(path))
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    for command in slurm_cluster.COMMANDS:
        path = shutil.which(command, path=search)
        if path:
            found.append(os.path.realpath(path))
    return sorted(set(found))


def _hiding(paths: list[str]) -> list[str]:
    """The command prefix that runs its command in a private mount namespace where each of
    `paths` reads as /dev/null (nothing when there is nothing to hide)."""
    if not paths:
        return []
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding installed apt packages needs root and unshare (util-linux)")
    mounts = " && ".join(f"mount --bind /dev/null {p}" for p in paths)
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]


@pytest.mark.timeout(900)
def test_tests_needing_apt_packages_skip_with_the_install_command_when_they_are_missing():
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *FILES]
    out = subprocess.run(
        [*_hiding(_installed()), *pytest_argv],
        cwd=REPO,
        env=clean_env(**{op_builds.NO_BUILD: "1"}),  # the outer session's op build stays
        capture_output=True,
        text=True,
        timeout=840,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    summary = text.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, summary
    skipped = re.findall(r"^SKIPPED \[\d+\] (\S+): (.*)$", text, re.M)
    assert {os.path.basename(f.split(":")[0]) for f, _ in skipped} == {
        os.path.basename(f) for f in FILES
    }, text[-6000:]  # every file has a test that skipped for its package
    for where, reason in skipped:
        assert "apt-get install" in reason, f"{where}: {reason}"
