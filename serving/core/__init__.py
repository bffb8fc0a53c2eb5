"""The engine's core, below everything else in `serving/`: requests and their sampling
parameters, the scheduler and the cache manager with the pools it owns, the step's plain-data
description, padded batches, and the on-device decode and sampling. Nothing here imports from
the rest of `serving/`."""
