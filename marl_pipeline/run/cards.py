"""A policy release (``marl export``): the weights, a model card (``README.md`` with YAML front matter, as Hugging
Face model cards have) and ``provenance.json``, both from run/provenance.py; and the card's short Markdown summary
the ``policies`` asset shows for each committed version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from marl_pipeline.policy.export import export_policy, require_empty
from marl_pipeline.policy.lora import is_adapter_checkpoint
from marl_pipeline.run.provenance import policy_provenance
from marl_pipeline.store import ExperienceStore

CARD = "README.md"
PROVENANCE = "provenance.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What the hub's ``base_model`` field takes (``owner/name``); a path or a built-in model is named only in the text."""
_WEIGHTS = {"full": "the full model", "lora merged": "its LoRA adapters merged into version 0",
            "lora adapters": "its LoRA adapters (peft) over version 0, not merged"}


def export_release(store: ExperienceStore, run: str, agent: str, version: int, out: Path, merge: bool = True) -> dict:
    """Write a stored policy version to ``out`` (new or empty) as weights, model card and ``provenance.json``.

    Args:
        store: the experience store holding the run.
        run: the run.
        agent: the agent.
        version: a committed policy version of ``agent``.
        out: the directory to write; it must not exist or be empty.
        merge: a LoRA version is merged into its base (version 0); False writes its peft adapters.

    Returns:
        The provenance written (run/provenance.py), with ``weights``: how the weights were written.

    Raises:
        StoreError: the version (or, for a LoRA version, its version 0) is not in the store.
        FileExistsError: ``out`` is not empty.
    """
    require_empty(out)  # before any read of the store or download
    provenance = policy_provenance(store, run, agent, version)
    directory = store.require_policy(run, agent, version)
    base = store.require_policy(run, agent, 0) if version else directory
    adapters = version > 0 and is_adapter_checkpoint(directory)
    provenance["weights"] = ("lora adapters" if not merge else "lora merged") if adapters else "full"
    export_policy(directory, base, out, merge=merge)
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    (out / CARD).write_text(model_card(provenance))
    return provenance


def model_card(provenance: dict) -> str:
    """The model card of a release: YAML front matter (the hub's fields and ``marl_pipeline``'s own), then the
    provenance as text and tables."""
    run, agent, version = provenance["run"], provenance["agent"], provenance["version"]
    base = provenance["base_model"]
    front = {"library_name": "peft" if provenance.get("weights") == "lora adapters" else "transformers",
             "pipeline_tag": "text-generation", "tags": ["marl-pipeline", "reinforcement-learning", "multi-agent"]}
    if base and _HUB_ID.match(base):
        front["base_model"] = base
    front["marl_pipeline"] = {"run": run, "agent": agent, "roles": provenance.get("roles") or [agent],
                              "version": version, "steps": version,
                              "tokens": provenance["tokens"], "commit": provenance["commit"],
                              "launches": [launch["id"] for launch in provenance["launches"]]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {run} / {agent}, policy version {version}", "",
             f"Agent `{agent}` of run `{run}`{_roles(provenance)} after {version} RL steps (step s makes version "
             f"s + 1), "
             f"trained with RL by marl-pipeline from base model `{base or 'not recorded'}` (version 0: "
             f"the base after its warm-up). Weights: {_WEIGHTS.get(provenance.get('weights'), 'not exported')}. Store: "
             f"`{provenance['store']}`. Everything here is in `{PROVENANCE}` as data.", ""]
    lines += _training(provenance) + _algorithm(provenance) + _evaluation(provenance) + _health(provenance)
    lines += _launches(provenance)
    lines += ["## Experiment config", "", "Of the launch that made this version, credentials removed."
              if provenance["config"] else "Not recorded (the run's launch record predates configs).", ""]
    if provenance["config"]:
        lines += ["```yaml", yaml.safe_dump(provenance["config"], sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def _training(provenance: dict) -> list[str]:
    if not provenance["version"]:
        return ["## Training", "", "None: version 0 is the base policy.", ""]
    missing = provenance["steps_missing"]
    lines = ["## Training", ""]
    if missing:
        lines += [f"The store holds no policy updates of this agent for steps {', '.join(map(str, missing))}.", ""]
    lines += [f"{provenance['rows']} rows, {provenance['tokens']} response tokens over "
              f"{len(provenance['steps'])} steps, from the agent's `policy_updates` partitions:", "",
              "| step | micro-batches | rows | tokens | sampled at | teammates' versions |",
              "| --- | --- | --- | --- | --- | --- |"]
    for step in provenance["steps"]:
        lines.append(f"| {step['step']} | {len(step['micro_batches'])} | {step['rows']} | {step['tokens']} | "
                     f"{_versions(step['sampled_versions'])} | {teammates_text(step['teammates'])} |")
    return [*lines, ""]


def _algorithm(provenance: dict) -> list[str]:
    algorithm = provenance.get("algorithm")
    if not algorithm:
        return []
    lines = ["## Algorithm", "", "The settings this agent sampled and trained with: the experiment's `algorithm:`, and "
             "the agent's own values where its `agents.<agent>.algorithm` sets them.", "",
             "| setting | value | from |", "| --- | --- | --- |"]
    for name, value in algorithm["settings"].items():
        shown = json.dumps(value) if isinstance(value, dict) else value
        lines.append(f"| {name} | {shown} | {'the agent' if name in algorithm['own'] else 'the experiment'} |")
    return [*lines, ""]


def _roles(provenance: dict) -> str:
    roles = provenance.get("roles") or [provenance["agent"]]
    return "" if roles == [provenance["agent"]] else f", one policy playing roles {', '.join(map(repr, roles))},"


def _evaluation(provenance: dict) -> list[str]:
    evaluation = provenance["evaluation"]
    if evaluation is None:
        return ["## Held-out evaluation", "", f"Version {provenance['version']} was not evaluated.", ""]
    lines = ["## Held-out evaluation", "", "| of | metric | value |", "| --- | --- | --- |"]
    measured = evaluation.get("roles") or {provenance["agent"]: evaluation["metrics"]}  # per role: a shared policy
    for who, metrics in [*measured.items(), ("team", evaluation["team"])]:
        for name, value in (metrics or {}).items():
            lines.append(f"| {who} | {name} | {_number(value)} |")
    return [*lines, ""]


def _health(provenance: dict) -> list[str]:
    health = provenance["health"]
    if health is None:
        return []
    signals = {name: value for name, value in health.items() if name not in ("step", "policy_version")}
    warnings = provenance.get("warnings") or []
    lines = ["## Training health", "", f"Of step {health['step']}, the update that made this version. "
             + ("Warnings raised at that step (the `health` settings of its launch):" if warnings
                else "No warning was raised at that step (the `health` settings of its launch)."), ""]
    lines += [*(f"- {warning}" for warning in warnings), *([""] if warnings else [])]
    lines += ["| signal | value |", "| --- | --- |"]
    lines += [f"| {name} | {_number(value)} |" for name, value in signals.items()]
    return [*lines, ""]


def _launches(provenance: dict) -> list[str]:
    lines = ["## Launches", ""]
    if not provenance["launches"]:
        return [*lines, "None recorded (the run's launch record predates its launch history).", ""]
    lines += ["| launch (Dagster run id) | started | steps | resumed | finished | code commit |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {launch['id'] or '-'} | {launch['started_at']} | {launch['first_step']}..{launch['last_step']} | "
              f"{launch['resumed']} | {launch['finished']} | {launch['commit'] or '-'} |"
              for launch in provenance["launches"]]
    return [*lines, ""]


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _versions(versions: list[int]) -> str:
    return ", ".join(f"v{version}" for version in versions) or "-"


def teammates_text(teammates: dict[str, list[int]]) -> str:
    """``verifier v3, critic v2, v3``: each teammate's versions; ``-`` for none."""
    return "; ".join(f"{name} {_versions(versions)}" for name, versions in teammates.items()) or "-"


def card_summary(run: str, agent: str, version: int, base_model: str, step_tokens: int,
                 teammates: dict[str, list[int]], launches: list[dict]) -> str:
    """A committed version's card in a few lines of Markdown (the ``policies`` asset's metadata).

    Args:
        run: the run.
        agent: the agent.
        version: the version committed.
        base_model: the agent's configured model.
        step_tokens: the response tokens of step version-1, which made it.
        teammates: each other agent's versions that served its turns in that step.
        launches: the launches whose steps trained it (run/provenance.py ``covering_launches``).
    """
    ran = "; ".join(f"`{launch['id'] or 'no id'}` (steps {launch['first_step']}..{launch['last_step']}"
                    + (", resumed" if launch["resumed"] else "") + f", commit `{(launch['commit'] or '-')[:12]}`)"
                    for launch in launches) or "none recorded"
    return "\n".join([
        f"**run `{run}`, agent `{agent}`, version {version}** (base model `{base_model}`)", "",
        f"- trained by steps 0..{version - 1}; step {version - 1}: {step_tokens} response tokens",
        f"- teammates at step {version - 1}: {teammates_text(teammates)}",
        f"- launches: {ran}",
        f"- the whole card: `marl export STORE --run {run} --agent {agent} --version {version} --out DIR`"])
