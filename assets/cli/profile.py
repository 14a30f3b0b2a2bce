"""``marl profile threads|engine|gpu|crowding``: the profiles ``marl plan`` reads, measured on this machine
(marl_pipeline/planner/profiling.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from assets.cli.output import console, open_store

profile = typer.Typer(no_args_is_help=True, help="Measure what marl plan reads, on this machine: a trainer's "
                                                 "threads, an engine, a trainer on a GPU, the host's crowding.")

DEFAULT_PROMPT, DEFAULT_RESPONSE = (3, 8), (1, 3)
"""Token lengths of a thread profile's rows when the run has no stored turns to take them from."""


@profile.command()
def threads(config_path: Path = typer.Argument(..., help="Experiment YAML file.", metavar="CONFIG"),
            out: Path = typer.Option(..., "--out", help="Where to write the thread profile (JSON)."),
            agent: str | None = typer.Option(None, help="The agent whose trainer is timed (default: the first)."),
            counts: list[int] = typer.Option([1, 2], "--threads", help="Thread counts, 1 2 ... n (repeatable)."),
            reps: int = typer.Option(9, help="Timed reps of each count."),
            settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a setting.")) -> None:
    """What a trainer's threads buy on these CPUs, for `marl plan --threads-profile`: the agent's version 0 (made by
    `marl prepare`) with its trainer settings, timed on a micro-batch of the experiment's rows (their token lengths
    those of the run's stored turns, where it has some)."""
    from marl_pipeline.config import ConfigError, apply_settings, read_config_data

    try:
        config, _ = apply_settings(read_config_data(config_path), str(config_path), settings)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    agent = agent or next(iter(config.agents))
    if agent not in config.agents:
        console.print(f"[red]no agent {agent!r} in {config_path} (agents: {', '.join(config.agents)})[/red]")
        raise typer.Exit(2)
    store = open_store(config.store)
    if 0 not in store.policy_versions(config.run, agent):
        console.print(f"[red]run {config.run!r} has no version 0 of {agent} in {store.uri}: run `marl prepare "
                      f"{config_path}` first[/red]")
        raise typer.Exit(2)
    from transformers import AutoConfig

    from marl_pipeline.cluster.specs import trainer_options
    from marl_pipeline.cluster.trainers import with_local_base
    from marl_pipeline.planner.profiling import synthetic_batch, trainer_threads

    model = store.require_policy(config.run, agent, 0)
    options = with_local_base(store, config.run, agent, trainer_options(config.agent_slice(agent), 1))
    prompt, response = _stored_lengths(store, config.run, agent)
    rows = config.pipeline.prompts_per_micro_batch * config.pipeline.samples_per_prompt
    batch = synthetic_batch(rows, AutoConfig.from_pretrained(model).vocab_size, prompt, response)
    console.print(f"{agent}'s trainer on {rows} rows of {prompt[0]}-{prompt[1]} prompt and {response[0]}-"
                  f"{response[1]} response tokens, threads {counts}, {reps} reps")
    try:
        found = trainer_threads(model, options, batch, counts, reps, progress=console.print)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    table = Table("threads", "median s (accumulate + apply_step)", "speed-up over 1", "cores kept busy")
    for count in counts:
        table.add_row(str(count), f"{found['seconds'][str(count)]:.3f}", f"{found['trainer'][str(count)]:.2f}",
                      f"{found['cores_busy'][str(count)]:.2f}")
    console.print(table)
    out.write_text(json.dumps(found, indent=1))
    console.print(f"thread profile written to {out} (marl plan --threads-profile {out})")


def _stored_lengths(store, run: str, agent: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The 10th to 90th percentile of the prompt and response lengths of ``agent``'s stored turns, else defaults."""
    import numpy as np
    import pyarrow.compute as pc

    table = store.read_stage(run, "rollouts", columns=["agent", "prompt_ids", "response_ids"])
    table = table.filter(pc.equal(table.column("agent"), agent)) if table.num_rows else table
    if not table.num_rows:
        return DEFAULT_PROMPT, DEFAULT_RESPONSE
    spans = []
    for column in ("prompt_ids", "response_ids"):
        lengths = pc.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)
        low, high = np.percentile(lengths, [10, 90])
        spans.append((max(1, int(low)), max(1, int(high))))
    return spans[0], spans[1]


@profile.command()
def engine(model: str = typer.Option(..., help="A model directory vLLM loads."),
           out: Path = typer.Option(..., "--out", help="Where to write the engine profile (JSON)."),
           tensor_parallel: int = typer.Option(1, help="vLLM's tensor parallelism."),
           decode_tokens: int = typer.Option(32, help="Tokens each decode point generates."),
           reps: int = typer.Option(3, help="Timed runs of each point (the median kept)."),
           max_model_len: int = typer.Option(2048, help="vLLM's context limit: decode contexts stop below it."),
           gpu_memory_utilization: float = typer.Option(0.5, help="vLLM's share of the device's memory.")) -> None:
    """An engine's decode step by batch and context, and its prefill by tokens, for `marl plan --gpu KIND
    --engine-profile AGENT=FILE`: bare vLLM, eager as this project's engines run, on this machine's device."""
    from marl_pipeline.planner.profiling import engine as measure

    found = measure(model, tensor_parallel, decode_tokens, reps, max_model_len, gpu_memory_utilization,
                    progress=console.print)
    out.write_text(json.dumps(found, indent=1))
    console.print(f"engine profile of {found['gpu']} written to {out} (marl plan --engine-profile AGENT={out})")


@profile.command()
def gpu(model: str = typer.Option(..., help="A model directory (Hugging Face format) the trainer loads."),
        out: Path = typer.Option(..., "--out", help="Where to write the trainer profile (JSON)."),
        checkpointing: bool = typer.Option(False, help="With activation checkpointing (trainer."
                                                       "activation_checkpointing)."),
        repeats: int = typer.Option(5, help="Timed steps after the warm-up (the best kept).")) -> None:
    """A trainer's MFU on this machine's GPU, for `marl plan --gpu KIND --profile FILE`: one RL-shaped
    micro-batch (64 rows, prompts of 256 tokens, responses of 32 to 1,024) through this project's trainer with its
    defaults, in bf16 autocast."""
    import torch

    from marl_pipeline.planner.profiling import gpu_trainer

    if not torch.cuda.is_available():
        console.print("[red]marl profile gpu measures a CUDA GPU, and torch sees none on this machine: run it where "
                      "the training will run[/red]")
        raise typer.Exit(2)
    found = gpu_trainer(model, checkpointing=checkpointing, repeats=repeats, progress=console.print)
    out.write_text(json.dumps(found, indent=1))
    console.print(f"trainer profile of {found['gpu']}: MFU {found['runs'][0]['mfu']:.1%} of the measured peak, "
                  f"written to {out} (marl plan --profile {out})")


@profile.command()
def crowding(store_uri: str = typer.Argument(..., help="Store holding the runs.", metavar="STORE"),
             calibrate: list[str] = typer.Option(..., "--calibrate", help="The run the costs come from (repeatable: "
                                                                          "each figure the mean over the runs)."),
             runs: list[str] = typer.Option(..., "--run", help="A launch of another layout, run on this machine, "
                                                               "to check the exponents on (repeatable)."),
             grid: list[float] = typer.Option([0.0, 0.05, 0.1, 0.15, 0.2], "--grid", help="Exponents to try."),
             threads_profile: str | None = typer.Option(None, "--threads-profile", help="What a trainer's threads "
                                                        "buy (marl profile threads' file); default linear.")) -> None:
    """The host's crowding exponent: how much a core shared by more threads than it has loses, fitted by simulating
    stored launches of several layouts again from one calibration's costs. Write the fit into the thread profile
    as "crowding" for marl plan."""
    from marl_pipeline.planner.profiling import crowding as fit
    from marl_pipeline.planner.threads import thread_profile

    try:
        found = fit(open_store(store_uri), calibrate, runs, grid, thread_profile(threads_profile)
                    if threads_profile else None)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    table = Table("crowding", "runs", "median |error|", "max", "root mean square",
                  title="each run simulated again against its measured step time")
    for row in found:
        table.add_row(f"{row['crowding']:g}", str(len(row["runs"])), f"{row['median']:.1%}", f"{row['max']:.1%}",
                      f"{row['rms']:.1%}")
    console.print(table)
    best = min(found, key=lambda row: row["rms"])
    console.print(f"fit: crowding {best['crowding']:g} (least root mean square error)")
