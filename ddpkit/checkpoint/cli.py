"""`ddpkit checkpoint`: look into a checkpoint, and convert it, offline (no process group).

    ddpkit checkpoint inspect runs/ckpt [--all]
    ddpkit checkpoint convert runs/ckpt model.safetensors            # or model.pt: a torch.save dict
    ddpkit checkpoint convert runs/ckpt hf-out/ --config runs/export # a Hugging Face folder
    ddpkit checkpoint convert hf-out/ runs/ckpt2 [--name model]      # back: a checkpoint s.load resumes

The direction follows the source: a ddpkit checkpoint (a root s.save wrote into, or one ckpt-NNNNNN/)
is converted out; a safetensors file or a `save_pretrained` folder is converted into a checkpoint. The
output format follows OUT (`.safetensors`; `.pt`, `.pth` or `.bin`; else a folder) unless --to says.
Part of the checkpoint wing (`ddpkit.checkpoint.inspect`, `ddpkit.checkpoint.convert`); `ddpkit.cli`
reaches it as a tool.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpkit.checkpoint import convert, files, inspect, reading
from ddpkit.errors import DdpkitError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def build_parser() -> argparse.ArgumentParser:
    """`inspect` and `convert` with their options; tests/options/cli.toml names a test for each."""
    parser = argparse.ArgumentParser(prog="ddpkit checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    look = sub.add_parser("inspect", help="what a checkpoint holds, and whether every checksum holds")
    look.add_argument("path", help="a checkpoint root (its newest checkpoint) or one ckpt-NNNNNN/ folder")
    look.add_argument(
        "--all", action="store_true", help="list every tensor (default: the first 12 per model)"
    )
    look.add_argument(
        "--values",
        action="store_true",
        help="show each saved value whole, one a line (default: cut to one line)",
    )
    conv = sub.add_parser("convert", help="to safetensors, a Hugging Face folder or torch.save; and back")
    conv.add_argument("source", help="a ddpkit checkpoint; or a safetensors file / save_pretrained folder")
    conv.add_argument("out", help="the file or folder to write (or, converting back, a checkpoint root)")
    conv.add_argument(
        "--to",
        choices=("safetensors", "hf", "torch"),
        default=None,
        help="output format (default: from OUT's suffix; a folder is 'hf')",
    )
    conv.add_argument(
        "--config", default=None, help="hf: the folder s.export wrote for this model, or a config.json"
    )
    conv.add_argument("--model", default=None, help="which model of the checkpoint (its keyword in s.save)")
    conv.add_argument("--name", default="model", help="back: the keyword s.load will pass it under")
    conv.add_argument("--step", type=int, default=None, help="back: the step value s.load returns")
    return parser


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.action == "inspect":
            text, ok = inspect.report(ns.path, all_tensors=ns.all, whole_values=ns.values)
            print(text)
            return 0 if ok else 1
        return _convert(ns)
    except DdpkitError as err:
        print(f"ddpkit checkpoint {ns.action}: error: {err}", file=sys.stderr)
        return 2


def _convert(ns: argparse.Namespace) -> int:
    source, out = Path(ns.source), Path(ns.out)
    if not (files.is_checkpoint(source) or files.candidates(source)):
        path = convert.from_weights(source, out, name=ns.name, step=ns.step)
        print(f"ddpkit: wrote {path} from {source}: s.load({str(out)!r}, {ns.name}=model) resumes from it")
        return 0
    to = ns.to or (
        "safetensors" if out.suffix == ".safetensors" else "torch" if out.suffix in TORCH_SUFFIXES else "hf"
    )
    if to == "hf":
        if ns.config is None:
            raise reading.CheckpointError(
                f"{out} is a folder, so a Hugging Face model is written, and that needs its config. Pass "
                "--config the folder s.export wrote for this model (or a config.json), or name a "
                ".safetensors or .pt file for OUT"
            )
        path, count = convert.to_hf(source, out, config=ns.config, model=ns.model)
    elif to == "torch":
        path, count = convert.to_torch(source, out, model=ns.model)
    else:
        path, count = convert.to_safetensors(source, out, model=ns.model)
    print(f"ddpkit: wrote {count} tensors to {path} ({to}) from {reading.resolve(source)[0]}")
    return 0
