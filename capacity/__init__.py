"""capacity/: the physics and bookkeeping of the fleet. Pure Python except actor.py and
transport/client.py (Ray).

formats (KV bytes, format identity) -> identity (execution keys, quarantine) -> pricing (cost model)
-> ledger (two-phase reservations) / rates (histories, batch fit, TTFT calibration) -> caps,
forecast, anomaly -> fleet (the actor's state machine) -> ops + waiting (the actor's batch path)
-> actor (the Ray actor). operations holds the batched operations and their codec, protocol the
pydantic wire models, sections the base of the actor's config sections (unknown keys refused),
errors the exception hierarchy, ring a compact window; transport/ is how
clients reach the actor (CapacityClient, the direct connection, batching, the local fallback).
"""
