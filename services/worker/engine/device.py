"""Device and dtype choice: CUDA -> MPS -> CPU unless the config names one."""

from __future__ import annotations

import os

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    name = (name or "auto").lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name not in ("cpu", "cuda", "mps") and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r}; expected auto, cpu, cuda or mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    name = (name or "auto").lower()
    if name == "auto":
        # float32 keeps CPU results bit-comparable with the reference model; bfloat16 is the GPU norm.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_device_memory(device: torch.device) -> int:
    """Bytes free for new tensors: the GPU's free memory on CUDA, the host's
    available memory (what can be allocated without swapping) elsewhere."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_host_memory()


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
