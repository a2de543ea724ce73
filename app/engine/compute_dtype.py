"""Which dtype an engine computes in when the config says ``auto``.

vLLM's own ``auto`` takes the checkpoint's dtype (bfloat16 for every model this project
writes). On a CPU without bfloat16 instructions (no AVX512-BF16, no AMX) vLLM emulates
bfloat16 matmuls, and a 100M-parameter Llama prefilled at 19 ms/token in bfloat16 against
3.3 ms/token in float32 on this project's AVX2 machine (docs/engine.md). So ``auto`` here
means: bfloat16 on GPUs and on CPUs that compute it natively, float32 on other CPUs.
Resolved in the process that starts the engine, so each node decides for its own hardware.
"""
from __future__ import annotations

from functools import lru_cache

DTYPES = ("auto", "bfloat16", "float16", "float32")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str) -> bool:
    """True when /proc/cpuinfo-style text lists a bfloat16 compute extension."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Flags")):
            flags.update(line.split(":", 1)[-1].split())
    return any(f in flags for f in _NATIVE_BF16_FLAGS)


@lru_cache(maxsize=1)
def _this_host() -> tuple[bool, bool]:
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    try:
        with open("/proc/cpuinfo") as f:
            native = cpu_has_native_bf16(f.read())
    except OSError:
        native = False
    return cuda, native


def resolve(requested: str, *, cuda: bool | None = None, cpuinfo: str | None = None) -> str:
    """The concrete dtype for ``requested`` on this host (or on the host described)."""
    if requested not in DTYPES:
        raise ValueError(f"dtype: unsupported {requested!r}; expected one of {', '.join(DTYPES)}")
    if requested != "auto":
        return requested
    host_cuda, host_native = _this_host() if cuda is None or cpuinfo is None else (False, False)
    on_gpu = host_cuda if cuda is None else cuda
    native = host_native if cpuinfo is None else cpu_has_native_bf16(cpuinfo)
    return "bfloat16" if on_gpu or native else "float32"
