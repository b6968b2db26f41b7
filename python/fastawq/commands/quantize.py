"""`fastawq quantize MODEL OUT`: AWQ-quantize a Hugging Face model folder into an AWQ checkpoint."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def run(args) -> int:
    import torch

    from fastawq.auto import AutoAWQForCausalLM
    from fastawq.eval import format_table
    from fastawq.quantize import distributed

    from fastawq.checkpoint import check_local_path, check_not_source, parse_size

    out = Path(args.out)
    # Checked before the (long) quantization: the source exists, the output is not the source,
    # and the output may be written.
    src = check_local_path(args.model)
    if src is not None:
        check_not_source(out, src)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a folder")
    parse_size(args.shard_size)
    if args.gpus > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args)
    device = distributed.init_from_env(args.device)
    if args.stream is None:
        args.stream = _should_stream(args.model) or distributed.rank_world()[1] > 1
    if args.stream:
        return _run_streaming(args, device)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} is not empty; pass --overwrite to replace its checkpoint")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoAWQForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    qc = {"w_bit": args.w_bit, "q_group_size": args.group_size, "zero_point": args.zero_point,
          "fallback_group_size": args.fallback_group_size}
    if args.modules_to_not_convert:
        qc["modules_to_not_convert"] = args.modules_to_not_convert
    t = time.perf_counter()
    model.quantize(model.tokenizer, quant_config=qc, calib_data=args.calib, max_calib_samples=args.max_calib_samples,
                   max_calib_seq_len=args.max_calib_seq_len, apply_clip=not args.no_clip, device=device,
                   text_column=args.text_column)
    dt = time.perf_counter() - t
    model.save_quantized(args.out, shard_size=args.shard_size, overwrite=args.overwrite)
    print(format_table(["model", "bits", "group", "calib", "device", "time (s)", "saved to"], [[
        args.model, args.w_bit, args.group_size, f"{args.max_calib_samples}x{args.max_calib_seq_len}",
        device, round(dt, 1), args.out]]))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="AWQ-quantize a Hugging Face model folder to a 4-bit checkpoint")
    p.add_argument("model", help="Hugging Face model folder (safetensors)")
    p.add_argument("out", help="output folder (must be empty unless --overwrite)")
    p.add_argument("--w-bit", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--fallback-group-size", type=int, default=None,
                   help="group size for layers whose in_features --group-size does not divide")
    p.add_argument("--zero-point", action=_BoolAction, default=True)
    p.add_argument("--calib", default=None, help="a .txt / .jsonl file (default: fastawq's offline text); a .jsonl "
                   "whose objects have an \"image\" path calibrates a vision-language model on image+text pairs")
    p.add_argument("--text-column", default="text")
    p.add_argument("--max-calib-samples", type=int, default=128)
    p.add_argument("--max-calib-seq-len", type=int, default=512)
    p.add_argument("--no-clip", action="store_true", help="skip the clipping search")
    p.add_argument("--modules-to-not-convert", nargs="*", default=None)
    p.add_argument("--device", default=None, help="where layers are searched (default: cuda if present)")
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--stream", action=_BoolAction, default=None,
                   help="read and write one decoder layer at a time (default: when the model would not fit in RAM)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="streaming: discard a partial run in OUT instead of continuing it")
    p.add_argument("--gpus", type=int, default=1, help="processes to spread the search over (starts torchrun)")
    p.add_argument("--max-memory", nargs="*", default=None, metavar="DEV=SIZE",
                   help="streaming: budgets such as cuda:0=6GiB cpu=6GiB")
    p.set_defaults(func=run)


def _should_stream(model: str) -> bool:
    """Stream when the float weights would take more than half of the available RAM."""
    size = sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return False
    return size > avail // 2


def _run_streaming(args, device) -> int:
    from fastawq.eval import format_table
    from fastawq.quantize.stream import quantize_streaming

    qc = {"w_bit": args.w_bit, "q_group_size": args.group_size, "zero_point": args.zero_point,
          "fallback_group_size": args.fallback_group_size}
    if args.modules_to_not_convert:
        qc["modules_to_not_convert"] = args.modules_to_not_convert
    max_memory = None
    if args.max_memory:
        max_memory = dict(kv.split("=", 1) for kv in args.max_memory)
    t = time.perf_counter()
    quantize_streaming(args.model, args.out, None, qc, args.calib, max_calib_samples=args.max_calib_samples,
                       max_calib_seq_len=args.max_calib_seq_len, text_column=args.text_column,
                       apply_clip=not args.no_clip, device=device, shard_size=args.shard_size,
                       max_memory=max_memory, resume=args.resume, overwrite=args.overwrite,
                       trust_remote_code=args.trust_remote_code)
    from fastawq.quantize.distributed import rank_world

    rank, world = rank_world()
    if world > 1:
        import torch.distributed

        torch.distributed.destroy_process_group()
    if rank == 0:
        print(format_table(["model", "bits", "group", "calib", "device", "processes", "time (s)", "saved to"], [[
            args.model, args.w_bit, args.group_size, f"{args.max_calib_samples}x{args.max_calib_seq_len}",
            device or "cpu", world, round(time.perf_counter() - t, 1), args.out]]))
    return 0


def _launch(args) -> int:
    """Re-run this command under torchrun with one process per GPU."""
    argv = [args.model, args.out, "--w-bit", str(args.w_bit), "--group-size", str(args.group_size),
            "--zero-point", str(args.zero_point), "--max-calib-samples", str(args.max_calib_samples),
            "--max-calib-seq-len", str(args.max_calib_seq_len), "--text-column", args.text_column,
            "--shard-size", str(args.shard_size), "--stream"]
    for flag, value in (("--fallback-group-size", args.fallback_group_size), ("--calib", args.calib),
                        ("--device", args.device)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (("--no-clip", args.no_clip), ("--overwrite", args.overwrite), ("--no-resume", not args.resume),
                     ("--trust-remote-code", args.trust_remote_code)):
        if on:
            argv.append(flag)
    if args.modules_to_not_convert:
        argv += ["--modules-to-not-convert", *args.modules_to_not_convert]
    if args.max_memory:
        argv += ["--max-memory", *args.max_memory]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           "-m", "fastawq", "quantize", *argv]
    return subprocess.call(cmd)


import argparse  # noqa: E402


class _BoolAction(argparse.Action):
    """--zero-point / --zero-point false / --no-zero-point."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs["nargs"] = "?"
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            setattr(namespace, self.dest, True)
        elif values.lower() in ("1", "true", "yes", "on"):
            setattr(namespace, self.dest, True)
        elif values.lower() in ("0", "false", "no", "off"):
            setattr(namespace, self.dest, False)
        else:
            raise argparse.ArgumentError(self, f"expected true/false, got {values!r}")
