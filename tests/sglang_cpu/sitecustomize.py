"""Loaded by every Python process that has tests/sglang_cpu on PYTHONPATH (the `site` module imports
`sitecustomize` at start-up), SGLang's scheduler and TP worker children included.

Test support for running the real SGLang 0.5.23 on a CPU-only machine (see README.md here). It does nothing
unless SGLANG_USE_CPU_ENGINE=1 (SGLang's own switch for its CPU engine), and can be turned off with
EAGLE3_SGLANG_CPU_STANDINS=0. When active it only installs post-import hooks (sglang_cpu_patches.install): no
SGLang or torch module is imported here, so start-up of processes that never import SGLang is unaffected,
and each patch runs when SGLang itself first imports the module it patches.

The `sgl_kernel` stand-in next to this file needs no activation: being on PYTHONPATH is enough for
`from sgl_kernel import ...` to find it.

A `sitecustomize` further down sys.path (which this file shadows) is still executed afterwards.
"""

import os as _os
import sys as _sys


def _eagle3_sglang_cpu_activate() -> None:
    if _os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    if _os.environ.get("EAGLE3_SGLANG_CPU_STANDINS", "1") == "0":
        return
    here = _os.path.dirname(_os.path.abspath(__file__))
    if here not in _sys.path:
        _sys.path.insert(0, here)
    import sglang_cpu_patches

    sglang_cpu_patches.install()


def _eagle3_chain_shadowed_sitecustomize() -> None:
    """Run the next `sitecustomize` on sys.path, the one this file hides (if any)."""
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or _os.path.abspath(spec.origin) == _os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_eagle3_sglang_cpu_activate()
_eagle3_chain_shadowed_sitecustomize()
