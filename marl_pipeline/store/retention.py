"""Policy retention: which versions of an agent's policy the store keeps, and pruning the others.

Every version is a full checkpoint (weights, and since complete checkpoints the optimizer state: three times
the weights), so keeping them all grows without bound: a real model's versions take gigabytes each (a LoRA
agent's versions after 0 hold only adapters and their AdamW state, over its version 0, which is always kept:
policy/lora.py). The rule is the config's ``store.retention``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from marl_pipeline.config import RetentionConfig
from marl_pipeline.store import commits


def retained_versions(versions: Iterable[int], retention: RetentionConfig, protected: Iterable[int] = ()) -> set[int]:
    """The versions to keep out of ``versions``: version 0, the newest ``keep_last``, every ``keep_every``-th,
    and the ``protected`` ones (what a launch still needs)."""
    versions = sorted(set(versions))
    if retention.keep_all:
        return set(versions)
    keep = {0, *versions[-retention.keep_last:]} | set(protected)
    if retention.keep_every:
        keep |= {v for v in versions if v % retention.keep_every == 0}
    return keep & set(versions)


def prune(versions: dict[int, Path], retention: RetentionConfig, protected: Iterable[int] = ()) -> list[int]:
    """Delete the version directories the rule does not keep; returns the pruned versions.

    A directory is first renamed out of the ``version=*`` namespace (one atomic rename), so a reader listing
    versions never sees a half-deleted one; then it is deleted."""
    keep = retained_versions(versions, retention, protected)
    pruned = []
    for version, directory in sorted(versions.items()):
        if version in keep:
            continue
        doomed = directory.with_name(f"_pruned-{directory.name}-{commits.new_attempt()}")
        directory.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        pruned.append(version)
    return pruned
