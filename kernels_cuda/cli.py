"""``trellm build-kernels``: compile the CUDA kernels ahead of time into the cache, or into a folder
(``--into kernels_cuda/prebuilt``) that a wheel ships so users need no compiler."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-kernels", help="compile the CUDA kernels (nvcc) into the cache or a prebuilt folder")
    p.add_argument(
        "--arch",
        action="append",
        dest="archs",
        metavar="SM",
        help="target arch, e.g. --arch sm_80 --arch sm_90 (repeatable; default: the visible GPUs)",
    )
    p.add_argument("--into", type=Path, default=None, metavar="DIR",
                   help="also place the library and its manifest in DIR, e.g. kernels_cuda/prebuilt (adds PTX for "
                        "the newest arch, so newer GPUs run it too)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache holds this build")
    p.add_argument("-v", "--verbose", action="store_true", help="print the nvcc commands")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .build import KernelBuildError, build, install_prebuilt

    try:
        if args.into is not None:
            if not args.archs:
                print("trellm build-kernels: error: --into needs the target archs, e.g. --arch sm_80 --arch sm_90",
                      file=sys.stderr)
                return 2
            path = install_prebuilt(args.archs, args.into, force=args.force, verbose=args.verbose)
        else:
            path = build(archs=args.archs, force=args.force, verbose=args.verbose, progress=True)
    except (KernelBuildError, ValueError) as e:
        print(f"trellm build-kernels: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
