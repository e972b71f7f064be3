"""The device kinds the kernel tuning tables are keyed by: which kind a device is, and an
op's table filled from the few records it was measured with. Jax-free."""

from __future__ import annotations

from typing import TypeVar

DEVICE_KINDS = ("h100", "h200", "tpu_v5e", "tpu_v6e", "cpu")

Record = TypeVar("Record")


def device_kind_key(platform: str, device_kind: str = "") -> str:
    """The table key of a device: ``platform`` is JAX's ("cpu", "gpu"/"cuda"/"rocm", "tpu"),
    ``device_kind`` its ``Device.device_kind`` string. A GPU other than an H200 takes the
    H100's tuning (the tiles were measured on those two), a TPU other than v6e the v5e's."""
    kind = device_kind.lower()
    if platform == "tpu":
        return "tpu_v6e" if "v6" in kind else "tpu_v5e"
    if platform in ("gpu", "cuda", "rocm"):
        return "h200" if "h200" in kind else "h100"
    return "cpu"


def device_table(
    gpu: Record,
    *,
    tpu: Record | None = None,
    tpu_v6e: Record | None = None,
    cpu: Record | None = None,
) -> dict[str, Record]:
    """An op's record for every kind of ``DEVICE_KINDS``: ``gpu`` on both GPUs, ``tpu`` on
    both TPUs unless ``tpu_v6e`` names the v6e's, ``cpu`` on the CPU; a kind given none takes
    the GPU's (the CPU's interpret mode then runs the GPU's dispatch, so the suite runs the
    GPU's paths). Pure."""
    tpu_v5e = gpu if tpu is None else tpu
    return {
        "h100": gpu,
        "h200": gpu,
        "tpu_v5e": tpu_v5e,
        "tpu_v6e": tpu_v5e if tpu_v6e is None else tpu_v6e,
        "cpu": gpu if cpu is None else cpu,
    }
