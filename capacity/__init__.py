"""capacity/: the physics and bookkeeping of the fleet. Pure Python except actor.py (Ray).

formats (KV bytes, format identity) -> identity (execution keys, quarantine) -> pricing (cost model)
-> ledger (two-phase reservations) / rates (histories, batch fit, TTFT calibration) -> caps,
forecast, anomaly -> fleet (the actor's state machine) -> actor (Ray actor + CapacityClient).
protocol holds the pydantic wire models; errors the exception hierarchy; ring a compact window.
"""
