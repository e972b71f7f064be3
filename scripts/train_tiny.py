"""Train the embedded default model: a small Qwen3-Next (GDN + gated attention, 3 : 1) with
its MTP head, on the Python standard library's own ``.py`` files.

The corpus is every ``.py`` file under the running interpreter's stdlib folder (without
site-packages), sorted by relative path; a file is held out for validation when
``crc32(relative path) % 20 == 0``. A byte-level BPE tokenizer (``tokenizers``) is trained
on the training files; each file becomes ``<|endoftext|>`` + its tokens.

    # CPU smoke run (a few minutes)
    python scripts/train_tiny.py --steps 50 --hidden-size 64 --num-layers 4 --batch-size 8 \\
        --seq-len 128 --out-dir out/smoke --export-dir out/smoke/model
    # prepare here (tokenizer + token stream), train on a machine without network
    python scripts/train_tiny.py --prepare-only --data-file out/stdlib_tokens.npy
    python scripts/train_tiny.py --data-file out/stdlib_tokens.npy --out-dir out/default \\
        --export-dir lazyspec/assets/default_model

Writes into --out-dir: orbax checkpoints (``--resume`` continues from the latest),
``loss_curve.png`` and ``metrics.json`` (validation loss, the unigram baseline, sizes).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lazyspec.training.corpus import (
    EOS,
    load_data,
    prepare,
    save_data,
    stdlib_root,
)
from lazyspec.training.trainer import (
    evaluate,
    make_eval_step,
    make_optimizer,
    make_train_step,
    sample_windows,
    unigram_baseline,
    validation_windows,
)

logger = logging.getLogger("train_tiny")

# ---------------------------------------------------------------- model and training loop


def model_hf_config(args: argparse.Namespace, vocab_size: int, eos_id: int) -> dict:
    """The Qwen3-Next config.json dict: 64-wide heads, 3 GDN layers per attention layer,
    dense SwiGLU MLPs (3x hidden), partial RoPE, one MTP layer."""
    heads = max(1, args.hidden_size // 64)
    layer_types = [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.num_layers)
    ]
    return dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=0,
        hidden_act="silu",
        attention_bias=False,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


@dataclass
class TrainResult:
    params: dict
    eval_step: object
    history: dict
    num_params: int
    train_seconds: float
    tokens_per_second: float


def _backend_choices(args: argparse.Namespace):
    """(compute dtype, GDN form): "auto" = bf16 + chunked on accelerators, fp32 + scan on
    CPU."""
    import jax
    import jax.numpy as jnp

    on_cpu = jax.default_backend() == "cpu"
    dtype = args.compute_dtype
    if dtype == "auto":
        dtype = "float32" if on_cpu else "bfloat16"
    form = args.gdn_form
    if form == "auto":
        form = "scan" if on_cpu else "chunked"
    return jnp.dtype(dtype), form


def _checkpoints(args: argparse.Namespace):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    return ocp.CheckpointManager((args.out_dir / "checkpoints").resolve(), options=options)


def _save(manager, step: int, params, opt_state, history: dict) -> None:
    import orbax.checkpoint as ocp

    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            history=ocp.args.JsonSave(history),
        ),
    )


def _restore(manager, params, opt_state):
    """(step, params, opt_state, history) of the latest checkpoint."""
    import jax
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state}
    )
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), history=ocp.args.JsonRestore()
        ),
    )
    state = restored.state
    return step, state["params"], state["opt_state"], dict(restored.history)


def fit(
    args: argparse.Namespace, hf_config: dict, train_ids: np.ndarray, val_ids: np.ndarray
) -> TrainResult:
    """Train from scratch (or from the latest checkpoint with ``--resume``)."""
    import jax
    from tqdm import tqdm

    from lazyspec.models import qwen3_next

    cfg = qwen3_next.parse_config(hf_config)
    dtype, form = _backend_choices(args)
    params = qwen3_next.init_params(cfg, jax.random.key(args.seed))
    num_params = int(sum(p.size for p in jax.tree.leaves(params)))
    logger.info(
        "model: %s parameters, compute dtype %s, GDN form %s", f"{num_params:,}", dtype, form
    )
    optimizer = make_optimizer(
        args.lr, args.steps, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay
    )
    opt_state = optimizer.init(params)
    train_step = make_train_step(
        cfg, optimizer, mtp_weight=args.mtp_weight, compute_dtype=dtype, gdn_form=form
    )
    eval_step = make_eval_step(cfg, mtp_weight=args.mtp_weight, compute_dtype=dtype, gdn_form=form)
    manager = _checkpoints(args)
    history, start = {"train": [], "val": []}, 0
    if args.resume and manager.latest_step() is not None:
        start, params, opt_state, history = _restore(manager, params, opt_state)
        logger.info("resumed from step %d", start)
    val_windows = validation_windows(val_ids, args.seq_len, args.eval_windows)
    pending, timed_from = [], None  # (time, step) after the first logged window
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train")
    for step in bar:
        rng = np.random.default_rng([args.seed, step])
        tokens = sample_windows(train_ids, args.batch_size, args.seq_len, rng)
        params, opt_state, metrics = train_step(params, opt_state, tokens)
        pending.append((step + 1, metrics))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            for done, m in jax.device_get(pending):
                history["train"].append([done, float(m["loss"]), float(m["lm"]), float(m["mtp"])])
            pending = []
            if timed_from is None:  # the first logged window holds the compilation
                timed_from = (time.time(), step + 1)
            bar.set_postfix(
                lm=f"{history['train'][-1][2]:.3f}", mtp=f"{history['train'][-1][3]:.3f}"
            )
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = evaluate(eval_step, params, val_windows, args.batch_size)
            history["val"].append([step + 1, val["lm"], val["mtp"]])
            logger.info("step %d: val lm %.4f mtp %.4f", step + 1, val["lm"], val["mtp"])
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            _save(manager, step + 1, params, opt_state, history)
    manager.wait_until_finished()
    manager.close()
    seconds, timed_steps = 0.0, 0
    if timed_from is not None:
        seconds, timed_steps = time.time() - timed_from[0], args.steps - timed_from[1]
    rate = timed_steps * args.batch_size * args.seq_len / seconds if seconds > 0 else 0.0
    return TrainResult(params, eval_step, history, num_params, seconds, rate)


def plot_losses(history: dict, baseline: float, path: Path) -> None:
    """Train (LM and MTP) and validation losses per step, with the unigram baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if history["train"]:
        train = np.asarray(history["train"])
        ax.plot(train[:, 0], train[:, 2], lw=0.8, label="train LM")
        ax.plot(train[:, 0], train[:, 3], lw=0.8, label="train MTP (t+2)")
    if history["val"]:
        val = np.asarray(history["val"])
        ax.plot(val[:, 0], val[:, 1], "o-", label="validation LM")
        ax.plot(val[:, 0], val[:, 2], "s--", label="validation MTP")
    ax.axhline(baseline, color="gray", ls=":", label="unigram baseline (val)")
    ax.set(xlabel="step", ylabel="nats / token", title="train_tiny: Python stdlib")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="matmul dtype; auto = bfloat16 on accelerators, float32 on CPU",
    )
    p.add_argument(
        "--gdn-form",
        choices=("auto", "chunked", "scan"),
        default="auto",
        help="GDN training form; auto = chunked on accelerators, scan on CPU",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("out/train_tiny"))
    p.add_argument("--export-dir", type=Path, default=None)
    p.add_argument("--data-file", type=Path, default=None)
    p.add_argument("--prepare-only", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=64, help="windows per periodic eval")
    p.add_argument("--final-eval-windows", type=int, default=1024)
    args = p.parse_args(argv)
    if args.prepare_only and args.data_file is None:
        p.error("--prepare-only needs --data-file (where to write the token stream)")
    for name in ("steps", "batch_size", "seq_len", "hidden_size", "num_layers"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.seq_len < 3:
        p.error(f"--seq-len must be at least 3 (the MTP loss needs t+2), got {args.seq_len}")
    return args


def _data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, dict]:
    if args.data_file is not None and args.data_file.is_file():
        logger.info("reading the token stream from %s", args.data_file)
        return load_data(args.data_file)
    logger.info("training the tokenizer and encoding %s", stdlib_root())
    tokens, meta = prepare(args.vocab_size)
    if args.data_file is not None:
        save_data(args.data_file, tokens, meta)
    from tokenizers import Tokenizer

    meta["tokenizer_object"] = Tokenizer.from_str(meta["tokenizer"])
    split = meta["num_train_tokens"]
    return tokens[:split], tokens[split:], meta


def main(argv: list[str] | None = None) -> dict | None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.prepare_only:
        tokens, meta = prepare(args.vocab_size)
        save_data(args.data_file, tokens, meta)
        logger.info(
            "wrote %d train + %d val tokens to %s",
            meta["num_train_tokens"],
            meta["num_val_tokens"],
            args.data_file,
        )
        return None
    train_ids, val_ids, meta = _data(args)
    tokenizer = meta.pop("tokenizer_object")
    hf_config = model_hf_config(args, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    state = fit(args, hf_config, train_ids, val_ids)
    windows = validation_windows(val_ids, args.seq_len, args.final_eval_windows)
    final = evaluate(state.eval_step, state.params, windows, args.batch_size)
    baseline = unigram_baseline(train_ids, val_ids, hf_config["vocab_size"])
    metrics = {
        "val_loss": final["lm"],
        "val_mtp_loss": final["mtp"],
        "unigram_baseline": baseline["val_cross_entropy"],
        "train_unigram_entropy": baseline["train_entropy"],
        "num_val_windows": int(windows.shape[0]),
        "steps": args.steps,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_seconds": state.train_seconds,
        "tokens_per_second": state.tokens_per_second,
        "wall_seconds": time.time() - started,
        "num_params": state.num_params,
        "data": {k: v for k, v in meta.items() if k not in ("tokenizer", "val_files")},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": hf_config,
    }
    plot_losses(state.history, metrics["unigram_baseline"], args.out_dir / "loss_curve.png")
    if args.export_dir is not None:
        from lazyspec.training.export import export_hf_folder

        export_hf_folder(state.params, hf_config, tokenizer, args.export_dir, dtype="bfloat16")
        metrics["export_bytes"] = sum(p.stat().st_size for p in args.export_dir.iterdir())
    (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    logger.info(
        "val loss %.4f (MTP %.4f) vs unigram baseline %.4f nats/token",
        metrics["val_loss"],
        metrics["val_mtp_loss"],
        metrics["unigram_baseline"],
    )
    return metrics


if __name__ == "__main__":
    main()
