"""The `tpkernels` command."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] in (["train"], ["generate"]):
        from tpkernels.train.launch import start_workers_early  # noqa: PLC0415

        start_workers_early(given[1:])  # with --nproc: the ranks' imports run beside the parsing and checks
    ap = argparse.ArgumentParser(prog="tpkernels", description="tpkernels command-line tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, build of tpkernels._C, GPUs, backend of each op")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    from tpkernels.planner.cli import add_parser as add_plan_parser  # noqa: PLC0415

    add_plan_parser(sub)
    from tpkernels.train.cli import add_parser as add_train_parser  # noqa: PLC0415

    add_train_parser(sub)
    from tpkernels.train.generate_cli import add_parser as add_generate_parser  # noqa: PLC0415

    add_generate_parser(sub)
    p_export = sub.add_parser("export-hf", help="write a training checkpoint as a Hugging Face folder")
    p_export.add_argument("checkpoint", help="a checkpoint folder (step_NNNNNNNN, e.g. step_00000040) or the save_dir holding them")
    p_export.add_argument("out", help="output folder (config.json + safetensors)")
    p_peft = sub.add_parser("export-peft", help="write a LoRA checkpoint's adapters as a PEFT folder")
    p_peft.add_argument("checkpoint", help="a checkpoint folder or the save_dir holding them (model.finetune lora)")
    p_peft.add_argument("out", help="output folder (adapter_config.json + adapter_model.safetensors)")
    p_prep = sub.add_parser("prepare-data", help="tokenize a text/JSONL corpus once into the indexed format "
                                                 "(.bin/.idx shards, memory-mapped by the trainer); resumable")
    p_prep.add_argument("inputs", nargs="+", help=".txt / .jsonl / .json files or folders of them")
    p_prep.add_argument("out", help="output folder (shard_NNNNN.bin/.idx; give it as data.source)")
    p_prep.add_argument("--tokenizer", default=None, help="a tokenizers JSON or HF tokenizer folder (default: bytes)")
    p_prep.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p_prep.add_argument("--shard-docs", type=int, default=10_000, help="documents per shard")
    p_prep.add_argument("--text-key", default="text", help="the JSON field holding a document")
    p_prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    if args.command == "info":
        from tpkernels.info import collect, format_report  # noqa: PLC0415

        info = collect()
        print(json.dumps(info, indent=2) if args.json else format_report(info))
    elif args.command == "plan":
        from tpkernels.planner.cli import run  # noqa: PLC0415

        try:
            return run(args)
        except ValueError as e:  # bad input: one clear line, no traceback
            print(f"tpkernels plan: error: {e}", file=sys.stderr)
            return 2
    elif args.command in ("export-hf", "export-peft"):
        from tpkernels.train.checkpoint import export_hf, export_peft  # noqa: PLC0415

        export = export_hf if args.command == "export-hf" else export_peft
        try:
            print(f"wrote {export(args.checkpoint, args.out)}")
        except (ValueError, OSError) as e:  # a damaged checkpoint, an unwritable out: one line
            print(f"tpkernels {args.command}: error: {e}", file=sys.stderr)
            return 2
    elif args.command == "prepare-data":
        from tpkernels.data.prepare import prepare_data  # noqa: PLC0415

        try:
            done = prepare_data(args.inputs, args.out, args.tokenizer, workers=args.workers,
                                shard_docs=args.shard_docs, text_key=args.text_key, progress=not args.no_progress)
        except (ValueError, OSError) as e:
            print(f"tpkernels prepare-data: error: {e}", file=sys.stderr)
            return 2
        print(f"{args.out}: {done['shards']} shard(s), {done['written']} written ({done['tokens']} tokens), "
              f"{done['skipped']} already done")
    elif args.command == "generate":
        from tpkernels.train.generate_cli import run_reporting_errors as run_generate  # noqa: PLC0415

        return run_generate(args)
    elif args.command == "train":
        from tpkernels.train.cli import run_reporting_errors  # noqa: PLC0415

        return run_reporting_errors(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
