"""Benchmark: the pipeline's step time against the bare-library bound on the same data (issue 28.1, 28.2).

For each ``--staleness``, in one process run:

1. **pipeline**: a launch of CONFIG (``recipe.train`` on this process's Ray, as ``marl train`` runs it) for
   ``--steps`` steps; the step time is the median of ``StepFinished.seconds`` after step 0 (which pays first
   calls). Each stage's span per micro-batch (started -> committed) and wait (enqueued -> started) come from the
   same launch's events.
2. **bound**: after Ray is shut down, in this process with all cores (``torch.set_num_threads(os.cpu_count())``),
   the same steps' work replayed from the store with the bare libraries, agent by agent:
   - bare vLLM (``LLM.generate``) of the step's recorded prompts (token ids), each with its recorded response
     length (``ignore_eos``), seeded, at the launch's temperature, with the sampled token's logprob (as the
     engine asks for it); one call per micro-batch and agent, as the pipeline samples it;
   - bare torch: per micro-batch one right-padded forward/backward of its rows with the clipped policy-gradient
     loss (the output head at response positions only: ``scored_loss``), then one AdamW step, on the agent's
     version-0 model.
   Generation time depends on the architecture and the token counts, not the weights, so one ``LLM`` per distinct
   model directory serves every agent whose version 0 shares its architecture (the built-in model's agents).
   The bound of a step is the sum over its agents of both; nothing overlaps in it. It is replayed twice: batched
   per micro-batch, as the pipeline batches, and each agent's whole step as one batch; the smaller is the bound.

Step time / bound is the issue's ratio (tiny model: at most 1.5; SmolLM2: at most 1.1 at staleness 0, below 1 at
staleness 1). Per micro-batch, the stage table compares each stage's span with the bare work replayed for it
(rollouts: generation; policy_updates: forward/backward); the difference is what the pipeline adds. It also shows
what of the span the stage's own work covers, from the launch's stored rows (``own_work``: requests out, the
plugin's execution and scoring, the trainers' compute); the rest is the pipeline's overhead (issue 28.2): store
reads and commits, hand-overs, the driver's loop between a turn's result and its next request.

    .venv/bin/python -m bench.pipeline.bound configs/demo.yaml --steps 6 --staleness 0 1 --warmup-steps 20 \
        [--driver-core]
    .venv/bin/python -m bench.pipeline.bound configs/demo.yaml --steps 3 --staleness 0 1 --warmup-steps 0 \
        --set 'agents.*.model=smollm2-135m-instruct' --set pipeline.prompts_per_micro_batch=2 \
        --set pipeline.micro_batches_per_step=2 --set algorithm.max_new_tokens=48 --set 'agents.*.trainer.lr=1e-5' \
        --set 'agents.*.engine.kv_cache_gib=0.5' --set 'agents.*.trainer.chunk_tokens=512'
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path

import yaml

from bench.launch import launch

STAGES = ("rollouts", "environment_results", "rewards", "policy_updates")


def measured_launch(data: dict, store: Path, steps: int, staleness: int, warmup_steps: int | None,
                    s3_endpoint: str | None = None, driver_core: bool = False) -> dict:
    """One launch of the experiment; its step times, spans and configuration. ``s3_endpoint``: the store on that
    S3-compatible server (bucket ``marl``, a fresh prefix) instead of ``store``, which then holds its policy cache.
    ``driver_core``: the driver (this process) on the last core alone, Ray and the actors on the others."""
    import ray

    from marl_pipeline.config import parse_config
    from marl_pipeline.run.events import PolicyCommitted, SetupPhase, StageCommitted, StepFinished, ThreadsChanged

    data = json.loads(json.dumps(data))
    data.update(run="bound", store=str(store))
    if s3_endpoint:
        import boto3

        client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="testing", region_name="us-east-1")
        if "marl" not in [bucket["Name"] for bucket in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket="marl")
        data["store"] = {"uri": f"s3://marl/bound-{staleness}-{time.time_ns()}", "endpoint_url": s3_endpoint,
                         "region": "us-east-1", "access_key_id": "testing", "secret_access_key": "testing",
                         "policy_cache": str(store / "cache")}
    data["pipeline"].update(steps=steps, staleness=staleness)
    data.pop("evaluation", None)
    if warmup_steps is not None:
        for agent in data["agents"].values():
            agent["warmup"] = {**agent.get("warmup", {}), "steps": warmup_steps}
    config = parse_config(data, source=f"bound s={staleness}")
    shutil.rmtree(store, ignore_errors=True)
    cores = os.sched_getaffinity(0)
    if driver_core:
        os.sched_setaffinity(0, cores - {max(cores)})  # Ray's processes inherit it from the thread starting them
    ray.init(include_dashboard=False, log_to_driver=False)
    if driver_core:
        pin_threads({max(cores)})  # this process's threads (Ray's own in it included); the ones it starts inherit
    spans, steps_seen, setup, committed = defaultdict(list), [], [], []
    sampler, driver_cpu, collector = CpuSampler(), {}, GcTimer()

    def seen(event) -> None:
        if isinstance(event, SetupPhase):
            setup.append((event.name, round(event.seconds, 2)))
            print(f"  set-up: {event.name} ({event.seconds:.1f} s)", flush=True)
        elif isinstance(event, StageCommitted):
            committed.append(event)  # read after the launch: reading 512 rows' columns here took the driver's
            # interpreter from the stages it measures (the bench's own cost in bar 2's overhead)
        elif isinstance(event, PolicyCommitted):
            t = event.timing
            spans["optimizer_step"].append((event.step, -1, t.enqueued, t.started, t.ended, None, None, 0.0, None))
        elif isinstance(event, StepFinished):
            steps_seen.append((event.step, event.seconds))
            driver_cpu["first" if event.step == 0 else "last"] = {**thread_cpu(exclude={sampler.native_id}),
                                                                  **collector.totals()}
            print(f"  step {event.step}: {event.seconds:.3f} s", flush=True)
        elif isinstance(event, ThreadsChanged):
            print(f"  after step {event.step}: threads {event.changed}, cores used "
                  f"{ {name: round(cores, 2) for name, cores in event.cores.items()} }", flush=True)
    try:
        launch(config, seen)
    finally:
        sampler.stop()
        collector.stop()
        ray.shutdown()
        pin_threads(cores)
    for event in committed:
        t = event.timing
        spans[event.stage].append((event.key.step, event.key.micro_batch, t.enqueued, t.started, t.ended,
                                   own_work(event.stage, event.table), engine_steps(event.stage, event.table),
                                   # what the commit costs the stage: up to its hand-over to the store's writer
                                   # thread (before those, the write itself)
                                   (getattr(event, "handed", None) or event.committed) - t.ended,
                                   getattr(event, "cpu_seconds", None)))
    return {"config": config, "spans": dict(spans), "steps": steps_seen, "setup": setup, "cpu": sampler.samples,
            "driver_cpu": driver_cpu}


def pin_threads(cores: set[int]) -> None:
    """Every thread of this process on ``cores`` (Linux affinity is a thread's own)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except OSError:  # the thread ended meanwhile
            pass


class GcTimer:
    """Seconds the driver spent in Python's cyclic garbage collector, by generation (``gc.callbacks``): part of the
    thread times :func:`thread_cpu` reports, in whichever thread allocated."""

    def __init__(self) -> None:
        import gc

        self._seconds, self._started = defaultdict(float), {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        import threading

        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
        elif thread in self._started:
            self._seconds[f"gc, generation {info['generation']}"] += now - self._started.pop(thread)

    def totals(self) -> dict[str, float]:
        return dict(self._seconds)

    def stop(self) -> None:
        import gc

        gc.callbacks.remove(self._callback)


def read_stat(path: Path) -> tuple[str, int, float] | None:
    """A ``/proc/<pid>[/task/<tid>]/stat`` file's name, parent pid and CPU seconds so far (user + system); None
    when the process or thread ended meanwhile."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[1]), seconds


def thread_cpu(exclude: set[int] = frozenset()) -> dict[str, float]:
    """This process's CPU seconds so far, by thread name (the driver's side of the pipeline: its stages' Python, Ray's
    calls and transfers): Ray's C++ threads carry names of their own; Python's threads carry the process's, and
    their figure is the process's CPU less the named threads' and ``exclude``'s (thread ids: the bench's own), so that
    threads that ended (a launch's stage threads, by its last step) still count."""
    import threading

    python = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds, process = defaultdict(float), read_stat(Path("/proc/self/stat"))[0]
    named = 0.0  # Ray's threads and the excluded ones
    for stat in Path("/proc/self/task").glob("*/stat"):
        if (read := read_stat(stat)) is None:
            continue
        tid = int(stat.parent.name)
        if tid in exclude or read[0] != process:
            named += read[2]
            if tid not in exclude:
                seconds[read[0]] += read[2]
        elif tid in python:  # "of which", for the Python threads alive now: not added to the totals
            seconds[f"{process}, of which {python[tid]}"] += read[2]
    seconds[process] = time.process_time() - named  # every Python thread's, ended ones included
    return dict(seconds)


def driver_cpu_per_micro_batch(ran: dict) -> dict[str, float]:
    """The driver's CPU milliseconds a micro-batch over the steps after step 0, by thread name (largest first), and
    of it the garbage collector's (wall time, by generation)."""
    first, last = ran["driver_cpu"].get("first", {}), ran["driver_cpu"].get("last", {})
    batches = (len(ran["steps"]) - 1) * ran["config"].pipeline.micro_batches_per_step
    spent = {name: (last[name] - first.get(name, 0.0)) * 1e3 / max(batches, 1) for name in last}
    return {name: round(ms, 1) for name, ms in sorted(spent.items(), key=lambda item: -item[1]) if ms >= 0.5}


class CpuSampler:
    """The node's CPU time, busy and in all, from /proc/stat every ``PERIOD_S`` on a thread of its own (bar 5: CPU
    utilisation per phase)."""

    PERIOD_S = 0.02

    def __init__(self) -> None:
        import threading

        self.samples: list[tuple[float, int, int]] = []  # (time, busy jiffies, all jiffies)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        # left out of the driver's CPU: the bench's own cost, not the pipeline's (BENCHMARKS.md, "The bound")
        self.native_id = self._thread.native_id

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            with open("/proc/stat") as stat:
                fields = [int(v) for v in stat.readline().split()[1:]]
            self.samples.append((time.time(), sum(fields) - fields[3] - fields[4], sum(fields)))  # less idle, iowait

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def utilisation_by_phase(samples: list, spans: dict, measured: list[int]) -> dict[str, dict]:
    """Per phase of the measured steps, its share of their time and the node's CPU utilisation in it. A sample
    interval's phase is what ran through its middle: rollouts (a rollouts span), training (a policy_updates span or
    an optimizer step), both, or neither (the stages between, weight sync, commits)."""
    def active(stages: tuple[str, ...], t: float) -> bool:
        return any(s[3] <= t <= s[4] for stage in stages for s in spans.get(stage, []) if s[0] in measured)

    first = min(s[3] for stage in spans.values() for s in stage if s[0] in measured)
    last = max(s[4] for stage in spans.values() for s in stage if s[0] in measured)
    phases: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for (t0, busy0, all0), (t1, busy1, all1) in itertools.pairwise(samples):
        middle = (t0 + t1) / 2
        if not first <= middle <= last or all1 == all0:
            continue
        rolling, training = active(("rollouts",), middle), active(("policy_updates", "optimizer_step"), middle)
        name = {(True, True): "both", (True, False): "rollouts", (False, True): "training"}.get(
            (rolling, training), "neither")
        phases[name][0] += t1 - t0
        phases[name][1] += busy1 - busy0
        phases[name][2] += all1 - all0
    total = sum(seconds for seconds, _, _ in phases.values()) or 1.0
    return {name: {"time_share": round(seconds / total, 3), "cpu_utilisation": round(busy / every, 3)}
            for name, (seconds, busy, every) in sorted(phases.items())}


# The columns holding each row's own work, per stage: the interval the driver saw it computed (rollouts: a turn's
# request out, engine steps and the call's round trip; environment_results: the plugin's execution of the micro-batch;
# rewards: each episode's scoring).
WORK_INTERVALS = {"rollouts": ("rollout_start", "rollout_end"),
                  "environment_results": ("environment_start", "environment_end"),
                  "rewards": ("reward_start", "reward_end")}


def own_work(stage: str, table) -> float | None:
    """Seconds of a stage's span its own work covers, from the rows it committed: for rollouts, environment_results
    and rewards, the union of the rows' work intervals (``WORK_INTERVALS``); for policy_updates, the slowest
    trainer's own compute (``compute_seconds``, measured in its actor; the trainers run side by side). What is left
    of the span is the pipeline's: reads, commits, hand-overs, Ray calls. None: not recorded."""
    if stage == "policy_updates":
        seconds = [s for s in table.column("compute_seconds").to_pylist() if s is not None]
        return max(seconds) if seconds else None
    if stage not in WORK_INTERVALS or not table.num_rows:
        return None
    begin_column, end_column = WORK_INTERVALS[stage]
    intervals = sorted(zip((t.timestamp() for t in table.column(begin_column).to_pylist()),
                           (t.timestamp() for t in table.column(end_column).to_pylist())))
    covered, (start, end) = 0.0, intervals[0]
    for begin, finish in intervals[1:]:
        if begin > end:
            covered, start, end = covered + end - start, begin, finish
        else:
            end = max(end, finish)
    return covered + end - start


def engine_steps(stage: str, table) -> float | None:
    """For rollouts, the busiest engine's steps on the micro-batch: per agent, the sum of its turns'
    ``engine_seconds`` (each turn's share of the engine steps that computed it); None: other stages, or not recorded."""
    if stage != "rollouts" or "engine_seconds" not in table.column_names:
        return None
    by_agent: dict[str, float] = defaultdict(float)
    for agent, seconds in zip(table.column("agent").to_pylist(), table.column("engine_seconds").to_pylist()):
        by_agent[agent] += seconds or 0.0
    return max(by_agent.values(), default=None)


def recorded_work(config, steps: list[int]) -> dict:
    """Per (step, micro-batch, agent): the recorded prompt and response ids of its turns, from the store."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from marl_pipeline.store import ExperienceStore

    table = ExperienceStore(config.store).read_stage(
        config.run, "rollouts", columns=["step", "micro_batch", "agent", "prompt_ids", "response_ids", "logprobs"])
    table = table.filter(pc.is_in(table.column("step"), value_set=pa.array(steps)))
    work: dict[tuple[int, int, str], list[dict]] = defaultdict(list)
    for row in table.to_pylist():
        work[(row["step"], row["micro_batch"], row["agent"])].append(row)
    return work


_LLMS: dict = {}  # one bare engine per model fingerprint, for the whole process


def bare_generation(model_dirs: dict[str, str], work: dict, config) -> dict:
    """Seconds of bare vLLM generation per (step, micro-batch, agent)."""
    from marl_pipeline.inference.engine import ENGINE_ENV, WARMUP_BATCHES, engine_dtype, model_fingerprint

    os.environ.update(ENGINE_ENV)  # in-process engine core, as in the engine actor
    from vllm import LLM, SamplingParams

    llms, seconds = _LLMS, {}
    for agent, model_dir in model_dirs.items():
        fingerprint = model_fingerprint(model_dir)
        if fingerprint not in llms:
            engine = config.agents[agent].engine
            llms[fingerprint] = LLM(model=model_dir, dtype=engine_dtype(engine.dtype), enforce_eager=True, seed=0,
                                    gpu_memory_utilization=engine.gpu_memory_utilization,
                                    max_model_len=engine.max_model_len,
                                    max_num_batched_tokens=256 * engine.max_model_len)
            warm = [SamplingParams(max_tokens=2, seed=i, logprobs=0) for i in range(max(WARMUP_BATCHES))]
            for batch in WARMUP_BATCHES:  # the engine actor's own warm-up
                llms[fingerprint].generate([{"prompt_token_ids": [1, 2, 3]}] * batch, warm[:batch], use_tqdm=False)
        llm = llms[fingerprint]
        for key, rows in sorted(work.items()):
            if key[2] != agent:
                continue
            prompts = [{"prompt_token_ids": row["prompt_ids"]} for row in rows]
            params = [SamplingParams(max_tokens=max(1, len(row["response_ids"])), min_tokens=len(row["response_ids"]),
                                     ignore_eos=True, temperature=config.algorithm.temperature, seed=i, logprobs=0)
                      for i, row in enumerate(rows)]
            begin = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds[key] = time.perf_counter() - begin
    return seconds


def bare_training(model_dirs: dict[str, str], work: dict, steps: list[int], lr: float) -> dict:
    """Seconds of bare torch per (step, micro-batch, agent) forward/backward of ``work``, and per (step, "adamw",
    agent) of the AdamW step after a step's passes."""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.engines.trainer_throughput import _engine_logprobs, bare_optimizer_step
    from marl_pipeline.training.batches import TrainBatch
    from marl_pipeline.training.losses import pad_sequences

    seconds = {}
    for agent, model_dir in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in steps:
            tokens = 0
            for key in sorted(k for k in work if k[0] == step and k[2] == agent):
                rows = work[key]
                batch = TrainBatch([r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                                   [r["logprobs"] for r in rows], [1.0 if i % 2 else -1.0 for i in range(len(rows))])
                begin = time.perf_counter()
                input_ids, attention_mask, mask = pad_sequences(batch.prompt_ids, batch.response_ids, 0)
                old = _engine_logprobs(batch, list(range(len(rows))), mask)
                loss, count = scored_loss(model, input_ids, attention_mask, mask, old,
                                          torch.tensor(batch.advantages, dtype=torch.float32))
                loss.backward()
                tokens += count
                seconds[key] = time.perf_counter() - begin
            begin = time.perf_counter()
            bare_optimizer_step(model, optimizer, tokens)
            seconds[(step, "adamw", agent)] = time.perf_counter() - begin
    return seconds


def scored_loss(model, input_ids, attention_mask, response_mask, old, advantages):
    """The clipped policy-gradient loss summed over response tokens, with the output head computed at those positions
    only, as a careful plain-torch loop writes it (the trainer does the same). The head over every position, as
    ``trainer_throughput._pg_loss`` computes it, made SmolLM2's bare pass slower than the pipeline's trainer (its
    49,152-word head on prompt positions too): no bound."""
    import torch

    from bench.engines.trainer_throughput import CLIP_EPS

    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    scored = response_mask.bool()
    logits = model.get_output_embeddings()(hidden[scored]).float()
    logprobs = torch.gather(torch.log_softmax(logits, dim=-1), 1, input_ids[:, 1:][scored][:, None]).squeeze(-1)
    ratio = torch.exp(logprobs - old[scored])
    adv = advantages[:, None].expand_as(response_mask)[scored]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS))
    return loss.sum(), int(scored.sum())


def whole_steps(work: dict) -> dict:
    """The same rows keyed (step, -1, agent): each agent's whole step as one batch."""
    merged: dict[tuple[int, int, str], list[dict]] = defaultdict(list)
    for (step, _, agent), rows in sorted(work.items()):
        merged[(step, -1, agent)].extend(rows)
    return merged


def per_step(seconds: dict, step: int) -> float:
    return sum(value for key, value in seconds.items() if key[0] == step)


def stage_table(spans: dict, steps: list[int], generation: dict, passes: dict) -> list[dict]:
    """Per stage, means per micro-batch over the measured steps: span, wait, and the bare work replayed for it."""
    rows = []
    for stage in STAGES:
        chosen = [s for s in spans.get(stage, []) if s[0] in steps]
        if not chosen:
            continue
        bare_of = {"rollouts": generation, "policy_updates": passes}.get(stage, {})
        bare = [sum(v for k, v in bare_of.items() if k[:2] == (s[0], s[1])) for s in chosen] if bare_of else None
        span = [s[4] - s[3] for s in chosen]
        own = [s[5] for s in chosen if s[5] is not None]
        engine = [s[6] for s in chosen if s[6] is not None]
        cpu = [s[8] for s in chosen if s[8] is not None]
        rows.append({"stage": stage, "micro_batches": len(chosen),
                     "span_ms": round(1000 * statistics.mean(span), 1),
                     # what the actors' work leaves of the span: the pipeline's own overhead (bar 2)
                     "own_work_ms": round(1000 * statistics.mean(own), 1) if own else None,
                     # rollouts: the busiest engine's steps; the rest of "own work" is calls and idle engine time
                     "engine_steps_ms": round(1000 * statistics.mean(engine), 1) if engine else None,
                     # the commit follows the span (StageCommitted.handed, or .committed): overhead too
                     "commit_ms": round(1000 * statistics.mean(s[7] for s in chosen), 1),
                     # the stage thread's CPU in its span: the driver's computing (environment_results, rewards:
                     # the plugin's own work included); the rest of the span it waited (actors, a core, the GIL)
                     "thread_cpu_ms": round(1000 * statistics.mean(cpu), 1) if cpu else None,
                     "overhead_ms": round(1000 * statistics.mean(s[4] - s[3] - (s[5] or 0.0) + s[7] for s in chosen),
                                          1),
                     "wait_ms": round(1000 * statistics.mean(s[3] - s[2] for s in chosen), 1),
                     "bare_work_ms": None if bare is None else round(1000 * statistics.mean(bare), 1),
                     "added_ms": round(1000 * statistics.mean(span) - (1000 * statistics.mean(bare) if bare else 0),
                                       1)})
    return rows


def override(data: dict, setting: str) -> None:
    """Set ``a.b.c=value`` in the config's data; ``*`` in the path stands for every key at that level."""
    path, _, value = setting.partition("=")
    keys = path.split(".")

    def put(node: dict, rest: list[str]) -> None:
        if len(rest) == 1:
            node[rest[0]] = yaml.safe_load(value)
            return
        for key in (list(node) if rest[0] == "*" else [rest[0]]):
            put(node.setdefault(key, {}), rest[1:])

    put(data, keys)


def config_arguments(parser: argparse.ArgumentParser, work: Path) -> tuple[argparse.Namespace, dict]:
    """The command line of a bench that runs CONFIG (``--set`` overrides, ``--work``, ``--out``): its arguments and
    the config's data, overridden."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting (YAML value); agents.*.KEY sets it for every agent")
    parser.add_argument("--work", type=Path, default=work)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    args = parser.parse_args()
    data = yaml.safe_load(args.config.read_text())
    for setting in args.set:
        override(data, setting)
    return args, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--warmup-steps", type=int, default=None, help="override every agent's warm-up steps")
    parser.add_argument("--s3-endpoint", default=None,
                        help="the store on this S3-compatible server (e.g. `moto_server -p 5055`; bucket marl)")
    parser.add_argument("--driver-core", action="store_true",
                        help="the driver alone on the last core, the actors on the others (bar 2: its overhead when "
                             "it waits for no core; the bound is replayed on every core as before)")
    parser.add_argument("--pipeline-only", action="store_true",
                        help="no bare replay: the launches' step times and CPU utilisation per phase only")
    args, data = config_arguments(parser, Path("/tmp/marl-bench-bound"))
    if args.driver_core and len(os.sched_getaffinity(0)) < 2:
        parser.error("--driver-core needs at least 2 cores: one for the driver, the others for the actors")
    import torch

    from marl_pipeline.policy.precision import cpu_has_bf16, cpu_name

    cpu = cpu_name()

    print(f"{args.config}: {os.cpu_count()} cores, {cpu}{', native bf16' if cpu_has_bf16() else ''}", flush=True)
    launches = {}
    for staleness in args.staleness:  # every launch first: the bare replays hold memory a later launch needs
        print(f"pipeline, staleness {staleness}:", flush=True)
        launches[staleness] = measured_launch(data, args.work / f"s{staleness}", args.steps, staleness,
                                              args.warmup_steps, args.s3_endpoint, args.driver_core)
    if args.pipeline_only:
        for staleness, ran in launches.items():
            measured = [step for step, _ in ran["steps"] if step > 0]
            print(json.dumps({"staleness": staleness, "step_times_s": [round(s, 3) for _, s in ran["steps"]],
                              "cpu_by_phase": utilisation_by_phase(ran["cpu"], ran["spans"], measured),
                              "driver_cpu_ms_per_micro_batch": driver_cpu_per_micro_batch(ran)}), flush=True)
        return
    results = []
    for staleness, ran in launches.items():
        config = ran["config"]
        measured = [step for step, _ in ran["steps"] if step > 0]
        work = recorded_work(config, measured)
        from marl_pipeline.store import ExperienceStore

        model_dirs = {agent: str(ExperienceStore(config.store).require_policy(config.run, agent, 0))
                      for agent in config.agents}
        torch.set_num_threads(os.cpu_count())
        print(f"bound (bare vLLM and torch, {torch.get_num_threads()} threads):", flush=True)
        bounds = {}
        for granularity, replayed in (("micro-batch", work), ("step", whole_steps(work))):
            generation = bare_generation(model_dirs, replayed, config)
            training = bare_training(model_dirs, replayed, measured, next(iter(config.agents.values())).trainer.lr)
            bounds[granularity] = {
                "generation_s": round(statistics.median(per_step(generation, s) for s in measured), 3),
                "training_s": round(statistics.median(per_step(training, s) for s in measured), 3),
                "bound_s": round(statistics.median(per_step(generation, s) + per_step(training, s)
                                                   for s in measured), 3)}
            if granularity == "micro-batch":
                stages = stage_table(ran["spans"], measured, generation, training)
        tighter = min(bounds, key=lambda name: bounds[name]["bound_s"])
        step_time = statistics.median(seconds for step, seconds in ran["steps"] if step > 0)
        phases = utilisation_by_phase(ran["cpu"], ran["spans"], measured)
        result = {"staleness": staleness, "step_time_s": round(step_time, 3), "bound": tighter, **bounds[tighter],
                  "cpu_by_phase": phases, "driver_cpu_ms_per_micro_batch": driver_cpu_per_micro_batch(ran),
                  "ratio": round(step_time / bounds[tighter]["bound_s"], 2), "bounds": bounds,
                  "step_times_s": [round(s, 3) for _, s in ran["steps"]], "stages": stages, "setup": ran["setup"]}
        results.append(result)
        print(json.dumps(result, indent=1), flush=True)
    print("| staleness | step time (s) | bound (s): generation + training, batched per | step time / bound |")
    print("| --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['staleness']} | {r['step_time_s']} | {r['bound_s']} ({r['generation_s']} + "
              f"{r['training_s']}), {r['bound']}; other: {r['bounds']} | {r['ratio']} |")
    for r in results:
        print(f"\nstaleness {r['staleness']}, per micro-batch (means over steps after 0):")
        print("| stage | span (ms) | wait (ms) | bare work (ms) | added (ms) | own work (ms) "
              "| busiest engine's steps (ms) | commit (ms) | overhead: span - own work + commit (ms) "
              "| stage thread's CPU (ms) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in r["stages"]:
            print(f"| {row['stage']} | {row['span_ms']} | {row['wait_ms']} | {row['bare_work_ms'] or '-'} | "
                  f"{row['added_ms']} | {row['own_work_ms'] or '-'} | {row['engine_steps_ms'] or '-'} | "
                  f"{row['commit_ms']} | {row['overhead_ms']} | {row['thread_cpu_ms'] or '-'} |")
        print(f"overhead, all stages: {sum(row['overhead_ms'] for row in r['stages'] if row['stage'] in STAGES):.1f} "
              f"ms per micro-batch (bar 2: at most 50)")
        driver = r["driver_cpu_ms_per_micro_batch"]
        threads = sum(ms for name, ms in driver.items() if not name.startswith("gc") and ", of which" not in name)
        print(f"the driver's CPU a micro-batch: {threads:.1f} ms; by thread, and the collector's part: {driver}")
        print("| phase (bar 5) | share of the time | the node's CPU utilisation |")
        print("| --- | ---: | ---: |")
        for name, phase in r["cpu_by_phase"].items():
            print(f"| {name} | {phase['time_share']:.0%} | {phase['cpu_utilisation']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps({"config": str(args.config), "cpu": cpu, "cores": os.cpu_count(),
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
