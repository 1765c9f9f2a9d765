"""The benchmarks' config: configs/tiny.toml with a benchmark's output dir, TQ partition and section overrides."""

from __future__ import annotations

from pathlib import Path

from scd.config import Config, derive_config

REPO = Path(__file__).resolve().parents[1]


def tiny(tmp: Path, partition: str = "bench", **overrides: dict[str, object]) -> Config:
    base: dict[str, dict[str, object]] = {"run": {"output_dir": str(tmp)}, "telemetry": {"metrics_port": 0},
                                          "data_plane": {"partition": partition}}
    return derive_config(REPO / "configs" / "tiny.toml", base, overrides)
