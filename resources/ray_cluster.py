"""The Ray resource: dagster-ray's ``RayResource`` lifecycle, embedded local Ray or an existing cluster.

No ``from __future__ import annotations`` here: Dagster tells a nested resource field (``experiment``) from a
config field by its evaluated annotation.
"""

import contextlib
import time
from collections.abc import Generator

import dagster as dg
from dagster_ray import RayResource
from pydantic import Field

from resources.experiment import ExperimentResource

SETUP_PREFIX = "set-up: "
"""What a launch's set-up phases start with in the run's log (Ray's start here, the launch's in ``assets.train``):
the ``marl`` CLI prints those lines as they come."""


class RayCluster(RayResource):
    """Ray for a Dagster step, where the experiment's YAML (``ray:``) says.

    The address is this resource's ``address`` when set, else the YAML's ``ray.address``: None starts an
    embedded local Ray for the step and stops it afterwards (like dagster-ray's ``LocalRay``), with the
    YAML's ``ray.num_cpus`` unless ``ray_init_options`` names ``num_cpus``; an address (``ray://host:10001``,
    ``auto``) connects to an existing cluster. Reading the YAML here is what makes ``dagster dev``, the
    ``retrain`` schedule and the ``marl`` CLI (which all share this resource) agree on where Ray runs.
    We subclass dagster-ray's base rather than use ``LocalRay`` because ``LocalRay`` pins the address to None.
    """

    experiment: ExperimentResource = Field(description="The experiment whose `ray` settings apply where unset here.")
    address: str | None = Field(default=None, description="Existing Ray cluster to join; None: the experiment's "
                                                          "`ray.address` (None there too starts a local one).")

    def resolved(self) -> "RayCluster":
        """This resource with the experiment's ``ray`` settings filled in where its own are unset."""
        settings = self.experiment.load().ray
        address = self.address if self.address is not None else settings.address
        options = dict(self.ray_init_options)
        if address is None:  # ray.init refuses num_cpus when it joins a cluster: the YAML's sizes a local Ray only
            options = settings.local_init_options(options)
        return self.model_copy(update={"address": address, "ray_init_options": options})

    @contextlib.contextmanager
    def yield_for_execution(self, context: dg.InitResourceContext) -> Generator["RayCluster", None, None]:
        # dagster-ray's connect reads ``ray_address`` and ``ray_init_options`` off the resource it runs on, so
        # the step gets (and connects) the resolved copy; the YAML is read when a step starts, never at import.
        import ray as ray_library

        started, running = time.perf_counter(), ray_library.is_initialized()  # running: the marl CLI started it
        with RayResource.yield_for_execution(self.resolved(), context) as ray:
            how = "joined" if ray.address else "joined (started as the command loaded)" if running else "started"
            context.log.info(f"{SETUP_PREFIX}{ray.name} {how} ({time.perf_counter() - started:.1f} s)")
            yield ray

    def connect(self, context: dg.InitResourceContext):
        """``ray.init`` as dagster-ray's ``connect`` calls it, without its Ray Data set-up: it imports Ray Data here
        and again in a task on a worker, to set options of a library this project does not use (1.4 s of the
        driver's start-up each time, and a worker's)."""
        import ray
        from dagster_ray.utils import _process_dagster_env_vars

        options = _process_dagster_env_vars(dict(self.ray_init_options))  # {"env": NAME} values, as dagster-ray reads
        if env_vars := self.get_env_vars_to_inject():  # its debugging switches (enable_tracing...)
            runtime_env = dict(options.get("runtime_env") or {})
            options["runtime_env"] = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **env_vars}}
        elif self.ray_address is None and ray.is_initialized():
            # An embedded Ray this process started already: the marl CLI's, begun with these options while it loaded
            options["ignore_reinit_error"] = True
        self._context = ray.init(address=self.ray_address, **options)
        return self._context

    @property
    def host(self) -> str:
        if self.address and "://" in self.address:
            return self.address.split("://", 1)[1].split(":", 1)[0]
        return "127.0.0.1"

    @property
    def ray_address(self) -> str | None:  # type: ignore[override]
        return self.address

    @property
    def name(self) -> str:
        return f"Ray at {self.address}" if self.address else "embedded local Ray"

    @property
    def created(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return True
