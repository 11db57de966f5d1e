"""Kill training runs of one or two ranks with SIGKILL inside their checkpoint saves, many times.

    python tests/checkpoint_kill_trials.py SPEC.json

SPEC.json: {"flags": [argv without --train-iters/--load/--save/--metrics-file/--finetune],
"world": ranks, "save": DIR, "metrics": FILE PREFIX, "reference": {"save", "iters",
"metrics"}, "trials": [{"kind", "event", "rank", "bytes"}, ...]}. The driver imports torch,
DeepSpeed and pretrain once, then runs every launch as `world` forked children (one per rank,
sharing a fresh rendezvous port), so a launch costs an engine build, not an interpreter start.
When one rank ends abnormally the driver SIGKILLs the others, as a launcher ends a job whose
node died. Every rank records the events of its saves (PRETRAIN_TEST_SAVE_EVENTS,
pretrain/testing_hooks.py); a trial with an "event" arms PRETRAIN_TEST_SIGKILL_IN_SAVE on rank
`rank` for one save, killed at that event (a torch.save cut after `bytes` bytes, or a commit
step):

- "resume":   --load DIR --save DIR, one more iteration than `latest`, saved (and killed);
- "relaunch": the finished run launched again (--train-iters = `latest`'s iteration), armed for
              that iteration: a run that saves again is killed inside the step `latest` names;
- "finetune": --finetune --load DIR --save DIR up to `latest`'s iteration, armed likewise.

Each trial writes its own metrics file, METRICS.trial<index>. After each trial the driver reads
`latest` and torch.loads every file of the step it names (plain torch, not the code under
test); the next trial's DeepSpeed load is the real proof. One JSON line per trial on stdout:
the exit status per rank, latest before/after, the iteration rank 0's log says was loaded,
whether every file loaded, whether a rank that ended by itself (the armed one; every rank of an
unarmed launch) printed a traceback, the events each rank recorded for the armed save, and the
tail of the output.
"""

import json
import os
import re
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import deepspeed  # noqa: E402, F401  (imported once, before the forks)
import torch  # noqa: E402

import pretrain.training.backends.deepspeed.engine  # noqa: E402, F401
from pretrain.cli import parse_args  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402
from pretrain.launch import free_port  # noqa: E402
from pretrain.testing_hooks import SAVE_EVENTS, SIGKILL_IN_SAVE  # noqa: E402
from pretrain.training.run import pretrain  # noqa: E402


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


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def _launch(argv: list[str], world: int, env_by_rank: list[dict], logs: list[str]) -> list[int]:
    """Run `argv` on `world` forked ranks; the exit status of each (-9: SIGKILL)."""
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    running = {}
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        pid = os.fork()
        if pid == 0:
            _child(argv, {**env, **rendezvous, **env_by_rank[rank]}, logs[rank])
        running[pid] = rank
    statuses = [0] * world
    while running:
        pid, raw = os.waitpid(-1, 0)
        statuses[running.pop(pid)] = _status(raw)
        if _status(raw) != 0:  # the job is over: end the other ranks, as a launcher does
            for other in running:
                os.kill(other, signal.SIGKILL)
    return statuses


def _events(path: str, iteration: int) -> list[str]:
    """The events a rank recorded for the save of `iteration`, in order."""
    if not os.path.isfile(path):
        return []
    lines = Path(path).read_text().splitlines()
    return [e for it, e in (line.split(" ", 1) for line in lines) if int(it) == iteration]


def _trial(spec: dict, trial: dict, index: int) -> dict:
    save, world = spec["save"], spec["world"]
    before = _latest(save)
    at = int(before.removeprefix("global_step"))
    kind = trial["kind"]
    metrics = f"{spec['metrics']}.trial{index}"
    iters = at + 1 if kind == "resume" else at
    argv = list(spec["flags"]) + ["--load", save, "--save", save]
    argv += ["--train-iters", str(iters), "--metrics-file", metrics]
    argv += ["--finetune", "--save-interval", "1000"] if kind == "finetune" else []
    armed = iters if kind == "resume" else at
    logs = [f"{save}.trial{index}.rank{r}.log" for r in range(world)]
    records = [f"{save}.trial{index}.rank{r}.events" for r in range(world)]
    env_by_rank = [{SAVE_EVENTS: records[r]} for r in range(world)]
    if trial.get("event") is not None:
        env_by_rank[trial["rank"]][SIGKILL_IN_SAVE] = f"{armed}:{trial['bytes']}:{trial['event']}"
    statuses = _launch(argv, world, env_by_rank, logs)
    outputs = [Path(log).read_text(errors="replace") for log in logs]
    loaded = re.search(r"loaded (?:checkpoint|weights from) \S+?global_step(\d+)", outputs[0])
    after = _latest(save)
    # the ranks that ended by themselves: the armed one, or all of an unarmed launch (the
    # others of an armed launch may print a gloo error about their dead peer before our kill)
    watched = [trial["rank"]] if trial.get("event") is not None else range(world)
    return {
        "trial": index,
        **trial,
        "status": statuses,
        "latest_before": before,
        "latest_after": after,
        "loaded": int(loaded.group(1)) if loaded else None,
        "every_file_loads": after is not None and _every_file_loads(os.path.join(save, after)),
        "traceback": any("Traceback" in outputs[r] for r in watched),
        "events": [_events(path, armed) for path in records],
        "metrics": metrics,
        "tail": "".join(outputs[r][-1500:] for r in sorted({0, *watched})),
    }


def _plain(spec: dict, name: str, argv: list[str]) -> None:
    """An unarmed run (the first checkpoints, the uninterrupted reference)."""
    world = spec["world"]
    logs = [f"{spec['save']}.{name}.rank{r}.log" for r in range(world)]
    statuses = _launch(list(spec["flags"]) + argv, world, [{}] * world, logs)
    tail = Path(logs[0]).read_text()[-1500:]
    print(json.dumps({"phase": name, "status": statuses, "tail": tail}), flush=True)


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
