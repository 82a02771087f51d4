"""The cost of real tasks: rollouts per daemon CPU-second with the real tokenizer, chat
template and reward functions in worker processes, beside the toy environment at the same
shapes; the event loop's worst lag while rewards run; the daemon's RSS with a
million-row dataset open.

Each workload is a fresh run of the demo's machinery (configs/demo.toml for real tasks,
configs/sim.toml for the toy): the inference servers (`orchestrator sim-inference`, the
demo tokenizer's 1,024-token vocabulary, a production MoE shape) and the trainer as
separate processes pinned to the other core, the daemon in this process on core 0, so its
CPU time is its own (the reward workers' CPU is reported apart). Shapes: the demo's
(prompts of a few dozen tokens, 16 completion tokens) and long prompts (~4,000 tokens,
from a dataset this script writes, 64 completion tokens). The lag is the worst overshoot
of a 10 ms timer on the daemon's loop over the run, and its 99th percentile. Pinned to one
core, the daemon's loop shares it with the daemon's own worker threads and the reward
workers, and the operating system's scheduler, not the daemon's code, makes most of the
lag (profiled: the late steps are ordinary steps whose thread waited for the core); so
the real-task rows run once more with the daemon free on every core (the fleet still on
its own), which is how a head node runs it. The million-row figure: the same
demo run with the arith env reading a 1,000,000-row `.jsonl` (written here), its RSS
after the run against the demo's.

`--model DIR` takes the tokenizer (and chat template) from a model folder instead of
demo/model: the servers then sample from its vocabulary and end a natural stop with its
eos id (`--vocab-size`, `--eos-token-id`, `sim.vocab_size`, `sim.eos_token_id`), and the
real-task rows only run (`--kinds` chooses others), their table written to a section of
its own, named for the folder. What a real tokenizer costs the daemon, against the demo's.

    uv run --frozen --group bench python bench/real_tasks.py [--steps N] [--no-write]
        [--model DIR] [--kinds tasks-demo,tasks-long]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import attrs
import trio
from _report import git_revision, machine, write_section
from system_fleet import (
    ModelShape,
    cpu_seconds,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    rss_bytes,
    run_overrides,
    running_daemon,
    sim_servers,
    sim_trainer,
    stamp,
)

import orchestrator
from orchestrator.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent
# The configs of the tree whose code runs (an older revision's, for a comparison: its
# code refuses keys that came after it).
CONFIGS = Path(orchestrator.__file__).resolve().parents[1] / "configs"
DEMO, SIM = CONFIGS / "demo.toml", CONFIGS / "sim.toml"
MODEL = ROOT / "demo" / "model"
SHAPE = ModelShape()
#: The 10 ms timer whose overshoot is the loop's lag.
LAG_TICK_S = 0.01


@attrs.frozen
class Result:
    name: str
    rollouts: int
    seconds: float
    daemon_cpu_s: float
    workers_cpu_s: float
    worst_lag_ms: float
    p99_lag_ms: float
    rss_mib: float
    cores: str = "1"
    #: The CPU time of the event loop's own thread (the rest of daemon_cpu_s is the
    #: daemon's worker threads: tokenization, payload checks, batch writes).
    loop_cpu_s: float = 0.0

    @property
    def per_cpu_s(self) -> float:
        return self.rollouts / self.daemon_cpu_s if self.daemon_cpu_s else 0.0


def long_dataset(path: Path, rows: int, words: int) -> Path:
    """`rows` problems of about `words` words each: a ~4,000-token prompt apiece."""
    filler = "The farmer counts the apples in the basket and writes the number down. "
    with path.open("w") as out:
        for i in range(rows):
            story = filler * (words // len(filler.split()))
            out.write(json.dumps({"question": f"{story} What is {i} + 7?", "answer": str(i + 7)}))
            out.write("\n")
    return path


def big_dataset(path: Path, rows: int) -> Path:
    with path.open("w") as out:
        for i in range(rows):
            out.write(json.dumps({"question": f"What is {i % 97} + {i % 89}?", "answer": "0"}))
            out.write("\n")
    return path


async def lag_monitor(lags: list[float]) -> None:
    while True:
        before = trio.current_time()
        await trio.sleep(LAG_TICK_S)
        lags.append(trio.current_time() - before - LAG_TICK_S)


class Span(Protocol):
    """What watches a run's measured span beside the figures: `enable()` at its start,
    `disable()` at its end (a `cProfile.Profile`, say: bench/rollout_profile.py)."""

    def enable(self) -> None: ...

    def disable(self) -> None: ...


async def measure(name: str, config: Config, profiler: Span | None = None) -> Result:
    """One run, measured from the moment it dispatches (start-up, the tokenizer's loading
    and the reward workers' spawning excluded) to its end; `profiler` is enabled over the
    same span."""
    lags: list[float] = []
    async with trio.open_nursery() as nursery:
        async with running_daemon(config) as daemon:
            children = os.times()
            cpu, started, loop_cpu = cpu_seconds(), time.monotonic(), time.thread_time()
            nursery.start_soon(lag_monitor, lags)
            if profiler is not None:
                profiler.enable()
            try:
                while daemon.outcome is None:
                    await daemon.state.wait_changed()
            finally:
                if profiler is not None:
                    profiler.disable()
                loop_cpu = time.thread_time() - loop_cpu
        nursery.cancel_scope.cancel()
    after = os.times()
    outcome = daemon.outcome
    assert outcome is not None
    rollouts = sum(outcome.state.dispatch.rollouts.values())
    workers = (after.children_user + after.children_system) - (
        children.children_user + children.children_system
    )
    return Result(
        name,
        rollouts,
        time.monotonic() - started,
        cpu_seconds() - cpu,
        workers,
        max(lags, default=0.0) * 1000,
        percentile(lags, 0.99) * 1000,
        rss_bytes() / 2**20,
        loop_cpu_s=loop_cpu,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@attrs.frozen
class Vocabulary:
    """The tokenizer folder the real-task rows use, its size and eos id (the servers
    sample from it and end a natural stop with it)."""

    folder: Path
    size: int
    eos_token_id: int

    @classmethod
    def of(cls, folder: Path) -> Vocabulary:
        from orchestrator.tasks.chat import ChatTokenizer

        tokenizer = ChatTokenizer.load(folder, require_chat_template=True)
        return cls(folder, tokenizer.vocab_size, tokenizer.stop_token_ids[0])

    def server_flags(self) -> list[str]:
        return [f"--vocab-size={self.size}", f"--eos-token-id={self.eos_token_id}"]

    def overrides(self) -> list[str]:
        return [f"sim.vocab_size={self.size}", f"sim.eos_token_id={self.eos_token_id}"]


#: The demo's: demo/model has 1,024 ids, and <|im_end|> (id 2) ends a turn.
DEMO_VOCABULARY = Vocabulary(MODEL, 1024, 2)


def workload_overrides(kind: str, data: Path, model: Path = MODEL) -> list[str]:
    """The `--set`s of one workload beyond the run's own."""
    if kind == "toy-demo":
        return [
            "sim.env=math",
            "sim.prompt_len_min=20",
            "sim.prompt_len_max=40",
            "sim.max_tokens=16",
        ]
    if kind == "toy-long":
        return [
            "sim.env=math",
            "sim.prompt_len_min=3900",
            "sim.prompt_len_max=4100",
            "sim.max_tokens=64",
            "batch.max_seq_len=8192",
        ]
    arith = ROOT / "demo" / "data" / "arith.jsonl"
    common = [
        f'model.tokenizer="{model}"',
        f'env.1.dataset="{ROOT / "demo/data/chat.jsonl"}"',
        # Training's throughput alone: evals have their own figures.
        "eval.env=[]",
        "rewards.workers=1",
    ]
    if kind == "tasks-demo":
        return [*common, f'env.0.dataset="{arith}"']
    if kind == "tasks-million":
        return [*common, f'env.0.dataset="{data / "million.jsonl"}"']
    assert kind == "tasks-long"
    return [
        *common,
        f'env=[{{name = "long", dataset = "{data / "long.jsonl"}", '
        'prompt = "question", answer = "answer", max_tokens = 64, '
        'rewards = ["orchestrator.rewards:math_answer", "demo.rewards:digit_share"]}]',
        "batch.max_seq_len=8192",
    ]


@contextlib.contextmanager
def fleet_and_trainer(
    run_dir: Path, steps: int, cores: frozenset[int], vocabulary: Vocabulary = DEMO_VOCABULARY
) -> Iterator[list[str]]:
    """The workloads' fleet (2 sim-inference servers of SHAPE, sampling from
    `vocabulary`) and the sim trainer, on `cores`, for a run of `steps` in `run_dir`:
    yields the daemon's `--set`s for them."""
    with sim_servers(2, SHAPE, cores, extra=vocabulary.server_flags()) as urls:
        overrides = [
            *run_overrides(run_dir, urls, SHAPE, []),
            f"max_steps={steps}",
            *vocabulary.overrides(),
            "payload.fsync=false",
        ]
        trainer = [
            f'run_dir="{run_dir}"',
            f"max_steps={steps}",
            "sim.train_time_s=0.05",
            "trainer.poll_interval_s=0.05",
        ]
        with sim_trainer(trainer, cores, run_dir.with_name(f"{run_dir.name}-trainer.log")):
            yield overrides


def run_one(
    kind: str,
    steps: int,
    data: Path,
    base: Path,
    *,
    every_core: bool = False,
    profiler: Span | None = None,
    batch_size: int | None = None,
    vocabulary: Vocabulary = DEMO_VOCABULARY,
) -> Result:
    """One workload; `every_core`: this process is not pinned (see `every_core_row`),
    else the daemon runs on its own core. `profiler`: see `measure`. `batch_size`: the
    rollouts per step instead of the config's (16), with twice as many requests in flight
    (the config's own ratio). `vocabulary`: the real-task rows' tokenizer folder."""
    cores = plan_cores()
    config_file = SIM if kind.startswith("toy") else DEMO
    batch = [] if batch_size is None else batch_overrides(batch_size)
    workload = workload_overrides(kind, data, vocabulary.folder)
    with fleet_and_trainer(base / kind, steps, cores.fleet, vocabulary) as overrides:
        config = load_config(config_file, [*overrides, *workload, *batch])
        result = trio.run(measure, kind, config, profiler)
    if every_core:
        return attrs.evolve(result, cores=str(len(cores.daemon | cores.fleet) or "all"))
    return result


def batch_overrides(size: int) -> list[str]:
    """The `--set`s of a run of `size` rollouts per step."""
    return [f"batch.size={size}", f"inference.max_inflight={2 * size}"]


def every_core_row(kind: str, steps: int, data: Path, cores: frozenset[int]) -> Result:
    """`kind` with the daemon free on every core (`cores`: this machine's, as the script
    found them), in a fresh process of this script: in this one, the worker threads trio
    keeps from the pinned runs would stay pinned; and a child inherits its parent's
    affinity, so the child is given every core back before it starts."""
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--steps",
            str(steps),
            "--every-core",
            kind,
            "--data",
            str(data),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    return Result(**json.loads(done.stdout.strip().splitlines()[-1]))


def report(results: list[Result], steps: int, million_rss: float) -> str:
    rows = [
        f"| {r.name} | {r.cores} | {r.rollouts} | {r.seconds:.1f} | {r.daemon_cpu_s:.1f} | "
        f"{r.per_cpu_s:.0f} | {r.workers_cpu_s:.1f} | {r.worst_lag_ms:.1f} | "
        f"{r.p99_lag_ms:.1f} | {r.rss_mib:.0f} |"
        for r in results
    ]
    return "\n".join(
        [
            "## Real tasks: tokenizer, chat template and rewards in worker processes",
            "",
            f"`uv run --frozen --group bench python bench/real_tasks.py --steps {steps}` "
            f"(revision {git_revision()}), on {machine()}.",
            "",
            "Each row a fresh run of the demo's machinery: 2 sim-inference processes (1,024-token "
            "vocabulary, 48 layers, top-8 of 128) and the trainer pinned to the other core, the "
            "daemon in this process on core 0 (`daemon cores` 1), or free on every core "
            "(`daemon cores` 2: how a head node runs it); real-task rows score with 1 reward "
            "worker process. Measured from the first dispatch to the end of the run (start-up "
            "excluded); the lag is the overshoot of a 10 ms timer on the daemon's loop "
            "meanwhile, its worst and its 99th percentile. On one core the loop waits for the "
            "core behind the daemon's own worker threads and the reward workers: the "
            "scheduler's lag, not the loop's.",
            "",
            "| workload | daemon cores | rollouts | wall s | daemon CPU s | "
            "rollouts / daemon CPU s | reward workers CPU s | worst loop lag ms | "
            "p99 loop lag ms | daemon RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"The daemon's RSS after the million-row run against the demo's: "
            f"{million_rss:+.0f} MiB (the `.jsonl` index is 8 MB; rows are read by offset).",
        ]
    )


def model_report(results: list[Result], steps: int, vocabulary: Vocabulary, command: str) -> str:
    """The table of a `--model` run: the real-task rows with that tokenizer."""
    rows = [
        f"| {r.name} | {r.rollouts} | {r.seconds:.1f} | {r.daemon_cpu_s:.1f} | "
        f"{1000 * r.daemon_cpu_s / r.rollouts if r.rollouts else 0:.2f} | {r.per_cpu_s:.0f} | "
        f"{r.workers_cpu_s:.1f} | {r.rss_mib:.0f} |"
        for r in results
    ]
    return "\n".join(
        [
            f"## Real tasks with the tokenizer of `{vocabulary.folder.name}` "
            f"({vocabulary.size:,} ids, eos {vocabulary.eos_token_id})",
            "",
            f"`{command}` (revision {git_revision()}), on {machine()}.",
            "",
            "As the table above, pinned (the daemon on core 0, the fleet and trainer on the "
            "other), the servers sampling from this vocabulary.",
            "",
            "| workload | rollouts | wall s | daemon CPU s | daemon CPU ms / rollout | "
            "rollouts / daemon CPU s | reward workers CPU s | daemon RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--model",
        type=Path,
        help="a model folder whose tokenizer the real-task rows use instead of demo/model",
    )
    parser.add_argument(
        "--kinds",
        default="tasks-demo,tasks-long",
        help="with --model: the workloads to run, comma-separated (default %(default)s)",
    )
    # Internal: one workload unpinned, its result as JSON (see `every_core_row`).
    parser.add_argument("--every-core", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet_daemon_logs()
    # "demo.rewards:digit_share" resolves against the directory the run starts in.
    os.chdir(ROOT)
    # transformers' first import costs seconds of CPU once per process: not the runs'.
    from orchestrator.tasks.chat import ChatTokenizer

    ChatTokenizer.load(MODEL, require_chat_template=True)
    if args.every_core:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        with tempfile.TemporaryDirectory(prefix="real-tasks-") as tmp:
            result = run_one(args.every_core, args.steps, args.data, Path(tmp), every_core=True)
        print(json.dumps(attrs.asdict(result)))
        return 0
    if args.model is not None:
        return model_main(args)
    every_core = frozenset(os.sched_getaffinity(0))
    pin_self(plan_cores().daemon)
    with tempfile.TemporaryDirectory(prefix="real-tasks-") as tmp:
        base = Path(tmp)
        long_dataset(base / "long.jsonl", rows=200, words=2600)
        big_dataset(base / "million.jsonl", rows=1_000_000)
        results = []
        # The million-row run right after the demo's, whose RSS it is measured against.
        for kind in ("toy-demo", "tasks-demo", "tasks-million", "toy-long", "tasks-long"):
            print(f"{stamp()} {kind} ...", flush=True)
            results.append(run_one(kind, args.steps, base, base))
            print(f"{stamp()} {kind}: {results[-1]}", flush=True)
        for kind in ("tasks-demo", "tasks-long"):
            print(f"{stamp()} {kind}, every core ...", flush=True)
            results.append(every_core_row(kind, args.steps, base, every_core))
            print(f"{stamp()} {kind}: {results[-1]}", flush=True)
    by_name = {r.name: r for r in results if r.cores == "1"}
    million = by_name["tasks-million"].rss_mib - by_name["tasks-demo"].rss_mib
    text = report(results, args.steps, million)
    print(text)
    if not args.no_write:
        write_section("real_tasks", text)
    return 0


def model_main(args: argparse.Namespace) -> int:
    """`--model DIR`: the `--kinds` workloads with that folder's tokenizer; its own section."""
    vocabulary = Vocabulary.of(args.model.resolve())
    pin_self(plan_cores().daemon)
    results = []
    with tempfile.TemporaryDirectory(prefix="real-tasks-") as tmp:
        base = Path(tmp)
        long_dataset(base / "long.jsonl", rows=200, words=2600)
        for kind in args.kinds.split(","):
            print(f"{stamp()} {kind} with {vocabulary.folder} ...", flush=True)
            results.append(run_one(kind, args.steps, base, base, vocabulary=vocabulary))
            print(f"{stamp()} {kind}: {results[-1]}", flush=True)
    command = (
        f"uv run --frozen --group bench python bench/real_tasks.py --steps {args.steps} "
        f"--model {args.model} --kinds {args.kinds}"
    )
    text = model_report(results, args.steps, vocabulary, command)
    print(text)
    if not args.no_write:
        write_section(f"real_tasks_model_{vocabulary.folder.name}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
