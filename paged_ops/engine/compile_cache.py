"""One on-disk home for everything a warm-up compiles, so that a second start loads it instead.

A warm-up compiles three kinds of code, each cached on disk by its own tool:

============================  =====================================  ==================================
tool (what it caches)         environment variable (read when)       directory under the cache root
============================  =====================================  ==================================
Inductor: FX graph cache      ``TORCHINDUCTOR_CACHE_DIR`` (at every  ``inductor/`` (``fxgraph/``,
(compiled graphs), AOT-       cache lookup, torch 2.11 and 2.13)     ``aotautograd/``, generated kernels
Autograd cache, autotune                                             with their ``.best_config``)
results of its kernels
Triton: compiled kernels of   ``TRITON_CACHE_DIR`` (at every kernel  ``triton/``
our attention / KV-write      compile and launcher build, triton
kernels and of Inductor's,    3.6 and 3.9 ``knobs.cache.dir``)
their C launchers
FlashInfer: JIT-built CUDA    ``FLASHINFER_WORKSPACE_BASE`` (once,   ``flashinfer/`` (modules under
modules (ninja + nvcc)        at ``import flashinfer``, 0.6.x)       ``.cache/flashinfer/<ver>/<arch>``)
============================  =====================================  ==================================

The cache root is ``cache_dir`` if given, else ``$PAGED_OPS_CACHE_DIR``, else
``$XDG_CACHE_HOME/paged_ops`` (``~/.cache/paged_ops``). A tool's own variable that the user set wins
over the root; nothing else of the tools' configuration changes. Inductor's FX graph and AOTAutograd
caches and its local autotune cache are on by default in torch 2.11 and 2.13 (``fx_graph_cache``,
``enable_autograd_cache``, ``autotune_local_cache``); :func:`compile_cache_status` reports them, and
only the user turns them off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``, ...). Nothing is created here: each
tool makes its directory when it first writes, so a CPU run that compiles nothing writes nothing.

What stays uncached: Dynamo's trace of the model (seconds per start) and CUDA graph capture.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("paged_ops")

CACHE_DIR_ENV = "PAGED_OPS_CACHE_DIR"
# each tool's directory variable -> its subdirectory of the cache root
TOOL_DIRS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}
_set_here: dict[str, str] = {}  # values this module put into os.environ (ours to replace)


def default_cache_root() -> Path:
    """``$PAGED_OPS_CACHE_DIR``, else ``$XDG_CACHE_HOME/paged_ops``, else ``~/.cache/paged_ops``."""
    if root := os.environ.get(CACHE_DIR_ENV):
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "paged_ops"


def _set_by_torch(name: str, value: str) -> bool:
    """Whether ``value`` is a default that torch wrote into the environment itself: Inductor
    exports its cache dir (``/tmp/torchinductor_<user>``) on first use, and Triton's
    (``<inductor dir>/triton/<device>``) when it builds its first kernel."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    inductor = os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if name == "TORCHINDUCTOR_CACHE_DIR":
        return os.path.abspath(value) == os.path.abspath(default_cache_dir())
    parent, device = os.path.split(os.path.abspath(value))
    return (
        name == "TRITON_CACHE_DIR"
        and device.isdigit()
        and parent == os.path.join(inductor, "triton")
    )


def _user_set(name: str) -> bool:
    value = os.environ.get(name)
    if not value or _set_here.get(name) == value:
        return False
    return name == "FLASHINFER_WORKSPACE_BASE" or not _set_by_torch(name, value)


def configure_compile_caches(cache_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Point Inductor's, Triton's and FlashInfer's on-disk caches into one cache root.

    Call it before the first compile of the process (``LLM`` does, at construction). Environment
    variables the user set for a tool are kept; so is FlashInfer's directory if ``flashinfer`` was
    already imported (it reads its variable once, at import).

    Args:
        cache_dir: the cache root; default :func:`default_cache_root`.
    Returns:
        each tool's directory variable -> the directory it uses now.

    Example:
        >>> configure_compile_caches("/scratch/paged_ops")["TRITON_CACHE_DIR"]
        '/scratch/paged_ops/triton'
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    root = root.absolute()
    used = {}
    users = {name for name in TOOL_DIRS if _user_set(name)}  # all read before any is set
    for name, sub in TOOL_DIRS.items():
        if name in users:
            used[name] = os.environ[name]
        elif name == "FLASHINFER_WORKSPACE_BASE" and "flashinfer.jit.env" in sys.modules:
            used[name] = str(sys.modules["flashinfer.jit.env"].FLASHINFER_BASE_DIR)
        else:
            os.environ[name] = _set_here[name] = used[name] = str(root / sub)
    logger.info("compile caches: %s", ", ".join(f"{k}={v}" for k, v in used.items()))
    return used


def compile_cache_status() -> dict[str, bool]:
    """Whether each of Inductor's on-disk caches is on (it is, unless the user turned it off)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.compiler import config as compiler_config

    off = bool(compiler_config.force_disable_caches)
    return {
        "fx_graph_cache": bool(inductor_config.fx_graph_cache) and not off,
        "aot_autograd_cache": bool(functorch_config.enable_autograd_cache) and not off,
        "autotune_local_cache": bool(inductor_config.autotune_local_cache) and not off,
    }
