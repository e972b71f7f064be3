"""EngineConfig: every engine / server flag, validated in one place.

Flag names follow SGLang's ``ServerArgs`` so its users find what they know.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

from lazyspec.cache.host_tier import WRITE_POLICIES, WRITE_THROUGH
from lazyspec.cache.radix_cache import EVICTION_POLICIES
from lazyspec.kernels.tuning import parse_overrides
from lazyspec.scheduler.grammar import GRAMMAR_BACKENDS
from lazyspec.scheduler.layout import default_prefill_tokens
from lazyspec.scheduler.strategy import EXTRA_BUFFER, NONE, STRATEGIES, Strategy
from lazyspec.token_map import read_token_map

logger = logging.getLogger(__name__)

STRATEGY_CHOICES = ("auto", *(name for name in STRATEGIES if name != NONE.name))
DTYPES = ("float32", "bfloat16")
SPEC_ALGORITHMS = (None, "NEXTN", "MTP")
KERNEL_BACKENDS = (None, "xla", "pallas")
MOE_RUNNER_BACKENDS = ("auto", "xla", "pallas")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")


# (setting, the setting it must be a multiple of, why) checked by EngineConfig
_MULTIPLES = (
    ("mamba_track_interval", "page_size", ""),
    ("mamba_track_interval", "mamba_chunk_size", " (prefill checkpoints are chunk states)"),
    ("chunked_prefill_size", "page_size", " (prefill checkpoints are whole pages)"),
    ("chunked_prefill_size", "mamba_chunk_size", ""),
)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None
    dtype: str = "float32"
    page_size: int = 1
    max_running_requests: int | None = None
    max_total_tokens: int = 16384  # KV token capacity (rounded up to whole pages)
    max_mamba_cache_size: int | None = None  # state slots; None = sized from max_running_requests
    mamba_scheduler_strategy: str = "auto"
    mamba_track_interval: int = 256
    mamba_ssm_dtype: str = "float32"
    mamba_chunk_size: int = 64
    # which cached checkpoint gives up its slot (cache/checkpoint_value.py): "value" (prefill
    # tokens saved x likelihood of a hit; superseded checkpoints first; a running request's
    # checkpoint is declined rather than evicting one worth more) or "sglang" (LRU; SGLang's);
    # the host tier evicts its copies in the same order
    mamba_cache_policy: str = "value"
    # the radix cache's host tier (SGLang's HiCache flags; cache/host_tier.py): checkpoints
    # and KV pages the device evicts stay on the host and are loaded back on a match
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pools as a multiple of the device pools
    hicache_size: float = 0.0  # GB of host memory for the host pools; > 0 overrides the ratio
    hicache_write_policy: str = WRITE_THROUGH  # or write_back, write_through_selective
    chunked_prefill_size: int = 512
    # prompt tokens (rows x tokens) one extend step prefills at most (SGLang's flag); None:
    # ``default_prefill_tokens`` for the engine's platform. One chunk always fits.
    max_prefill_tokens: int | None = None
    context_length: int | None = None
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    random_seed: int = 0
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    # a file of "hot" token ids the draft head scores (lazyspec/token_map.py); None: all
    speculative_token_map: str | None = None
    # decode batches of more than this many requests run without speculation (one token per
    # request, no draft chain); None: every decode batch speculates
    speculative_disable_by_batch_size: int | None = None
    # decode steps one program runs back to back (SGLang's flag): the host plans and launches
    # once per K tokens of each request; without speculation only
    # None: ``default_decode_steps`` for the engine's platform
    num_continuous_decode_steps: int | None = None
    kernel_backend: str | None = None
    moe_runner_backend: str = "auto"
    # kernel tuning overrides over the device's table (lazyspec/kernels/tuning.py), e.g.
    # "moe.pair_grid=false,attention.combine_block=0"; "": the table's values
    kernel_tuning: str = ""
    load_format: str = "auto"  # "dummy": random weights, no tensor read
    tp_size: int = 1  # devices of the tensor-parallel mesh (experts shard over it too)
    nnodes: int = 1  # processes the mesh spans (jax.distributed), tp_size / nnodes devices each
    node_rank: int = 0  # this process's id: 0 runs the scheduler, the others follow it
    dist_init_addr: str | None = None  # host:port of the coordinator (process 0) when nnodes > 1
    skip_warmup: bool = False
    # copies of each decode program, called in turn (1 or 2; None: 2 on GPU, else 1)
    decode_program_copies: int | None = None
    # threads compiling the program table at start-up (None: the platform's default,
    # ``warmup.table_threads``: two on a GPU, else the CPU count, at most 8)
    compile_threads: int | None = None
    # admission's estimate of future KV use (SGLang's flag): higher admits fewer requests
    schedule_conservativeness: float = 1.0
    # admission order of waiting requests (SGLang's): arrival (fcfs) or longest cached
    # prefix first (lpm)
    schedule_policy: str = "fcfs"
    # structured output (lazyspec/scheduler/grammar.py): llguidance, xgrammar (needs the
    # .[xgrammar] extra: torch, transformers, triton) or none (grammar requests refused)
    grammar_backend: str = "llguidance"
    # Fault injection / experiments (tests and benchmarks only).
    debug_fail_spare_alloc: bool = False
    debug_lazy_evict_on_failure: bool = False
    # Alias accepted for SGLang's newer flag name; folded into mamba_scheduler_strategy.
    mamba_radix_cache_strategy: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mamba_radix_cache_strategy is not None:
            object.__setattr__(self, "mamba_scheduler_strategy", self.mamba_radix_cache_strategy)
            object.__setattr__(self, "mamba_radix_cache_strategy", None)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("mamba_ssm_dtype", self.mamba_ssm_dtype, DTYPES)
        _check_choice("mamba_scheduler_strategy", self.mamba_scheduler_strategy, STRATEGY_CHOICES)
        _check_choice("mamba_cache_policy", self.mamba_cache_policy, EVICTION_POLICIES)
        _check_choice("speculative_algorithm", self.speculative_algorithm, SPEC_ALGORITHMS)
        _check_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        _check_choice("moe_runner_backend", self.moe_runner_backend, MOE_RUNNER_BACKENDS)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        parse_overrides(self.kernel_tuning)  # ValueError names a bad item
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("hicache_write_policy", self.hicache_write_policy, WRITE_POLICIES)
        self._check_host_tier()
        _check_choice("grammar_backend", self.grammar_backend, GRAMMAR_BACKENDS)
        for name in (
            "page_size",
            "max_total_tokens",
            "mamba_track_interval",
            "mamba_chunk_size",
            "chunked_prefill_size",
            "tp_size",
            "nnodes",
        ):
            _check_positive(name, getattr(self, name))
        self._check_nodes()
        conservativeness = self.schedule_conservativeness
        if (
            not isinstance(conservativeness, (int, float))
            or isinstance(conservativeness, bool)
            or not 0 < conservativeness < float("inf")
        ):
            raise ValueError(
                f"schedule_conservativeness={conservativeness!r} must be a positive number"
            )
        if self.compile_threads is not None and self.compile_threads < 1:
            raise ValueError(f"compile_threads={self.compile_threads!r} must be at least 1")
        if self.decode_program_copies not in (None, 1, 2):
            raise ValueError(f"decode_program_copies={self.decode_program_copies!r} must be 1 or 2")
        for name in (
            "max_running_requests",
            "max_mamba_cache_size",
            "context_length",
            "num_continuous_decode_steps",
            "max_prefill_tokens",
        ):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        for name, unit, why in _MULTIPLES:
            value, of = getattr(self, name), getattr(self, unit)
            if value % of:
                raise ValueError(f"{name}={value} must be a multiple of {unit}={of}{why}")
        self._resolve_spec()
        self._resolve_strategy()

    def _check_nodes(self) -> None:
        """The process flags: a rank in range, a coordinator, whole devices per process."""
        rank = self.node_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.nnodes:
            raise ValueError(f"node_rank={rank!r} must be in [0, nnodes={self.nnodes})")
        if self.nnodes == 1:
            return
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"tp_size={self.tp_size} is not a multiple of nnodes={self.nnodes} (every "
                "process holds the same number of the mesh's devices)"
            )
        address = self.dist_init_addr
        host, _, port = (address or "").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"dist_init_addr={address!r}: nnodes={self.nnodes} needs the coordinator's "
                "host:port (process 0 listens there)"
            )

    def _check_host_tier(self) -> None:
        ratio, gigabytes = self.hicache_ratio, self.hicache_size
        if not _is_number(ratio) or not 0 < ratio < float("inf"):
            raise ValueError(f"hicache_ratio={ratio!r} must be a positive number")
        if not _is_number(gigabytes) or not 0 <= gigabytes < float("inf"):
            raise ValueError(f"hicache_size={gigabytes!r} must be 0 (use the ratio) or positive")
        if not self.enable_hierarchical_cache:
            return
        if self.disable_radix_cache:
            raise ValueError(
                "enable_hierarchical_cache is set with disable_radix_cache: the host tier "
                "keeps the radix cache's entries"
            )
        if self.nnodes > 1:
            raise ValueError(
                f"enable_hierarchical_cache with nnodes={self.nnodes}: the host tier is kept "
                "by process 0 alone; run it on one process"
            )

    @property
    def is_leader(self) -> bool:
        """True on the process that runs the scheduler (node_rank 0)."""
        return self.node_rank == 0

    # ------------------------------------------------------------------ resolution

    def _resolve_spec(self) -> None:
        if self.speculative_algorithm is not None and self.decode_steps > 1:
            raise ValueError(
                f"num_continuous_decode_steps={self.num_continuous_decode_steps} needs "
                "speculative_algorithm None: a speculative step already takes several "
                "tokens per request"
            )
        if self.speculative_algorithm is None:
            for name in (
                "speculative_num_steps",
                "speculative_num_draft_tokens",
                "speculative_token_map",
                "speculative_disable_by_batch_size",
            ):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but speculative_algorithm is None")
            return
        if self.speculative_token_map is not None:
            read_token_map(self.speculative_token_map)  # the file's own checks, early
        limit = self.speculative_disable_by_batch_size
        if limit is not None:
            _check_positive("speculative_disable_by_batch_size", limit)
        object.__setattr__(self, "speculative_algorithm", "NEXTN")
        steps = self.speculative_num_steps if self.speculative_num_steps is not None else 3
        _check_positive("speculative_num_steps", steps)
        topk = self.speculative_eagle_topk if self.speculative_eagle_topk is not None else 1
        if topk != 1:
            raise ValueError(
                f"speculative_eagle_topk={topk}: only chain drafting (topk=1) is supported"
            )
        draft = self.speculative_num_draft_tokens
        if draft is None:
            draft = steps + 1
        if draft != steps + 1:
            raise ValueError(
                f"speculative_num_draft_tokens={draft} must equal speculative_num_steps + 1 "
                f"= {steps + 1} for chain drafting"
            )
        object.__setattr__(self, "speculative_num_steps", steps)
        object.__setattr__(self, "speculative_eagle_topk", topk)
        object.__setattr__(self, "speculative_num_draft_tokens", draft)

    def _resolve_strategy(self) -> None:
        if self.mamba_scheduler_strategy == "auto":
            logger.info("mamba_scheduler_strategy=auto resolved to extra_buffer")
            object.__setattr__(self, "mamba_scheduler_strategy", EXTRA_BUFFER.name)
        if self.disable_radix_cache:
            return
        strategy = self.strategy
        if strategy.donates_working:
            if self.page_size != 1:
                raise ValueError(
                    f"mamba_scheduler_strategy={strategy.name} needs page_size=1, got "
                    f"{self.page_size} (it inserts checkpoints at arbitrary lengths); use "
                    "extra_buffer"
                )
            if self.speculative_algorithm is not None:
                raise ValueError(
                    f"mamba_scheduler_strategy={strategy.name} cannot run speculative decoding "
                    "with the radix cache (it has no checkpoint slots); use extra_buffer or "
                    "extra_buffer_lazy, or disable_radix_cache"
                )
            if not self.disable_overlap_schedule:
                logger.warning(
                    "mamba_scheduler_strategy=%s donates the working slot at finish, which the "
                    "overlapped next step may still write: disabling the overlap schedule",
                    strategy.name,
                )
                object.__setattr__(self, "disable_overlap_schedule", True)
        draft = self.decode_positions
        if strategy.tracks and self.mamba_track_interval < 2 * draft:
            raise ValueError(
                f"mamba_track_interval={self.mamba_track_interval} must be >= 2 * "
                f"tokens per decode step ({draft}: verify positions, or "
                "num_continuous_decode_steps): two overlapped steps may not both cross a "
                "checkpoint boundary"
            )

    # ------------------------------------------------------------------ derived

    @property
    def strategy(self) -> Strategy:
        """The checkpoint strategy in force (``NONE`` when the radix cache is off)."""
        return NONE if self.disable_radix_cache else STRATEGIES[self.mamba_scheduler_strategy]

    @property
    def spec_enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def num_verify_tokens(self) -> int:
        """Tokens a decode step processes per request: D with speculation, else 1."""
        return self.speculative_num_draft_tokens if self.spec_enabled else 1

    @property
    def decode_positions(self) -> int:
        """Most tokens a decode step takes per request: D with speculation, else
        ``num_continuous_decode_steps``."""
        return self.num_verify_tokens if self.spec_enabled else self.decode_steps

    @property
    def decode_steps(self) -> int:
        """Decode steps a program runs without speculation (1 until the engine resolves
        an unset ``num_continuous_decode_steps`` for its platform)."""
        return self.num_continuous_decode_steps or 1

    def for_platform(self, platform: str) -> EngineConfig:
        """This config with what it leaves to the platform chosen: an unset
        ``num_continuous_decode_steps`` is ``default_decode_steps``, an unset
        ``max_prefill_tokens`` ``default_prefill_tokens``."""
        steps = self.num_continuous_decode_steps or default_decode_steps(
            platform, self.spec_enabled
        )
        tokens = self.max_prefill_tokens or default_prefill_tokens(
            platform, self.chunked_prefill_size
        )
        return replace(self, num_continuous_decode_steps=steps, max_prefill_tokens=tokens)

    def with_overrides(self, **kwargs) -> EngineConfig:
        return replace(self, **kwargs)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def default_decode_steps(platform: str, spec: bool) -> int:
    """Decode steps a program runs by default: 2 on a GPU without speculation, else 1. On
    an H100 the two-step programs' token step reached 66 / 75 / 71 % of the bytes floor at
    batch 1 / 16 / 64 where one-step programs reached 48 / 75 / 70 % (BENCHMARKS.md,
    "K decode steps per program"): never slower, and the host's work per step halves where it
    outlasts the device's. On CPU and TPU (no run) one step."""
    return 2 if platform == "gpu" and not spec else 1


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
