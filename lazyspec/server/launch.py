"""Launch the HTTP server: ``python scripts/serve.py --model-path /path/to/hf-folder``.

Flag names follow SGLang's ``launch_server``; one flag per ``EngineConfig`` field (generated
from the dataclass, so a new field gets a flag), plus the server's own flags. Without
``--model-path`` the embedded default model ``lazyspec/assets/default_model`` is served.
The server listens at once and answers 503 until the engine is built and warmed
(``lifecycle``); SIGTERM / SIGINT drain it (``--graceful-shutdown-timeout``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from lazyspec.cache.host_tier import WRITE_POLICIES
from lazyspec.config import (
    DTYPES,
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    MOE_RUNNER_BACKENDS,
    SCHEDULE_POLICIES,
    SPEC_ALGORITHMS,
    STRATEGY_CHOICES,
    EngineConfig,
)
from lazyspec.scheduler.grammar import GRAMMAR_BACKENDS
from lazyspec.server.flags import (
    LOG_LEVELS,
    SglangFlags,
    add_sglang_flags,
    apply_sglang_flags,
    size,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default_model"
SHUTDOWN_CLOSE_S = 15  # uvicorn's own wait for connections after the drain
ALIASES = {
    "mamba_scheduler_strategy": ["--mamba-radix-cache-strategy"],
    "skip_warmup": ["--skip-server-warmup"],
    "tp_size": ["--tensor-parallel-size"],
}
SKIPPED_FIELDS = {"mamba_radix_cache_strategy"}  # an alias, exposed through ALIASES
CHOICES = {
    "dtype": DTYPES,
    "mamba_ssm_dtype": DTYPES,
    "mamba_scheduler_strategy": STRATEGY_CHOICES,
    "speculative_algorithm": tuple(a for a in SPEC_ALGORITHMS if a is not None),
    "kernel_backend": tuple(b for b in KERNEL_BACKENDS if b is not None),
    "moe_runner_backend": MOE_RUNNER_BACKENDS,
    "load_format": LOAD_FORMATS,
    "schedule_policy": SCHEDULE_POLICIES,
    "grammar_backend": GRAMMAR_BACKENDS,
    "decode_program_copies": (1, 2),
    "hicache_write_policy": WRITE_POLICIES,
}
HELP = {
    "model_path": "Hugging Face model folder (config.json, *.safetensors, tokenizer.json). "
    "Default: the embedded model in lazyspec/assets/default_model.",
    "dtype": "Weight and activation dtype.",
    "page_size": "Tokens per KV page. 16 halves the scheduler's host time per decode step "
    "(pages grow once per page) but matches prefixes in whole pages; no_buffer needs 1.",
    "max_running_requests": "Cap on requests in the running batch (also capped by state slots). "
    "Default: 128 where the pools are sized from device memory, else 16.",
    "max_total_tokens": "KV cache capacity in tokens (rounded up to whole pages).",
    "max_mamba_cache_size": "Recurrent-state slots (running requests + cached checkpoints); "
    "default: sized from max-running-requests.",
    "mamba_scheduler_strategy": "Checkpoint strategy: no_buffer, extra_buffer, "
    "extra_buffer_lazy, or auto (= extra_buffer).",
    "mamba_track_interval": "Tokens between decode-time recurrent-state checkpoints (a "
    "multiple of page-size and mamba-chunk-size); prefill checkpoints sit on the grid "
    "lcm(mamba-chunk-size, page-size) of each chunk.",
    "mamba_cache_policy": "Which cached checkpoint gives up its slot: value (superseded "
    "first, then prefill tokens saved x recency; a running request's is declined) or sglang (LRU).",
    "mamba_ssm_dtype": "dtype of the recurrent (ssm) state pool.",
    "mamba_chunk_size": "Chunk length of the chunked prefill scan.",
    "enable_hierarchical_cache": "Keep a host tier under the radix cache (SGLang's HiCache): "
    "recurrent checkpoints and KV pages the device evicts are copied to host memory and "
    "loaded back into fresh device slots and pages when a request matches them.",
    "hicache_ratio": "Host pools (state slots and KV pages) as a multiple of the device pools.",
    "hicache_size": "GB (10^9 bytes) of host memory for the host tier, split between "
    "slots and pages as on the device; > 0 overrides --hicache-ratio.",
    "hicache_write_policy": "When the host tier gets a copy: write_through (when the radix "
    "cache receives it), write_through_selective (once hit twice) or write_back (when the "
    "device evicts it).",
    "chunked_prefill_size": "Most prompt tokens one request prefills per step.",
    "max_prefill_tokens": "Most prompt tokens (rows x tokens) one prefill step takes; caps "
    "--chunked-prefill-size (rounded down to whole --mamba-chunk-size chunks). Default: 8192 "
    "on an accelerator, 4 chunks on CPU.",
    "context_length": "KV rows per request; the longest request (prompt + max new tokens, "
    "max_request_len in the memory plan) is this less a few tokens of headroom; default: "
    "the model's, capped by max-total-tokens.",
    "disable_overlap_schedule": "Process each step before planning the next (no look-ahead).",
    "disable_radix_cache": "Turn the prefix cache off.",
    "random_seed": "Engine random seed.",
    "speculative_algorithm": "Speculative decoding with the model's MTP head (NEXTN or MTP).",
    "speculative_num_steps": "Draft tokens per step (default 3 when speculation is on).",
    "speculative_eagle_topk": "Draft branching; only 1 (chain drafting) is supported.",
    "speculative_num_draft_tokens": "Verify positions per step; must be num-steps + 1.",
    "speculative_token_map": "File of 'hot' token ids the draft head scores (the others are "
    "never drafted; verify still scores the whole vocabulary, so outputs are unchanged): a "
    ".json list of ints, a .npy 1-D integer array, or text with one id per line. The EOS "
    "ids are always added and the list is padded to a multiple of 128 columns. Needs "
    "--speculative-algorithm; scripts/build_token_map.py writes one from a corpus.",
    "speculative_disable_by_batch_size": "Decode steps over more running requests than this "
    "take one token per request without drafting (outputs stay exact; the draft head's KV "
    "still follows every token, so speculation resumes when the batch shrinks). Speculation "
    "costs a verify of D tokens and D - 1 draft steps per step: at large batches it loses "
    "(BENCHMARKS.md, 'Speculation by batch size'). Default: always speculate.",
    "num_continuous_decode_steps": "Decode steps one device program runs back to back "
    "(without speculation): the host plans, launches and reads back once per this many "
    "tokens of each request, which helps where the host's work per step outlasts the "
    "device's (small batches). Outputs are the same; a request ending inside a run has its "
    "extra tokens dropped, and a waiting request is admitted up to this many tokens later. "
    "Default: 2 on a GPU without speculation, else 1.",
    "kernel_tuning": "Kernel tuning overrides over the device's table, NAME=VALUE "
    "comma-separated (e.g. moe.pair_grid=false; names in kernels/<op>/tuning.py).",
    "kernel_backend": "Recurrent-state kernels: pallas or xla (default: pallas on GPU, xla "
    "on CPU and TPU; pallas on TPU is untested).",
    "moe_runner_backend": "Routed experts with kernel-backend pallas: pallas (the grouped "
    "matmul over routed experts), xla (the sort + ragged_dot dispatch) or auto (= pallas on "
    "GPU and in interpret mode on CPU; xla on TPU, where the kernel has not run).",
    "load_format": "auto: read the safetensors (each device reads only its slices); dummy: "
    "random weights drawn directly on the devices (benchmarks; the folder's config.json "
    "and tokenizer are still read).",
    "tp_size": "Tensor-parallel size: devices of the mesh the weights and pools are sharded "
    "over (attention / GDN / Mamba2 by heads, MLPs by width, experts by expert, embedding "
    "and lm_head by vocabulary).",
    "nnodes": "Processes (hosts) the tensor-parallel mesh spans; each runs serve.py with "
    "the same flags and its own --node-rank and holds tp-size / nnodes devices.",
    "node_rank": "This process's rank among --nnodes: 0 runs the scheduler and the HTTP "
    "server, the others follow its device calls.",
    "dist_init_addr": "host:port of the jax.distributed coordinator (node-rank 0 listens "
    "there); needed with --nnodes > 1.",
    "skip_warmup": "Do not compile every batch shape at start-up (first requests compile).",
    "decode_program_copies": "Compiled copies of the decode program, called in turn (1 or "
    "2; default 2 on GPU, 1 elsewhere). On a GPU a program runs as CUDA graphs that XLA "
    "re-records when a buffer it touches has moved since its last call; a step's words (which "
    "its outputs overwrite) are allocated while the last step's are still held, so their "
    "address alternates from step to step, and each of two copies sees the addresses of its "
    "own last call (BENCHMARKS.md, "
    "'The decode step's outputs in one buffer'). Costs one more compile per decode shape.",
    "compile_threads": "Threads compiling the program table at start-up (default: 2 on a GPU, "
    "else the CPU count, at most 8); they trace one program at a time and compile side by side.",
    "schedule_conservativeness": "Admission's estimate of the new tokens running requests "
    "still produce, as a factor (higher admits fewer; a decode step short of KV retracts "
    "the requests with the least progress).",
    "schedule_policy": "Admission order of waiting requests: fcfs (arrival) or lpm (longest "
    "cached prefix first, SGLang's rule; a queue over 128 requests is taken in arrival "
    "order).",
    "grammar_backend": "Structured-output backend (json_schema, regex, ebnf, "
    "response_format): llguidance, xgrammar (pip install '.[xgrammar]': torch, "
    "transformers, triton) or none, which refuses grammar requests with a 400.",
    "debug_fail_spare_alloc": "Fault injection: every lazy spare-slot allocation fails.",
    "debug_lazy_evict_on_failure": "Experiment: evict cached checkpoints when a lazy spare "
    "allocation fails.",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIPPED_FIELDS:
            continue
        kind = str(f.type).replace(" ", "")
        text = HELP.get(f.name, f"EngineConfig.{f.name}")
        names = [_flag(f.name), *ALIASES.get(f.name, [])]
        if kind == "bool":
            group.add_argument(*names, dest=f.name, action="store_true", default=None, help=text)
            continue
        convert = size if kind.startswith("int") else float if kind == "float" else str
        default = f"(default: {f.default})" if f.default is not None else ""
        group.add_argument(
            *names,
            dest=f.name,
            type=convert,
            default=None,
            choices=CHOICES.get(f.name),
            help=f"{text} {default}".strip(),
        )


def _add_security_flags(server: argparse._ArgumentGroup) -> None:
    from lazyspec.server.guard import DEFAULT_MAX_REQUEST_BYTES

    server.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: none, no key needed).",
    )
    server.add_argument(
        "--max-request-bytes",
        type=size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest request body; larger ones are answered 413, never parsed "
        "(default: %(default)s).",
    )
    server.add_argument(
        "--allowed-hosts",
        default=None,
        help="Host header names accepted besides localhost, 127.0.0.1 and [::1] (comma "
        "list, * = any); others get 400. Default: only those three when bound to a "
        "loopback address, no check otherwise.",
    )
    server.add_argument(
        "--allowed-origins",
        default=None,
        help="Browser origins allowed to call the API cross-origin (CORS; comma list or *). "
        "Default: none, no CORS headers.",
    )


def allowed_hosts(host: str, flag: str | None) -> tuple[str, ...] | None:
    """The Host names the server answers (None: any): the loopback names plus ``flag``'s
    list; without ``flag``, no check unless bound to a loopback ``host``."""
    from lazyspec.server.guard import LOOPBACK_HOSTS, is_loopback, split_list

    names = split_list(flag)
    if "*" in names or (flag is None and not is_loopback(host)):
        return None
    return LOOPBACK_HOSTS + names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/serve.py",
        description="OpenAI- and SGLang-compatible HTTP server for hybrid LLMs.",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="Address to bind (default: %(default)s)."
    )
    server.add_argument(
        "--port", type=int, default=30000, help="Port to bind (default: %(default)s)."
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        help="Model name in /v1/models and in requests (default: the model folder's name).",
    )
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="Requests allowed to wait beyond the running batch; more are "
        "answered 503. Negative: unbounded. (default: %(default)s)",
    )
    server.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="On SIGTERM / SIGINT: stop admitting (503) and let live requests run this long, "
        "then abort the rest with an error event; a second signal aborts at once. "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--compilation-cache-dir",
        default=None,
        metavar="DIR",
        help="JAX persistent compilation cache, and the compiled programs stored beside it: "
        "a restart loads them from here instead of compiling them again; 'none' turns both "
        "off. "
        "(default: $XDG_CACHE_HOME/lazyspec/jax or ~/.cache/lazyspec/jax)",
    )
    server.add_argument(
        "--chat-template", default=None, help="A jinja2 chat template file overriding the model's."
    )
    _add_security_flags(server)
    server.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=LOG_LEVELS,
        help="Logging level. (default: %(default)s)",
    )
    _add_engine_flags(parser)
    add_sglang_flags(parser)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (others keep their defaults)."""
    names = {f.name for f in dataclasses.fields(EngineConfig)} - SKIPPED_FIELDS
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def resolve_model_path(given: str | None, default: Path = DEFAULT_MODEL) -> str:
    """``given``, else the embedded default model; ValueError saying what to pass."""
    if given is not None:
        return given
    if (default / "config.json").is_file():
        return str(default)
    raise ValueError(
        f"no --model-path given and the embedded default model is not present at {default}; "
        "pass --model-path /path/to/hf-model-folder (config.json, *.safetensors, tokenizer.json)"
    )


def resolve_engine_kwargs(
    args: argparse.Namespace,
) -> tuple[dict[str, Any], SglangFlags, EngineConfig]:
    """The engine keywords of the parsed command line, as the server builds its engine from
    them (the model path resolved, SGLang's flags applied), with the SGLang flags' values
    and the resolved config; ValueError naming a bad value. The keywords carry the resolved
    checkpoint strategy: building the engine from them does not resolve (nor log) again."""
    kwargs = engine_kwargs(args)
    kwargs["model_path"] = resolve_model_path(args.model_path)
    sglang = apply_sglang_flags(args, kwargs)
    config = EngineConfig(**kwargs)
    kwargs.update(mamba_scheduler_strategy=config.mamba_scheduler_strategy)
    return kwargs, sglang, config


def main(argv: list[str] | None = None) -> None:
    """Listen at once (503 while starting), build the engine in a thread, then serve; on
    SIGTERM / SIGINT drain gracefully and exit 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        kwargs, sglang, config = resolve_engine_kwargs(args)
    except ValueError as exc:
        parser.error(str(exc))
    import uvicorn

    from lazyspec.server.lifecycle import (
        EngineStartup,
        GracefulServer,
        StartingApp,
        enable_compilation_cache,
    )

    cache = enable_compilation_cache(args.compilation_cache_dir)
    logger.info("compilation cache: %s", cache or "off")

    def size_pools(engine_kwargs: dict[str, Any]) -> None:
        from lazyspec.engine import multihost
        from lazyspec.server.pools import apply_pool_plan

        multihost.initialize(config)  # before the device's memory is read
        apply_pool_plan(engine_kwargs, sglang.mem_fraction_static, sglang.mamba_full_memory_ratio)

    if not config.is_leader:
        size_pools(kwargs)  # every process plans alike (the same devices are assumed)
        _follow(kwargs)
        return
    settings = _server_settings(args, kwargs["model_path"], sglang)
    holder = StartingApp()
    server = GracefulServer(
        uvicorn.Config(
            holder,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_CLOSE_S,
        ),
        holder,
        args.graceful_shutdown_timeout,
    )
    url = f"http://{args.host}:{args.port}"
    startup = EngineStartup(kwargs, settings, holder, server, url, size_pools)
    server.on_started = startup.start
    server.on_cancel = startup.bar.cancel
    try:
        server.run()
    finally:
        startup.finish()
    if startup.error is not None:
        sys.exit(f"error: {startup.error}")


def _follow(kwargs: dict[str, Any]) -> None:
    """node_rank > 0: build the engine's share of the mesh, then make process 0's device
    calls until its engine shuts down; no HTTP server."""
    from lazyspec.engine.engine import Engine

    engine = Engine(**kwargs)
    logger.info("node_rank=%d follows process 0", engine.config.node_rank)
    num_calls = engine.follow()
    logger.info("process 0 shut down after %d device calls", num_calls)


def _server_settings(args: argparse.Namespace, model_path: str, sglang: SglangFlags) -> Any:
    from lazyspec.server.app import ServerSettings
    from lazyspec.server.chat import ChatTemplate
    from lazyspec.server.guard import split_list

    template = (
        ChatTemplate(Path(args.chat_template).read_text())
        if args.chat_template
        else ChatTemplate.from_folder(model_path)
    )
    return ServerSettings(
        served_model_name=args.served_model_name or Path(model_path).name,
        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
        chat_template=template,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        allowed_origins=split_list(args.allowed_origins),
        stream_interval=sglang.stream_interval,
        watchdog_timeout=sglang.watchdog_timeout,
    )


if __name__ == "__main__":
    main()
