"""Launch the HTTP server: ``python scripts/serve.py --model-path /path/to/hf-folder``.

Flag names follow SGLang's ``launch_server``; one flag per ``EngineConfig`` field (generated
from the dataclass, so a new field gets a flag), plus the server's own flags. Without
``--model-path`` the embedded default model ``lazyspec/assets/default_model`` is served.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from lazyspec.config import DTYPES, KERNEL_BACKENDS, SPEC_ALGORITHMS, STRATEGY_CHOICES, EngineConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default_model"
ALIASES = {"mamba_scheduler_strategy": ["--mamba-radix-cache-strategy"]}
SKIPPED_FIELDS = {"mamba_radix_cache_strategy"}  # an alias, exposed through ALIASES
CHOICES = {
    "dtype": DTYPES,
    "mamba_ssm_dtype": DTYPES,
    "mamba_scheduler_strategy": STRATEGY_CHOICES,
    "speculative_algorithm": tuple(a for a in SPEC_ALGORITHMS if a is not None),
    "kernel_backend": tuple(b for b in KERNEL_BACKENDS if b is not None),
}
HELP = {
    "model_path": "Hugging Face model folder (config.json, *.safetensors, tokenizer.json). "
    "Default: the embedded model in lazyspec/assets/default_model.",
    "dtype": "Weight and activation dtype.",
    "page_size": "Tokens per KV page.",
    "max_running_requests": "Cap on requests in the running batch (also capped by state slots).",
    "max_total_tokens": "KV cache capacity in tokens (rounded up to whole pages).",
    "max_mamba_cache_size": "Recurrent-state slots (running requests + cached checkpoints); "
    "default: sized from max-running-requests.",
    "mamba_scheduler_strategy": "Checkpoint strategy: no_buffer, extra_buffer, "
    "extra_buffer_lazy, or auto (= extra_buffer).",
    "mamba_track_interval": "Tokens between recurrent-state checkpoints (a multiple of "
    "page-size and mamba-chunk-size).",
    "mamba_ssm_dtype": "dtype of the recurrent (ssm) state pool.",
    "mamba_chunk_size": "Chunk length of the chunked prefill scan.",
    "chunked_prefill_size": "Most prompt tokens one request prefills per step.",
    "context_length": "Longest sequence (prompt + output); default: the model's, capped by "
    "max-total-tokens.",
    "disable_overlap_schedule": "Process each step before planning the next (no look-ahead).",
    "disable_radix_cache": "Turn the prefix cache off.",
    "random_seed": "Engine random seed.",
    "speculative_algorithm": "Speculative decoding with the model's MTP head (NEXTN or MTP).",
    "speculative_num_steps": "Draft tokens per step (default 3 when speculation is on).",
    "speculative_eagle_topk": "Draft branching; only 1 (chain drafting) is supported.",
    "speculative_num_draft_tokens": "Verify positions per step; must be num-steps + 1.",
    "kernel_backend": "Recurrent-state kernels: pallas or xla (default: pallas on GPU, xla "
    "on CPU and TPU; pallas on TPU is untested).",
    "skip_warmup": "Do not compile every batch shape at start-up (first requests compile).",
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
        convert = int if kind.startswith("int") else str
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
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="Largest request body; larger ones are answered 413 unread (default: %(default)s).",
    )
    server.add_argument(
        "--allowed-hosts",
        default=None,
        help="Host header names accepted besides localhost, 127.0.0.1 and [::1] (comma "
        "list, * = any); others get 400. Default: only those three when --host is a "
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
    server.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    server.add_argument("--port", type=int, default=30000, help="Port to bind.")
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
        "answered 503. Negative: unbounded.",
    )
    server.add_argument(
        "--chat-template", default=None, help="A jinja2 chat template file overriding the model's."
    )
    _add_security_flags(server)
    server.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="Logging level.",
    )
    _add_engine_flags(parser)
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


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kwargs = engine_kwargs(args)
    try:
        kwargs["model_path"] = resolve_model_path(args.model_path)
        EngineConfig(**kwargs)
    except ValueError as exc:
        parser.error(str(exc))
    import uvicorn

    from lazyspec.engine.engine import Engine
    from lazyspec.server.app import ServerSettings, create_app
    from lazyspec.server.guard import split_list
    from lazyspec.server.protocol import ChatTemplate
    from lazyspec.server.worker import EngineWorker

    warm = "" if kwargs.get("skip_warmup") else " and compiling every batch shape"
    print(f"loading {kwargs['model_path']}{warm} ...", flush=True)
    try:
        engine = Engine(**kwargs)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    print("memory plan:", flush=True)
    for key, value in engine.memory_plan.items():
        print(f"  {key}: {value}", flush=True)
    template = (
        ChatTemplate(Path(args.chat_template).read_text())
        if args.chat_template
        else ChatTemplate.from_folder(kwargs["model_path"])
    )
    settings = ServerSettings(
        served_model_name=args.served_model_name or Path(kwargs["model_path"]).name,
        max_queued_requests=None if args.max_queued_requests < 0 else args.max_queued_requests,
        chat_template=template,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        allowed_origins=split_list(args.allowed_origins),
    )
    worker = EngineWorker(engine).start()
    server = _announcing_server(
        uvicorn.Config(
            create_app(worker, settings), host=args.host, port=args.port, log_level=args.log_level
        )
    )
    try:
        server.run()
    finally:
        worker.stop()


def _announcing_server(config: Any) -> Any:
    """A uvicorn server that prints the URL once it accepts connections."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                print(
                    f"ready: http://{config.host}:{config.port} "
                    "(OpenAI API under /v1, SGLang API at /generate)",
                    flush=True,
                )

    return Server(config)


if __name__ == "__main__":
    main()
