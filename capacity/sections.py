"""The base of the capacity actor's config sections (FleetConfig and its parts): pydantic,
frozen, and refusing an unknown key by name, so a misspelt or renamed knob fails where the
config is read instead of being dropped while the default silently applies. Pure Python."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def describe(e: ValidationError, source: str) -> str:
    """One line per problem, each naming its key: `capacity config: caps.floor_tp: unknown key`."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{source}: {loc}: {msg}")
    return "\n".join(lines)
