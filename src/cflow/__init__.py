"""cflow: bandwidth-bound LLM decode on CPUs, co-designed with pipeline-native transformers.

The public API. Heavy pieces load lazily so `import cflow` stays fast and never pulls in torch:
the runtime (Engine, file format, tokenizer) needs only numpy and the C core.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["ModelConfig", "ConfigError", "PRESETS", "Engine", "EngineOptions", "__version__"]


def __getattr__(name: str):
    # Nothing is imported with the package itself: the `cflow` command installs its Ctrl-C handler
    # (cflow.cli) before any other import, so the window in which Ctrl-C prints a traceback is
    # only the interpreter's own start.
    if name in ("ModelConfig", "ConfigError", "PRESETS"):
        from cflow import config

        return getattr(config, name)
    if name in ("Engine", "EngineOptions"):
        from cflow import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'cflow' has no attribute {name!r}")
