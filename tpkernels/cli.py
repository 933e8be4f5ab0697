"""The `tpkernels` command."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tpkernels", description="tpkernels command-line tools")
    sub = ap.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, build of tpkernels._C, GPUs, backend of each op")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)

    if args.command == "info":
        from tpkernels.info import collect, format_report  # noqa: PLC0415

        info = collect()
        print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
