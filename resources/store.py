"""The experience store resource: the experiment's store, opened for the asset or check that asks for it.

No ``from __future__ import annotations``: Dagster tells the nested ``experiment`` resource by its annotation.
"""

import dagster as dg
from pydantic import Field

from resources.experiment import ExperimentResource


class ExperienceStoreResource(dg.ConfigurableResource):
    """The ``ExperienceStore`` named by the experiment's YAML (``store:``).

    It has no URI of its own on purpose: the train job's orchestrator opens the YAML's store, so a second,
    overriding URI here would let the asset checks and the UI's recomputations read and write another store
    than the one the train job fills. The experiment stays the one place that says where a run lives.
    """

    experiment: ExperimentResource = Field(description="The experiment whose `store` this opens.")

    def open(self):
        """A fresh ``ExperienceStore`` (its filesystem handle belongs to the caller's step)."""
        from marl_pipeline.store import ExperienceStore

        return ExperienceStore(self.experiment.load().store)
