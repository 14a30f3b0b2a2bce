"""The Ray resource: dagster-ray's ``RayResource`` lifecycle, embedded local Ray or an existing cluster."""

from __future__ import annotations

from dagster_ray import RayResource
from pydantic import Field


class RayCluster(RayResource):
    """Ray for a Dagster step.

    ``address=None`` (the default) starts an embedded local Ray for the step and stops it afterwards, like
    dagster-ray's ``LocalRay``; an address (``ray://host:10001``, ``auto``) connects to an existing cluster.
    We subclass dagster-ray's base rather than use ``LocalRay`` because ``LocalRay`` pins the address to None.
    """

    address: str | None = Field(default=None, description="Existing Ray cluster to join; None starts a local one.")

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
