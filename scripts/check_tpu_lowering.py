"""Every program of an engine's table exported for TPU, on any host (no TPU needed).

For each model (a character tokenizer attached, so that the table holds the split decode
programs of batches with grammar rows), an engine is built on this host and its program table
(``Runner.program_table()``) is given the kernels of ``kernel_backend="pallas"`` on platform
TPU (``kernels_for("pallas", "tpu", page_size=...)``: the Mosaic state updates, the
ragged paged attention and, with ``--moe-runner pallas``, the Mosaic routed experts; the XLA
scatter and conv) and the TPU tuning; then every program is exported for platform ``tpu``
(``jax.export.export(jitted, platforms=["tpu"])`` of its abstract arguments), Mosaic kernels
included. A program that does not lower is named with its error, and the exit status is 1.

    python scripts/check_tpu_lowering.py                    # the tiny models (CI)
    python scripts/check_tpu_lowering.py --models nemotron_h:mamba_num_heads=16 --no-spec
    python scripts/check_tpu_lowering.py --serve   # and serve in TPU interpret mode

This proves the programs lower (shapes, layouts and Mosaic's rules for block shapes and
scalar prefetch, checked as each kernel lowers); not that they compile for a TPU chip or
run correctly there. ``--serve`` runs the same engines' programs on this CPU with every
Mosaic kernel in TPU interpret mode and checks the greedy tokens equal the XLA engine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from typing import Any

import jax
import numpy as np

from lazyspec.engine.programs import FINISH, FORWARD
from lazyspec.engine.steps import StepStatic
from lazyspec.kernels.backend import Kernels, kernels_for
from lazyspec.kernels.tuning import tuning_for

# a small table: two request rows, prefill chunks of 16 and 32 tokens, KV pages of 16 rows
# (the TPU attention fetches whole pages)
LAYOUT = dict(max_running_requests=2, chunked_prefill_size=32, mamba_chunk_size=16, page_size=16)


@dataclasses.dataclass(frozen=True)
class TpuStatic(StepStatic):
    """A step's static settings whose kernels are the TPU forms of its backend, whatever
    platform this process runs on (an engine resolves kernels for the platform it runs on)."""

    @property
    def kernels(self) -> Kernels:
        return kernels_for(self.backend, "tpu", self.moe_runner, self.tuning, self.page_size)


def tiny(name: str) -> Any:
    """The tiny model ``family`` or ``family:field=value,...`` (its tiny HF config with
    those integer fields replaced, e.g. ``nemotron_h:mamba_num_heads=16``)."""
    from types import SimpleNamespace

    from lazyspec.testing import tiny_models
    from lazyspec.testing.char_tokenizer import char_tokenizer

    family, _, fields = name.partition(":")
    if fields:
        over = {key: int(value) for key, value in (f.split("=") for f in fields.split(","))}
        model = tiny_models.build_tiny_model(dict(tiny_models.TINY_HF[family], **over))
    else:
        model = SimpleNamespace(**vars(tiny_models.tiny_model(family)))
    model.tokenizer = char_tokenizer()  # grammar rows: the split decode programs too
    return model


def tiny_engine(name: str, spec: bool) -> Any:
    """A tiny engine of ``name`` (``tiny``; ``LAYOUT``; NEXTN with ``spec``) on XLA."""
    from lazyspec.testing.tiny_models import small_engine

    nextn = dict(speculative_algorithm="NEXTN", speculative_num_steps=2) if spec else {}
    return small_engine(tiny(name), kernel_backend="xla", **LAYOUT, **nextn)


def use_tpu_kernels(runner: Any, moe_runner: str, device_kind: str) -> Any:
    """``runner`` with its steps taking the TPU kernels of the Pallas backend and
    ``device_kind``'s tuning (mutates it; returns it)."""
    fields = {f.name: getattr(runner.static, f.name) for f in dataclasses.fields(StepStatic)}
    fields.update(backend="pallas", moe_runner=moe_runner, tuning=tuning_for(device_kind))
    runner.static = TpuStatic(**fields)
    return runner


def tpu_runner(name: str, spec: bool, moe_runner: str, device_kind: str) -> Any:
    """The runner of ``tiny_engine(name, spec)`` with the TPU kernels (``use_tpu_kernels``)."""
    return use_tpu_kernels(tiny_engine(name, spec).runner, moe_runner, device_kind)


def served_tokens(engine: Any) -> list[list[int]]:
    """Three greedy requests of ragged prompts (5, 40 and 23 tokens: one and two prefill
    chunks, several KV pages) served together, 12 new tokens each; integrity checked after
    every step."""
    rng = np.random.default_rng(0)
    params = {"max_new_tokens": 12, "ignore_eos": True}
    prompts = [rng.integers(3, 60, n).tolist() for n in (5, 40, 23)]
    reqs = [engine.add_request(input_ids=p, sampling_params=params) for p in prompts]
    engine.run_until_done(reqs, check=lambda e: e.check_integrity())
    return [list(r.output_ids) for r in reqs]


def serve_in_interpret_mode(name: str, spec: bool, moe_runner: str, device_kind: str) -> bool:
    """Whether the tiny engine of ``name`` serves ``served_tokens`` token for token alike on
    XLA and with the TPU kernels run in TPU interpret mode (Mosaic kernels simulated on this
    CPU: DMAs, scalar prefetch, VMEM)."""
    from jax.experimental.pallas import tpu as pltpu

    want = served_tokens(tiny_engine(name, spec))
    engine = tiny_engine(name, spec)
    use_tpu_kernels(engine.runner, moe_runner, device_kind)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        return served_tokens(engine) == want


def program_name(family: str, key: Any) -> str:
    shape = f"{key.kind} rows={key.rows} tokens={key.tokens}"
    return f"{family}: {shape}" + (" greedy" if key.greedy else "") + f" copy={key.copy}"


def export_for_tpu(runner: Any, program: Any) -> jax.export.Exported:
    """``program`` exported for TPU. A split decode step's finish takes its forward's carry,
    which ``Program.arguments`` gets by compiling the forward for this host (impossible with
    Mosaic kernels off a TPU): here the carry is the forward's exported outputs."""
    if program.key.kind != FINISH:
        return jax.export.export(program.jitted, platforms=["tpu"])(*program.arguments())
    forward_key = dataclasses.replace(program.key, kind=FORWARD)
    (forward,) = [entry for entry in runner.program_table() if entry.key == forward_key]
    forward_args = forward.arguments()
    outputs = jax.export.export(forward.jitted, platforms=["tpu"])(*forward_args)
    carry, _ = jax.tree.unflatten(outputs.out_tree, outputs.out_avals)
    return jax.export.export(program.jitted, platforms=["tpu"])(*forward_args, carry)


def lower_all(runner: Any, family: str) -> tuple[dict[str, int], dict[str, str]]:
    """({program: Mosaic kernel calls in it} of the programs exported for TPU, {program:
    error} of those that were not)."""
    lowered, failed = {}, {}
    for program in runner.program_table():
        name = program_name(family, program.key)
        try:
            exported = export_for_tpu(runner, program)
            assert exported.platforms == ("tpu",), exported.platforms
            lowered[name] = exported.mlir_module().count("tpu_custom_call")
        except Exception as error:  # noqa: BLE001  every failure is reported by name
            lines = traceback.format_exception_only(type(error), error)
            failed[name] = "".join(lines).strip().splitlines()[0][:400]
    return lowered, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3_next,nemotron_h", help="tiny model families")
    p.add_argument("--no-spec", action="store_true", help="no NEXTN programs (verify steps)")
    p.add_argument(
        "--moe-runner",
        choices=("auto", "pallas", "xla"),
        default="pallas",
        help="routed experts' form on TPU (pallas: the Mosaic kernel; auto: XLA dispatch)",
    )
    p.add_argument("--device-kind", choices=("tpu_v5e", "tpu_v6e"), default="tpu_v5e")
    p.add_argument(
        "--serve",
        action="store_true",
        help="also serve a few requests with the TPU kernels in TPU interpret mode and "
        "compare the tokens with the XLA engine's (slow: a minute a model)",
    )
    args = p.parse_args(argv)
    lowered, failed, differ = {}, {}, []
    for name in args.models.split(","):
        start = time.perf_counter()
        # speculation where the family has a draft head (Qwen3-Next's MTP layer)
        spec = not args.no_spec and name.startswith("qwen3_next")
        runner = tpu_runner(name, spec, args.moe_runner, args.device_kind)
        done, errors = lower_all(runner, name)
        lowered.update(done)
        failed.update(errors)
        took = time.perf_counter() - start
        mosaic = sum(calls > 0 for calls in done.values())
        print(
            f"{name}: {len(done)} lowered ({mosaic} with Mosaic kernels), {len(errors)} failed "
            f"({took:.1f} s)",
            flush=True,
        )
        if args.serve:
            same = serve_in_interpret_mode(name, spec, args.moe_runner, args.device_kind)
            differ += [] if same else [name]
            verdict = "identical to" if same else "DIFFERENT from"
            print(f"{name}: served in TPU interpret mode, tokens {verdict} the XLA engine's")
    for name, error in failed.items():
        print(f"NOT LOWERED {name}: {error}")
    mosaic = sum(calls > 0 for calls in lowered.values())
    print(f"{len(lowered)} programs lowered for TPU ({mosaic} with Mosaic kernels)")
    return 1 if failed or differ else 0


if __name__ == "__main__":
    sys.exit(main())
