"""The benchmarks' config: configs/tiny.toml with a benchmark's output dir, TQ partition and section overrides."""

from __future__ import annotations

from pathlib import Path

from scd.config import Config, derive_config

REPO = Path(__file__).resolve().parents[1]


def tiny(tmp: Path, partition: str = "bench", **overrides: dict[str, object]) -> Config:
    # Checkpointing (on in configs/tiny.toml) only where a benchmark turns it on: it measures what it names.
    base: dict[str, dict[str, object]] = {"run": {"output_dir": str(tmp)}, "telemetry": {"metrics_port": 0},
                                          "data_plane": {"partition": partition}, "checkpointing": {"enabled": False}}
    return derive_config(REPO / "configs" / "tiny.toml", base, overrides)
