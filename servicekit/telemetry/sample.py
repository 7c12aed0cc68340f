"""One gauge reading, the unit every device source returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    """A gauge value with its metric name, help text and labels."""

    name: str
    help: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
