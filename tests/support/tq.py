"""A TQ partition of the session's real TQ, reached and emptied by name."""

from __future__ import annotations

from scd.config import DataPlaneConfig
from scd.dataplane import DataPlane


def dataplane_for(partition: str) -> DataPlane:
    return DataPlane(DataPlaneConfig(partition=partition))


async def clear_partition(partition: str) -> None:
    await dataplane_for(partition).clear_all()
