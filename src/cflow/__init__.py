"""cflow: bandwidth-bound LLM decode on CPUs, co-designed with pipeline-native transformers.

The public API. Heavy pieces load lazily so `import cflow` stays fast and never pulls in torch:
the runtime (Engine, file format, tokenizer) needs only numpy and the C core.
"""

from __future__ import annotations

from cflow.config import ConfigError, ModelConfig, PRESETS

__version__ = "0.1.0"

__all__ = ["ModelConfig", "ConfigError", "PRESETS", "Engine", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from cflow.runtime import Engine

        return Engine
    raise AttributeError(f"module 'cflow' has no attribute {name!r}")
