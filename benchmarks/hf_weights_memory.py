"""Peak memory per rank when a pretrained Hugging Face checkpoint is loaded: `s.model(factory, weights=)`
against every rank calling `from_pretrained` (issue 30, item 2).

    python benchmarks/hf_weights_memory.py                      # GPT-2 124M (12 layers, 768 wide), 2 ranks
    python benchmarks/hf_weights_memory.py --layers 4 --nproc 2 --json runs/hf_weights.json

The checkpoint is written once by this process with `save_pretrained` (fp32 safetensors, in a temporary
directory; nothing is downloaded). Each mode then runs in 2 fresh ranks ("spawn"), which build the
model and load the weights, and report their peak RSS from process start (`ru_maxrss`), their RSS after
the imports (before any model), and the seconds `s.model` took. Modes:

- fsdp+weights: `s.model(lambda: GPT2LMHeadModel(cfg), strategy="fsdp", weights=dir)`: each rank reads
  only its rows of each tensor (safetensors slices), after the shard-by-shard build.
- fsdp (no weights): the same build without reading anything: the floor of the FSDP modes.
- from_pretrained+fsdp: what users do without ddpkit's reader: every rank `from_pretrained(dir)`
  (the whole model in every rank), then `s.model(model, strategy="fsdp")` cuts it.
- ddp+weights: `s.model(factory, strategy="ddp", weights=dir)`: rank 0 reads, DDP broadcasts.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import ddpkit

MODES = ("fsdp+weights", "fsdp", "from_pretrained+fsdp", "ddp+weights")


def _config(layers: int):
    import transformers as tf

    return tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _rank(mode: str, root: str, layers: int) -> dict:
    import transformers as tf
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401  (imported lazily otherwise)

    after_imports = _rss_mib()
    cfg = _config(layers)
    with ddpkit.session(seed=0, verbose=False) as s:
        s.barrier()
        session_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        before = _rss_mib()
        start = time.perf_counter()
        if mode == "from_pretrained+fsdp":
            model = s.model(tf.GPT2LMHeadModel.from_pretrained(root), strategy="fsdp")
        else:
            strategy = "ddp" if mode.startswith("ddp") else "fsdp"
            weights = root if mode.endswith("+weights") else None
            model = s.model(lambda: tf.GPT2LMHeadModel(cfg), strategy=strategy, weights=weights)
        s.barrier()
        seconds = time.perf_counter() - start
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return {
            "imports_mib": after_imports,
            "session_mib": session_peak,
            "before_mib": before,
            "peak_mib": peak,
            "model_s": seconds,
            "local_params": local,
        }


def _write(root: str, layers: int) -> int:
    import transformers as tf

    model = tf.GPT2LMHeadModel(_config(layers))
    model.save_pretrained(root)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        # Written by a child process: a rank's ru_maxrss starts at its parent's peak (kept across fork and
        # exec), so this process must never hold the model.
        params = ddpkit.spawn(_write, 1, (root, ns.layers), threads=1, timeout=600)[0]
        for mode in ns.modes:
            ranks = ddpkit.spawn(_rank, ns.nproc, (mode, root, ns.layers), threads=1, timeout=600)
            rows.append({"mode": mode, "ranks": ranks})
    print(
        f"GPT-2 {ns.layers} layers x 768: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB in "
        f"fp32; {ns.nproc} ranks; MiB per rank (rank 0 / rank 1 / ...)"
    )
    print(
        "| mode | RSS after imports | peak RSS before s.model | RSS before s.model | peak RSS | "
        "peak - RSS before s.model | s.model (s) | parameters held |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = row["ranks"]

        def cell(key: str, fmt: str, r: list = r) -> str:
            return " / ".join(fmt.format(x[key]) for x in r)

        grown = " / ".join(f"{x['peak_mib'] - x['before_mib']:.0f}" for x in r)
        print(
            f"| {row['mode']} | {cell('imports_mib', '{:.0f}')} | {cell('session_mib', '{:.0f}')} | "
            f"{cell('before_mib', '{:.0f}')} | "
            f"{cell('peak_mib', '{:.0f}')} | {grown} | "
            f"{cell('model_s', '{:.1f}')} | {cell('local_params', '{:,}')} |"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
