"""``trellm build-kernels``: compile the CUDA kernels ahead of time into the cache."""
from __future__ import annotations

import argparse
import sys


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-kernels", help="compile the CUDA kernels into the cache (nvcc)")
    p.add_argument(
        "--arch",
        action="append",
        dest="archs",
        metavar="SM",
        help="target arch, e.g. sm_90 (repeatable; default: the visible GPUs)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the cache holds this build")
    p.add_argument("-v", "--verbose", action="store_true", help="print the nvcc commands")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .build import KernelBuildError, build

    try:
        path = build(archs=args.archs, force=args.force, verbose=args.verbose)
    except (KernelBuildError, ValueError) as e:
        print(f"trellm build-kernels: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
