"""Benchmarks and kernel checks: tooling outside the product.

Each module is a script printing JSON (`orchard bench WHAT`, or `python -m bench.WHAT`):
`engine` (paged engine vs mlx-lm), `kv` (KV formats), `attention` (packed attention variants),
`sampling`, `constrained`, `capacity` (the capacity actor), `serve_path` (the HTTP/Serve path's
overhead). `synthetic` builds the small random-weight models that benches and tests share;
`cuda_check` / `cuda_nvcc_check` check the CUDA kernels on a GPU / with a local nvcc;
`experiments/` holds work not wired into the engine. Product packages never import this one.
"""
