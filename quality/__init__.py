"""The KV-format quality gate (`orchard quality`, `python -m quality`): tooling outside the product.

`gate` is the command and the verdicts; `data` the held-out texts (from `training/`'s corpus and
SmolLM2's chat domain), `tasks` the probes and retrieval, `runs` the per-format forward passes,
`stats` the intervals, `report` the Markdown table, `variants` an int4 design experiment.
"""
