"""The jitted steps take the model config as a static argument hashed by value: engines of
equal configs built separately share one compilation per shape; a different config
compiles its own. A batch travels packed into one array and unpacks bit for bit."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import jax
import numpy as np

from lazyspec.config import EngineConfig
from lazyspec.engine.engine import Engine
from lazyspec.engine.packing import (
    decode_output_words,
    pack_batch,
    pack_outputs,
    unpack_batch,
    unpack_outputs,
)
from lazyspec.scheduler.batch import build_decode, build_extend
from lazyspec.scheduler.layout import plan_memory
from lazyspec.testing.tiny_models import NEMOTRON_HF, TINY_CHUNKS, build_tiny_model, tiny_model


def _model(**overrides) -> SimpleNamespace:
    return build_tiny_model({**NEMOTRON_HF, **overrides})


def _tiny_engine(model: SimpleNamespace, **kw) -> Engine:
    sizes = dict(max_running_requests=1, max_total_tokens=256, context_length=64)
    return Engine(model=model, **{**TINY_CHUNKS, **sizes, "skip_warmup": True, **kw})


def _serve(model: SimpleNamespace, num_new: int = 2) -> tuple[Engine, list[int]]:
    engine = _tiny_engine(model)
    params = {"max_new_tokens": num_new, "ignore_eos": True}
    return engine, engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]


def test_equal_configs_share_compiled_steps():
    first, second = _model(), _model()
    assert first.config is not second.config and first.config == second.config
    engine, _ = _serve(first)
    compiled = engine.runner.num_compiled()  # every runner's jitted programs
    _serve(second)
    assert engine.runner.num_compiled() == compiled
    _serve(_model(layer_norm_epsilon=1e-6))  # a different config: its own programs
    assert engine.runner.num_compiled() > compiled


def test_packed_batch_round_trips():
    """A launch moves the batch as one int32 array: every leaf comes back bit for bit, in
    its dtype (uint32 seeds and float32 values bit-cast, bools as 0 / 1); each bucket twice,
    with other bits (its layout is built once)."""
    config = EngineConfig(max_total_tokens=1024, context_length=256, chunked_prefill_size=64)
    layout = plan_memory(config, SimpleNamespace(max_position_embeddings=4096))
    rng = np.random.default_rng(0)
    builds = (
        lambda: build_extend(layout, [], num_rows=2, length=64),
        lambda: build_decode(layout, []),
    )
    layouts = set()
    for batch in [build() for build in builds for _ in range(2)]:
        for leaf in jax.tree.leaves(batch):  # random bits in every leaf, in place
            bits = rng.integers(0, 2**32, size=leaf.shape, dtype=np.uint32)
            leaf[...] = bits % 2 if leaf.dtype == bool else bits.view(leaf.dtype)
        packed = pack_batch(batch)
        layouts.add(id(packed.layout))
        assert packed.words.dtype == np.int32 and packed.num_rows == len(batch.req_row)
        unpacked = jax.jit(unpack_batch)(jax.device_put(packed))
        assert type(unpacked) is type(batch)
        for leaf, back in zip(jax.tree.leaves(batch), jax.tree.leaves(unpacked)):
            back = np.asarray(back)
            assert back.dtype == leaf.dtype
            assert back.tobytes() == leaf.tobytes()
    assert len(layouts) == len(builds)


def test_packed_outputs_round_trip():
    """A decode step returns its outputs as one int32 array: every leaf comes back bit for
    bit in its dtype and shape (float32 bit-cast, NaN payloads included; bools as 0 / 1)."""
    rng = np.random.default_rng(1)
    bits = lambda *shape: rng.integers(0, 2**32, size=shape, dtype=np.uint32)  # noqa: E731
    outputs = {
        "tokens": bits(3, 2).view(np.int32),
        "logprobs": bits(3, 2).view(np.float32),
        "crossed": bits(3) % 2 == 1,
        "top": bits(3, 2, 4).view(np.float32),
        "one": bits(1).view(np.int32),
    }
    held = {}

    def pack(outs):
        words, held["layout"] = pack_outputs(outs)
        return words

    words = np.asarray(jax.jit(pack)(outputs))
    assert words.dtype == np.int32 and words.shape == (6 + 6 + 3 + 24 + 1,)
    back = unpack_outputs(words, held["layout"])
    assert sorted(back) == sorted(outputs)
    for name, leaf in outputs.items():
        assert back[name].dtype == leaf.dtype and back[name].shape == leaf.shape, name
        assert back[name].tobytes() == leaf.tobytes(), name
    try:
        pack_outputs({"half": jax.numpy.zeros(2, jax.numpy.bfloat16)})
    except TypeError as exc:
        assert "4 bytes wide or bool" in str(exc)
    else:
        raise AssertionError("a 2-byte output was packed")


def test_two_decode_programs_called_in_turn():
    """decode_program_copies=2: the warm-up compiles both copies of every decode shape (so
    serving compiles nothing), the decode steps alternate between them, and the tokens are
    those of one program. On a CPU the default is one program."""
    model = _model(layer_norm_epsilon=1e-4)  # a config of its own: no program compiled yet
    engine = _tiny_engine(model, decode_program_copies=2, skip_warmup=False)
    runner, calls = engine.runner, []
    compiled, decode = runner.num_compiled(), runner._decode
    program = decode.program

    def spy(layout):
        calls.append(decode.turn)
        return program(layout)

    decode.program = spy
    params = {"max_new_tokens": 6, "ignore_eos": True}
    got = engine.generate(input_ids=[5, 6, 7], sampling_params=params)["output_ids"]
    assert runner.num_compiled() == compiled
    assert len(calls) >= 4 and all(a != b for a, b in zip(calls, calls[1:])), calls
    one, want = _serve(model, num_new=6)
    assert one.runner.decode_copies == 1 and got == want
    try:
        EngineConfig(decode_program_copies=3)
    except ValueError as exc:
        assert "decode_program_copies=3 must be 1 or 2" in str(exc)
    else:
        raise AssertionError("decode_program_copies=3 was accepted")


def test_decode_outputs_written_over_the_batch_words():
    """A decode step is handed its batch's words (donated) and returns its packed outputs in
    an array of their shape, which XLA writes over them: no output buffer of its own. The
    words are padded to hold the outputs (``decode_output_words``) at every decode shape,
    with speculation and many drafts too, so the donation is never refused."""
    engine = _tiny_engine(
        tiny_model("qwen3_next"),
        speculative_algorithm="NEXTN",
        speculative_num_steps=15,
        max_running_requests=16,
        max_total_tokens=1024,
        context_length=128,
    )
    runner = engine.runner
    static = (runner.family, runner.cfg, runner.static, runner.sharding)
    for rows, verify in ((1, 1), (16, 1), (1, 16), (16, 16)):
        batch = build_decode(engine.layout, [], num_rows=rows, num_verify=verify)
        packed = pack_batch(batch)
        assert len(packed.words) >= decode_output_words(rows, verify)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Some donated buffers were not usable"
            lowered = runner.programs.decode.lower(*static, runner.params, runner.pools, packed)
        words, _ = lowered.out_info
        assert words.shape == packed.words.shape and words.dtype == packed.words.dtype
        # the words' parameter is aliased to the first output (the packed outputs)
        aliased = rf"%arg\d+: tensor<{len(packed.words)}xi32> {{[^}}]*tf\.aliasing_output = 0 :"
        assert re.search(aliased, lowered.as_text()), (rows, verify)


def test_step_inputs_are_placed_first_only_off_the_cpu():
    """On a CPU a step is handed its batch's words as the numpy array (the jitted call moves
    them, cheaper there); placed first (``place_inputs``, a GPU's or several processes'
    way) the step gets a device array. The tokens are the same, and neither way makes a
    donation XLA refuses."""
    model = _model()
    got = {}
    for place in (False, True):
        engine = _tiny_engine(model)
        assert engine.runner.place_inputs is False  # one CPU process
        engine.runner.place_inputs = place
        kinds, decode = set(), engine.runner._decode

        def spy(params, pools, batch, decode=decode, kinds=kinds):
            kinds.add(type(batch.words))
            return decode(params, pools, batch)

        engine.runner._decode = spy
        params = {"max_new_tokens": 4, "ignore_eos": True}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Some donated buffers were not usable"
            got[place] = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
        if place:
            assert kinds and all(issubclass(kind, jax.Array) for kind in kinds), kinds
        else:
            assert kinds == {np.ndarray}, kinds
    assert got[False]["output_ids"] == got[True]["output_ids"]
