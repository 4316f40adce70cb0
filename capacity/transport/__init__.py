"""How clients reach the capacity actor: `client.CapacityClient` (the one Ray-facing piece here)
batches operations (`report_batcher`), sends them over the direct TCP connection (`fastpath`,
found and backed off by `fast_link`) or as Ray calls, and admits locally while the actor is
unreachable (`local_admissions`). The actor's side of the direct connection is
`fastpath.FastServer`. Everything but client.py is pure asyncio.
"""
