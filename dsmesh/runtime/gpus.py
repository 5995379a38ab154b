"""The GPUs of this host and their memory, read without creating a CUDA context.

``dsmesh up`` plans every engine process's memory before it starts one
(dsmesh/cli/memory_plan.py). It reads each GPU's total memory through ``nvidia-smi``, which
costs a fraction of a second and no device memory; a CUDA context in the supervisor would
hold half a GiB of every GPU for the mesh's lifetime. Without ``nvidia-smi`` a short child
process asks torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

MIB = 1 << 20
_TORCH_PROBE = (
    "import json, torch\n"
    "print(json.dumps([torch.cuda.get_device_properties(i).total_memory "
    "for i in range(torch.cuda.device_count())]))"
)


def parse_nvidia_smi(text: str) -> dict[str, int]:
    """``index, uuid, memory.total [MiB]`` lines -> bytes by index and by UUID."""
    out: dict[str, int] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].isdigit():
            continue
        index, uuid, mib = parts
        out[index] = out[uuid] = int(mib) * MIB
    return out


def gpu_memory(gpu_ids: Sequence[str]) -> dict[str, int]:
    """Total memory in bytes of each of ``gpu_ids`` (``CUDA_VISIBLE_DEVICES`` entries:
    indices or UUIDs, as the supervisor lists them). Raises RuntimeError when unknown."""
    if not gpu_ids:
        return {}
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        proc = subprocess.run(
            [smi, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode == 0:
            known = parse_nvidia_smi(proc.stdout)
            if all(g in known for g in gpu_ids):
                return {g: known[g] for g in gpu_ids}
    return _torch_probe(gpu_ids)


def _torch_probe(gpu_ids: Sequence[str]) -> dict[str, int]:
    """Ask torch in a child that sees the GPUs in ``gpu_ids`` order."""
    env_ids = ",".join(gpu_ids)
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": env_ids},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cannot read the GPUs' memory: {proc.stderr.strip()[-300:]}")
    totals = json.loads(proc.stdout.strip().splitlines()[-1])
    if len(totals) < len(gpu_ids):
        raise RuntimeError(f"torch sees {len(totals)} of the GPUs {env_ids}")
    return dict(zip(gpu_ids, totals, strict=False))


def host_memory_available() -> int:
    """Bytes of memory the host can still give (``MemAvailable``), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
