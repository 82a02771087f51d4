"""The cost of a verifiers environment: rollouts per daemon CPU-second, the environment's
own CPU, and the daemon's worst loop lag, with the demo's verifiers taskset `vf-arith`
(configs/verifiers.toml) against the same task as a dataset env.

Two workloads, each a fresh run of configs/verifiers.toml (its batch shape, sampling,
tokenizer and staleness) against the same simulated fleet: 2 `orchestrator sim-inference`
processes (the tokenizer's 1,024-token vocabulary, a production MoE shape) and the
trainer, as separate processes.

- `verifiers`: the env as configured, `[[env]] verifiers = "vf-arith"` with its `args`.
  Its worker process loads the taskset, and each episode runs verifiers' tool-less chat
  loop as a program of its own, which calls the model at the daemon's loopback endpoint
  (through the worker's relay); the taskset's `@vf.reward`s score it in the worker.
- `dataset`: the same tasks as a dataset env of the same name (so the daemon draws them
  in the same order): the taskset's own tasks, loaded through verifiers with the env's
  `args` in a process of their own, written to a `.jsonl` (question, answer) with the
  taskset's system prompt; the daemon renders the prompts with the chat template, and
  reward functions that compute the taskset's rewards (bench/_arith_rewards.py, the same
  weights) run in 1 reward worker process.

The daemon runs in this process, pinned to core 0; the fleet, the trainer and the
environment's processes (the verifiers worker and every process under it; the reward
worker) on the other core(s), moved there once the daemon dispatches (they inherit the
daemon's core when it starts them). Measured from the first dispatch to the end of the
run: the daemon's CPU (this process, every thread; the loop's passes that ran only this
benchmark's tasks, the timer below's ticks, apart: `BenchPasses`), the environment's (its
processes and their reaped children, from their CPU at the first dispatch to their exit),
the worst and 99th-percentile overshoot of a 10 ms timer on the daemon's loop
(bench/real_tasks.py's). The verifiers env does about 0.4 rollouts a second on its one
core here, so it runs fewer steps (`--steps`) than the dataset env (`--dataset-steps`).

    uv run --frozen --group bench python bench/verifiers_cost.py [--steps N]
        [--dataset-steps N] [--no-write]

(demo/verifiers_envs goes on the worker's path here; no PYTHONPATH is needed.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio
from _arith_rewards import REWARDS
from _report import git_revision, machine, write_section
from real_tasks import LAG_TICK_S, fleet_and_trainer, lag_monitor, percentile
from system_fleet import (
    CorePlan,
    cpu_seconds,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    running_daemon,
    stamp,
)

from orchestrator.config import Config, EnvConfig, load_config
from orchestrator.tasks.verifiers_env.protocol import WORKER_MODULE

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "verifiers.toml"
ENV_PACKAGES = ROOT / "demo" / "verifiers_envs"
MODEL = ROOT / "demo" / "model"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: How often the verifiers worker's own CPU is read during a run (its last reading
#: before it exits splits the environment's CPU into the worker's and its programs').
POLL_S = 0.5

#: Run in a process of its own (importing verifiers costs seconds and threads that are
#: not the daemon's): the taskset's tasks, as the worker loads them, written as rows.
TASKSET_ROWS = """
import json, sys
import verifiers.v1 as vf
from orchestrator.tasks.verifiers_env.worker import deep_merge
ident, args, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
config = vf.resolve_env_config(deep_merge({"taskset": {"id": ident}}, args))
system_prompts = set()
with open(path, "w") as out:
    for task in vf.load_environment(config).taskset:
        assert isinstance(task.data.prompt, str), task.data.prompt
        system_prompts.add(task.data.system_prompt)
        out.write(json.dumps({"question": task.data.prompt, "answer": task.data.answer}) + "\\n")
print(json.dumps(sorted(system_prompts, key=str)))
"""


@attrs.frozen
class Result:
    name: str
    steps: int
    rollouts: int
    completed: int
    seconds: float
    daemon_cpu_s: float
    #: The event loop's own thread (the rest of daemon_cpu_s is the daemon's worker
    #: threads: tokenization, payload checks, batch writes).
    loop_cpu_s: float
    #: The environment's processes and every process under them, over the span.
    env_cpu_s: float
    #: Of env_cpu_s, the verifiers worker's own (None: no worker).
    worker_own_cpu_s: float | None
    #: Of loop_cpu_s, the scheduler's passes that ran only the benchmark's own tasks (the
    #: lag timer's ticks, mostly: `BenchPasses`).
    timer_cpu_s: float
    worst_lag_ms: float
    #: When the worst lag came, in seconds after the first dispatch (about).
    worst_lag_at_s: float
    p99_lag_ms: float
    mean_reward: float | None
    env_processes: tuple[str, ...]

    @property
    def per_cpu_s(self) -> float:
        return self.rollouts / self.daemon_cpu_s if self.daemon_cpu_s else 0.0

    @property
    def per_cpu_s_untimed(self) -> float:
        """Rollouts per daemon CPU-second without the benchmark's own passes."""
        untimed = self.daemon_cpu_s - self.timer_cpu_s
        return self.rollouts / untimed if untimed > 0 else float("inf")

    @property
    def env_ms_per_rollout(self) -> float:
        return 1000 * self.env_cpu_s / self.rollouts if self.rollouts else 0.0


# -- processes --------------------------------------------------------------------------


@attrs.frozen
class ProcessCpu:
    """A process's CPU time: its own, and that of the children it has waited for."""

    own: float
    reaped: float

    @property
    def total(self) -> float:
        return self.own + self.reaped


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command (state first), None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> ProcessCpu | None:
    fields = _stat(pid)
    if fields is None:
        return None
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return ProcessCpu((utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS)


def children(pid: int) -> dict[int, str]:
    """The living children of `pid`, each with its command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is None or fields[0] == "Z" or int(fields[1]) != pid:
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = command.strip()
    return found


def move_tree(pid: int, cores: frozenset[int]) -> None:
    """Every thread of `pid` and of every process under it onto `cores`."""
    for child in children(pid):
        move_tree(child, cores)
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cores)


# -- one run ----------------------------------------------------------------------------


async def poll_workers(workers: dict[int, ProcessCpu | None]) -> None:
    """Keep each verifiers worker's last CPU reading in `workers` while it runs."""
    while True:
        for pid in workers:
            reading = process_cpu(pid)
            if reading is not None:
                workers[pid] = reading
        await trio.sleep(POLL_S)


class BenchPasses(trio.abc.Instrument):
    """The loop CPU of the scheduler's passes that ran only this benchmark's own tasks
    (the lag timer's ticks, the readings of the worker's CPU): each tick of a 10 ms
    timer wakes the loop, a cost that grows with the run's wall time, not its rollouts.
    A pass is from one wait for I/O to the next (the wait's system call, then the tasks
    it woke); one that also ran a daemon task counts as the daemon's."""

    def __init__(self) -> None:
        self.tasks: set[trio.lowlevel.Task] = set()
        self.cpu_s = 0.0
        self._mark: float | None = None
        self._ours = self._theirs = False

    def before_io_wait(self, timeout: float) -> None:
        now = time.thread_time()
        if self._mark is not None and self._ours and not self._theirs:
            self.cpu_s += now - self._mark
        self._mark, self._ours, self._theirs = now, False, False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task in self.tasks:
            self._ours = True
        else:
            self._theirs = True


async def ours(passes: BenchPasses, task: Callable[[], Awaitable[None]]) -> None:
    """`task`, run as one of `passes`' own."""
    passes.tasks.add(trio.lowlevel.current_task())
    await task()


async def measure(name: str, steps: int, config: Config, env_cores: frozenset[int]) -> Result:
    """One run, measured from the moment it dispatches (start-up, the worker's load and the
    reward worker's spawn excluded) to its end; the environment's processes moved to
    `env_cores` then (empty: left where they are)."""
    me = os.getpid()
    fleet = set(children(me))  # the servers and the trainer
    lags: list[float] = []
    passes = BenchPasses()
    async with trio.open_nursery() as nursery:
        async with running_daemon(config) as daemon:
            env = {pid: command for pid, command in children(me).items() if pid not in fleet}
            if env_cores:
                for pid in env:
                    move_tree(pid, env_cores)
            started_cpu = {pid: process_cpu(pid) for pid in env}
            workers = {pid: started_cpu[pid] for pid, cmd in env.items() if WORKER_MODULE in cmd}
            reaped_before = os.times()
            cpu, started, loop_cpu = cpu_seconds(), time.monotonic(), time.thread_time()
            passes.tasks.add(trio.lowlevel.current_task())
            trio.lowlevel.add_instrument(passes)
            nursery.start_soon(ours, passes, functools.partial(lag_monitor, lags))
            nursery.start_soon(ours, passes, functools.partial(poll_workers, workers))
            try:
                while daemon.outcome is None:
                    await daemon.state.wait_changed()
                    for pid in workers:  # a reading as each batch ships: the last is late
                        workers[pid] = process_cpu(pid) or workers[pid]
            finally:
                loop_cpu = time.thread_time() - loop_cpu
                trio.lowlevel.remove_instrument(passes)
        nursery.cancel_scope.cancel()
    seconds, daemon_cpu = time.monotonic() - started, cpu_seconds() - cpu
    after = os.times()
    outcome = daemon.outcome
    assert outcome is not None
    # Every environment process that exited in the span was waited for by the daemon: its
    # whole life (and its own reaped children's) is in this process's children's times.
    env_cpu = (after.children_user + after.children_system) - (
        reaped_before.children_user + reaped_before.children_system
    )
    for pid, before in started_cpu.items():
        if before is None:
            continue
        now = process_cpu(pid)
        env_cpu += (now.total - before.total) if now is not None else -before.total
    worker_own = None
    if workers:
        worker_own = 0.0
        for pid, last in workers.items():
            first = started_cpu[pid]
            if last is not None and first is not None:
                worker_own += last.own - first.own
    rollouts = outcome.state.dispatch.rollouts
    tally = outcome.sink.by_env.get(config.env[0].name)
    return Result(
        name=name,
        steps=steps,
        rollouts=sum(rollouts.values()),
        completed=rollouts["completed"],
        seconds=seconds,
        daemon_cpu_s=daemon_cpu,
        loop_cpu_s=loop_cpu,
        env_cpu_s=env_cpu,
        worker_own_cpu_s=worker_own,
        timer_cpu_s=passes.cpu_s,
        worst_lag_ms=max(lags, default=0.0) * 1000,
        worst_lag_at_s=lag_at(lags, lags.index(max(lags))) if lags else 0.0,
        p99_lag_ms=percentile(lags, 0.99) * 1000,
        mean_reward=tally.mean_reward if tally is not None else None,
        env_processes=tuple(sorted(env.values())),
    )


def lag_at(lags: list[float], index: int) -> float:
    """About when the tick `index` of the lag timer ended, from its start: each tick is
    the timer's 10 ms and its lag."""
    return sum(lags[: index + 1]) + (index + 1) * LAG_TICK_S


# -- the workloads ----------------------------------------------------------------------


def taskset_rows(env: EnvConfig, path: Path) -> str:
    """`env`'s taskset's tasks as `.jsonl` rows at `path` (the worker's order); returns the
    system prompt they share."""
    assert env.verifiers is not None
    done = subprocess.run(
        [sys.executable, "-c", TASKSET_ROWS, env.verifiers, json.dumps(env.args), str(path)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    prompts = json.loads(done.stdout.strip().splitlines()[-1])
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise RuntimeError(f"the taskset's tasks do not share one system prompt: {prompts}")
    return str(prompts[0])


def dataset_env(env: EnvConfig, rows: Path, system_prompt: str) -> str:
    """The `--set` making `env` (a verifiers env) a dataset env of the same task: the same
    name (so the same draw order), sampling and rewards."""
    fields = [
        f"name = {json.dumps(env.name)}",
        f"dataset = {json.dumps(str(rows))}",
        'prompt = "question"',
        f"system_prompt = {json.dumps(system_prompt)}",
        'answer = "answer"',
        f"rewards = {json.dumps(list(REWARDS))}",
        f"reward_weights = {json.dumps(list(REWARDS.values()))}",
        f"max_tokens = {env.max_tokens}",
        f"temperature = {env.temperature}",
        f"top_p = {env.top_p}",
        f"top_k = {env.top_k}",
    ]
    return "env=[{" + ", ".join(fields) + "}]"


def run_one(kind: str, steps: int, base: Path, dataset: list[str], cores: CorePlan) -> Result:
    """One workload: `dataset` is [] for the verifiers env, else the `--set`s that make it
    the dataset env; on bench/real_tasks.py's fleet and trainer."""
    with fleet_and_trainer(base / kind, steps, cores.fleet) as overrides:
        config = load_config(CONFIG, [*overrides, *dataset])
        return trio.run(measure, kind, steps, config, cores.fleet)


def report(results: list[Result], load: float) -> str:
    def optional(value: float | None, form: str) -> str:
        return "n/a" if value is None else format(value, form)

    rows = [
        f"| {r.name} | {r.steps} | {r.rollouts} ({r.completed}) | {r.seconds:.1f} | "
        f"{r.daemon_cpu_s:.2f} | {r.loop_cpu_s:.2f} | {r.timer_cpu_s:.2f} | {r.per_cpu_s:.0f} | "
        f"{r.per_cpu_s_untimed:.0f} | {r.env_cpu_s:.1f} | {optional(r.worker_own_cpu_s, '.1f')} | "
        f"{r.env_ms_per_rollout:.0f} | {r.worst_lag_ms:.1f} | {r.p99_lag_ms:.1f} | "
        f"{optional(r.mean_reward, '.3f')} |"
        for r in results
    ]
    by_name = {r.name: r for r in results}
    verifiers, dataset = by_name["verifiers"], by_name["dataset"]
    steps = f"--steps {verifiers.steps} --dataset-steps {dataset.steps}"

    env_ms = verifiers.env_ms_per_rollout

    def daemon_ms(r: Result) -> float:
        return 1000 * (r.daemon_cpu_s - r.timer_cpu_s) / r.rollouts if r.rollouts else 0.0

    worker_ms = 1000 * (verifiers.worker_own_cpu_s or 0.0) / max(verifiers.rollouts, 1)
    programs = 1 - (verifiers.worker_own_cpu_s or 0.0) / verifiers.env_cpu_s
    env_ratio = verifiers.env_ms_per_rollout / max(dataset.env_ms_per_rollout, 1e-9)
    timer_share = verifiers.timer_cpu_s / verifiers.daemon_cpu_s
    return "\n".join(
        [
            "## A verifiers environment against the same task as a dataset env",
            "",
            f"`uv run --frozen --group bench python bench/verifiers_cost.py {steps}` "
            f"(revision {git_revision()}), on {machine()}; load average {load:.1f} at the "
            "start (the machine is shared with other work).",
            "",
            "configs/verifiers.toml twice, against the same fleet (2 sim-inference processes, "
            "1,024-token vocabulary, 48 layers, top-8 of 128) and the trainer as processes: "
            "`verifiers` is its env, `vf-arith` (demo/verifiers_envs) in its worker process, "
            "every episode verifiers' tool-less chat loop as a program of its own that calls "
            "the daemon's loopback endpoint (through the worker's relay), scored by the "
            "taskset's `@vf.reward`s in the worker; `dataset` is the same 200 tasks (loaded "
            "through verifiers with the env's `args`, written to a `.jsonl`) under the same env "
            "name (the same draw order), with the same sampling (16 tokens, temperature 1), "
            "batch shape (8 samples, groups of 4) and rewards (bench/_arith_rewards.py: the "
            "taskset's two, weighted 1 and 0.25), its prompts rendered by the daemon (the same "
            "tokens as the worker renders) and scored in 1 reward worker process. The daemon "
            "runs in the benchmark's process pinned to core 0; the fleet, the trainer and the "
            "environment's processes on the other core. Measured from the first dispatch to "
            "the end of the run (start-up and the worker's load excluded). `rollouts`: every "
            "rollout dispatched (in brackets those completed; the rest were in flight when the "
            "last batch shipped, stopped, their CPU counted). `daemon CPU s`: the daemon's "
            "process, every thread (its event loop, which serves the model endpoint for the "
            "verifiers env; its worker threads: rendering and decoding, payload checks, batch "
            "writes); `of which loop`: its event loop's thread; `of which the lag timer`: the "
            "loop's passes that ran only the benchmark's own tasks, nearly all the 10 ms "
            "timer's ticks (a cost of wall time, not of rollouts), which `without the timer` "
            "leaves out. `env CPU s`: the environment's processes and every process under "
            "them (the verifiers worker and its per-episode programs; the dataset env's "
            "reward worker) over the same span; `of which worker`: the verifiers worker's "
            "own, the rest its programs. The lag is the overshoot of that 10 ms timer, its "
            "worst and its 99th percentile.",
            "",
            "| workload | steps | rollouts (completed) | wall s | daemon CPU s | of which loop | "
            "of which the lag timer | rollouts / daemon CPU s | without the timer | "
            "env CPU s | of which worker | env CPU ms / rollout | worst loop lag ms | "
            "p99 loop lag ms | mean reward |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"The cost of the verifiers env is the environment's: {env_ms:,.0f} "
            f"ms of CPU a rollout against {dataset.env_ms_per_rollout:.1f} ms for the dataset "
            f"env's reward worker ({env_ratio:,.0f} times), {programs:.0%} of it in the "
            f"per-episode programs (the worker's own is {worker_ms:.0f} ms a rollout). The "
            f"daemon's, without the timer, is at most {daemon_ms(verifiers):.1f} ms a rollout "
            f"against {daemon_ms(dataset):.1f} ms: spread over the verifiers run's "
            f"{verifiers.seconds:.0f} s it also holds the daemon's own periodic work (the "
            "weights watcher's wake-ups, its timers), a cost of wall time as the timer's is; "
            "per rollout, the endpoint's HTTP exchange and the worker's socket take the place "
            "of rendering the prompt and the reward pool's call. At "
            f"{verifiers.rollouts / verifiers.seconds:.2f} rollouts a second the daemon is "
            f"mostly idle: the lag timer is {timer_share:.0%} of its CPU, which is why the raw "
            "rollouts per daemon CPU-second is low.",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="batches of the verifiers env")
    parser.add_argument("--dataset-steps", type=int, default=40, help="batches of the dataset env")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    quiet_daemon_logs()
    # The config's relative paths (the tokenizer) are taken from the repository.
    os.chdir(ROOT)
    # The worker gets the daemon's path: the taskset's package is on it, as PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ENV_PACKAGES), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    # The worker's warning for each model call refused at the end of a run (410: the group
    # can no longer ship, as every run's last groups are) would flood the output.
    os.environ.setdefault("ORCHESTRATOR_VERIFIERS_LOG_LEVEL", "ERROR")
    # transformers' first import costs seconds of CPU once per process: not the runs'.
    from orchestrator.tasks.chat import ChatTokenizer

    ChatTokenizer.load(MODEL, require_chat_template=True)
    envs = load_config(CONFIG).env
    if len(envs) != 1 or envs[0].verifiers is None:
        raise SystemExit(f"{CONFIG}: this benchmark wants one [[env]], a verifiers one")
    env = envs[0]
    load = os.getloadavg()[0]
    cores = plan_cores()
    pin_self(cores.daemon)
    results = []
    with tempfile.TemporaryDirectory(prefix="verifiers-cost-") as tmp:
        base = Path(tmp)
        print(f"{stamp()} writing the taskset's tasks ...", flush=True)
        system_prompt = taskset_rows(env, base / "tasks.jsonl")
        dataset = [dataset_env(env, base / "tasks.jsonl", system_prompt), "rewards.workers=1"]
        for kind, steps, sets in (
            ("dataset", args.dataset_steps, dataset),
            ("verifiers", args.steps, []),
        ):
            print(f"{stamp()} {kind}, {steps} steps ...", flush=True)
            results.append(run_one(kind, steps, base, sets, cores))
            print(f"{stamp()} {kind}: {results[-1]}", flush=True)
    text = report(results, load)
    print(text)
    if not args.no_write:
        write_section("verifiers_cost", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
