"""GGUF import: a llama.cpp/Ollama GGUF file -> a model folder mlx-lm and Orchard load.

    from engine.model.gguf import import_gguf
    import_gguf("model.gguf", "models/my-model", dtype="float32")

Also `orchard import-gguf FILE OUT_DIR`, and a serving config's model `path:` may name a .gguf
file (imported once into a cache folder, see engine.model.gguf.cache). docs/models.md lists what
imports.
"""
from engine.model.gguf.importer import DTYPES, import_gguf
from engine.model.gguf.reader import GGUFImportError

__all__ = ["DTYPES", "GGUFImportError", "import_gguf"]
