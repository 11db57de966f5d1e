"""Kill one-rank training runs with SIGKILL inside their checkpoint writes, many times.

    python tests/checkpoint_kill_trials.py SPEC.json

SPEC.json: {"flags": [argv without --train-iters/--load/--save/--metrics-file/--finetune],
"save": DIR, "metrics": FILE, "trials": [{"kind", "event", "bytes"}, ...]}. The driver imports
torch, DeepSpeed and pretrain once, then runs every trial in a forked child (its own world of one
rank), so a trial costs an engine build, not an interpreter start. A trial arms the test hook
PRETRAIN_TEST_SIGKILL_IN_SAVE (pretrain/testing_hooks.py) for one save:

- "resume":   --load DIR --save DIR, one more iteration than `latest`, saved and killed at
              `event` (a torch.save call cut after `bytes` bytes, or a commit step);
- "relaunch": the finished run launched again (--train-iters = `latest`'s iteration), armed for
              that iteration: a run that saves again is killed inside the step `latest` names;
- "finetune": --finetune --load DIR --save DIR up to `latest`'s iteration, armed likewise.

After each trial the driver reads `latest` and torch.loads every file of the step it names
(plain torch, not the code under test); the next trial's DeepSpeed load is the real proof. One
JSON line per trial on stdout: kind, exit status, latest before/after, the loaded iteration the
child reported, whether every file loaded, the tail of the child's output.
"""

import json
import os
import re
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import deepspeed  # noqa: E402, F401  (imported once, before the forks)
import torch  # noqa: E402

import pretrain.training.engine  # noqa: E402, F401
from pretrain.cli import parse_args  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402
from pretrain.launch import free_port  # noqa: E402
from pretrain.training.run import pretrain  # noqa: E402

HOOK = "PRETRAIN_TEST_SIGKILL_IN_SAVE"


def _latest(save: str) -> str | None:
    path = os.path.join(save, "latest")
    return Path(path).read_text() if os.path.isfile(path) else None


def _every_file_loads(step_dir: str) -> bool:
    """Independent of the code under test: the metadata parses and each .pt file unpickles."""
    try:
        json.loads(Path(step_dir, "pretrain_meta.json").read_text())
        for name in os.listdir(step_dir):
            if name.endswith(".pt"):
                torch.load(os.path.join(step_dir, name), weights_only=False)
    except Exception:  # noqa: BLE001 - any failure means the step does not load
        return False
    return True


def _child(argv: list[str], env: dict, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    try:
        exit_on_user_error(lambda: pretrain(parse_args(argv)))()
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - report, then leave without running parent cleanup
        traceback.print_exc()
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(argv: list[str], hook: str | None, log: str) -> int:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    os.environ.pop(HOOK, None)
    if hook is not None:
        env[HOOK] = hook
    pid = os.fork()
    if pid == 0:
        _child(argv, env, log)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _trial(spec: dict, trial: dict, index: int) -> dict:
    save = spec["save"]
    before = _latest(save)
    at = int(before.removeprefix("global_step"))
    kind = trial["kind"]
    argv = list(spec["flags"]) + ["--load", save, "--save", save]
    if kind == "resume":
        iters, metrics = at + 1, spec["metrics"]
    else:
        iters, metrics = at, spec["metrics"] + f".{kind}"
    argv += ["--train-iters", str(iters), "--metrics-file", metrics]
    argv += ["--finetune", "--save-interval", "1000"] if kind == "finetune" else []
    armed = iters if kind == "resume" else at
    log = f"{save}.trial{index}.log"
    status = _run(argv, f"{armed}:{trial['event']}:{trial['bytes']}", log)
    output = Path(log).read_text(errors="replace")
    loaded = re.search(r"loaded (?:checkpoint|weights from) \S+?global_step(\d+)", output)
    after = _latest(save)
    return {
        "trial": index,
        **trial,
        "status": status,
        "latest_before": before,
        "latest_after": after,
        "loaded": int(loaded.group(1)) if loaded else None,
        "every_file_loads": after is not None and _every_file_loads(os.path.join(save, after)),
        "traceback": "Traceback" in output,
        "tail": output[-1500:],
    }


def _plain(spec: dict, name: str, argv: list[str]) -> None:
    """An unarmed run (the first checkpoints, the uninterrupted reference)."""
    log = f"{spec['save']}.{name}.log"
    status = _run(list(spec["flags"]) + argv, None, log)
    print(json.dumps({"phase": name, "status": status, "tail": Path(log).read_text()[-1500:]}))


def main() -> None:
    """The first checkpoints, the reference run, then the trials of SPEC.json, one JSON line
    each."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    _plain(
        spec,
        "start",
        ["--save", spec["save"], "--train-iters", "2"] + ["--metrics-file", spec["metrics"]],
    )
    ref = spec["reference"]
    _plain(
        spec,
        "reference",
        ["--save", ref["save"], "--train-iters", str(ref["iters"])]
        + ["--metrics-file", ref["metrics"]],
    )
    for index, trial in enumerate(spec["trials"]):
        print(json.dumps(_trial(spec, trial, index)), flush=True)


if __name__ == "__main__":
    main()
