"""SGLang's ``launch_server`` names that are not ``EngineConfig`` fields: sizes written
``4k`` / ``32k`` / ``1M``, the flags that mean something here, and the flags accepted and
ignored (each logged once, with the reason) so that an SGLang command line starts as is.

``add_sglang_flags`` adds them to the parser; ``apply_sglang_flags`` turns the parsed values
into ``EngineConfig`` keywords and server settings, and logs what it ignores.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KV_CACHE_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_SIZE = re.compile(r"^(-?\d+(?:\.\d+)?)([kKmMgG]?)$")
_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "K": 2**10,
    "m": 10**6,
    "M": 2**20,
    "g": 10**9,
    "G": 2**30,
}

# flag -> (takes a value, why it has no effect here)
IGNORED_FLAGS: dict[str, tuple[bool, str]] = {
    "--trust-remote-code": (False, "models are implemented here; no remote code runs"),
    "--disable-cuda-graph": (
        False,
        "XLA compiles each batch shape up front; there are no CUDA graphs to capture",
    ),
    "--cuda-graph-max-bs": (True, "every batch shape is compiled up front (no CUDA graphs)"),
    "--cuda-graph-bs": (True, "every batch shape is compiled up front (no CUDA graphs)"),
    "--enable-metrics": (False, "Prometheus metrics are always served at /metrics"),
    "--enable-cache-report": (False, "cached_tokens is always reported in usage"),
    "--attention-backend": (True, "attention runs on XLA or Pallas (--kernel-backend)"),
    "--linear-attn-backend": (True, "the recurrent layers run on --kernel-backend"),
    "--sampling-backend": (True, "sampling runs on the device inside the step program"),
    "--disable-custom-all-reduce": (False, "collectives are XLA's"),
    "--enable-torch-compile": (False, "there is no torch in the serving path"),
    "--torch-compile-max-bs": (True, "there is no torch in the serving path"),
    "--enable-mixed-chunk": (False, "prefill and decode run as separate steps"),
    "--show-time-cost": (False, "step times are in /metrics"),
    "--decode-log-interval": (True, "step statistics are in /metrics and /server_info"),
    "--tokenizer-mode": (True, "the model folder's fast tokenizer (tokenizer.json) is used"),
    "--skip-tokenizer-init": (False, "the tokenizer is needed for text prompts and grammars"),
    "--device": (True, "JAX picks the accelerator it finds (JAX_PLATFORMS overrides)"),
    "--base-gpu-id": (True, "the process's first tp-size devices are used"),
    "--nccl-port": (True, "devices communicate through XLA collectives"),
    "--dist-timeout": (True, "jax.distributed's own heartbeat applies"),
    "--enable-p2p-check": (False, "devices communicate through XLA collectives"),
    "--allow-auto-truncate": (False, "over-long prompts are refused with a 400"),
    "--enable-mixed-precision": (False, "weights and activations share --dtype"),
    "--hicache-io-backend": (True, "the host tier copies with JAX's own transfers"),
    "--hicache-mem-layout": (True, "the host pools keep the device pools' layout"),
    "--hicache-storage-backend": (True, "there is no storage tier below the host tier"),
}


def size(text: str) -> int:
    """An integer, or one with a suffix as vLLM's ``--max-model-len`` takes: ``k`` / ``m`` /
    ``g`` are powers of 1000, ``K`` / ``M`` / ``G`` of 1024 (``32k`` = 32000, ``1M`` =
    1048576, ``25.6k`` = 25600). ValueError naming ``text`` otherwise."""
    match = _SIZE.match(str(text).strip())
    if match is None:
        raise ValueError(f"size {text!r} must be an integer, optionally with k, K, m, M, g or G")
    number, unit = match.groups()
    value = float(number) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"size {text!r} is not a whole number")
    return int(value)


size.__name__ = "size"  # argparse names the type in "invalid size value: ..."


@dataclass(frozen=True)
class SglangFlags:
    """The values of the SGLang flags that act here (None: not given)."""

    mem_fraction_static: float | None = None
    mamba_full_memory_ratio: float = 0.9
    stream_interval: int = 1
    watchdog_timeout: float | None = None


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's names that are not EngineConfig fields (see the module docstring)."""
    group = parser.add_argument_group("SGLang compatibility")
    group.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="Fraction of the device's memory (what its allocator may use: on a GPU, "
        "XLA_PYTHON_CLIENT_MEM_FRACTION of the card) for the weights and the KV and state "
        "pools; the pools take what the weights leave, and a pool sized by "
        "--max-total-tokens or --max-mamba-cache-size keeps that size. Default: 0.85 on "
        "accelerators; on CPU the pools keep their fixed defaults unless this is given.",
    )
    group.add_argument(
        "--mamba-full-memory-ratio",
        type=float,
        default=0.9,
        help="With --mem-fraction-static: state-pool bytes / KV-pool bytes. (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtype: auto (= --dtype), float32 or bfloat16 (bf16); must match "
        "--dtype, in which the KV cache is kept. (default: %(default)s)",
    )
    group.add_argument(
        "--tokenizer-path",
        default=None,
        help="Tokenizer folder; must hold the model folder's tokenizer.json (the engine "
        "reads the model folder's).",
    )
    group.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="Output tokens per streamed chunk (the last chunk may hold fewer). "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--watchdog-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="If one engine step runs longer than this, log an error and answer /health "
        "with 503 until it returns. Default: no watchdog.",
    )
    for flag, (takes_value, reason) in IGNORED_FLAGS.items():
        kwargs: dict[str, Any] = {"default": None, "help": f"Ignored: {reason}."}
        if not takes_value:
            kwargs["action"] = "store_true"
        group.add_argument(flag, dest=_ignored_dest(flag), **kwargs)


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag.lstrip("-").replace("-", "_")


def apply_sglang_flags(args: argparse.Namespace, kwargs: dict[str, Any]) -> SglangFlags:
    """Fold the SGLang flags into ``kwargs`` (EngineConfig keywords; mutated) and return the
    server-side ones; ValueError naming the flag and value that cannot apply. Logs one line
    per ignored flag that was given."""
    for flag, (_, reason) in IGNORED_FLAGS.items():
        if getattr(args, _ignored_dest(flag), None) not in (None, False):
            logger.warning("%s is ignored: %s", flag, reason)
    _apply_kv_cache_dtype(args.kv_cache_dtype, kwargs)
    if args.max_prefill_tokens is not None:
        _apply_max_prefill_tokens(args.max_prefill_tokens, kwargs)
    if args.tokenizer_path is not None:
        _check_tokenizer_path(args.tokenizer_path, kwargs.get("model_path"))
    fraction = args.mem_fraction_static
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"--mem-fraction-static={fraction} must be in (0, 1)")
    ratio = args.mamba_full_memory_ratio
    if not 0 < ratio < math.inf:
        raise ValueError(f"--mamba-full-memory-ratio={ratio} must be positive")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval={args.stream_interval} must be >= 1")
    if args.watchdog_timeout is not None and not args.watchdog_timeout > 0:
        raise ValueError(f"--watchdog-timeout={args.watchdog_timeout} must be > 0")
    return SglangFlags(fraction, ratio, args.stream_interval, args.watchdog_timeout)


def _apply_kv_cache_dtype(value: str, kwargs: dict[str, Any]) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype={value!r} is not supported; one of {sorted(KV_CACHE_DTYPES)}"
        )
    wanted = KV_CACHE_DTYPES[value]
    dtype = kwargs.get("dtype", "float32")
    if wanted is not None and wanted != dtype:
        raise ValueError(
            f"--kv-cache-dtype={value} differs from --dtype={dtype}: the KV cache is kept in "
            f"the model dtype; pass --dtype {wanted} or --kv-cache-dtype auto"
        )


def _apply_max_prefill_tokens(value: int, kwargs: dict[str, Any]) -> None:
    from lazyspec.config import EngineConfig

    chunk = kwargs.get("mamba_chunk_size", EngineConfig.mamba_chunk_size)
    page = kwargs.get("page_size", EngineConfig.page_size)
    grid = math.lcm(chunk, page)
    if value < grid:
        raise ValueError(
            f"--max-prefill-tokens={value} is less than one prefill chunk ({grid} tokens: "
            "mamba-chunk-size and page-size)"
        )
    current = kwargs.get("chunked_prefill_size", EngineConfig.chunked_prefill_size)
    kwargs["chunked_prefill_size"] = min(current, value // grid * grid)


def _check_tokenizer_path(path: str, model_path: str | None) -> None:
    given = Path(path)
    given = given / "tokenizer.json" if given.is_dir() else given
    ours = Path(model_path or "") / "tokenizer.json"
    if not given.is_file():
        raise ValueError(f"--tokenizer-path={path}: no tokenizer.json there")
    if not ours.is_file() or given.read_bytes() != ours.read_bytes():
        raise ValueError(
            f"--tokenizer-path={path} differs from the model folder's tokenizer.json; the "
            "engine reads the model folder's: copy the tokenizer there"
        )
