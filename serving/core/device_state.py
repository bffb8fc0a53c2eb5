"""What the jitted steps of one engine read and write: the model split into its graph and flat
parameters, and the cache pytree, which each step that donates it replaces. The model runner
owns it; its verifier steps the same state."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DeviceState:
    graphdef: object
    params: list
    cache: object
