"""Write a GGUF's unquantized twin (F16, or BF16), or its Q4_0 requantization, for the float and
Q4_0 panel benchmarks and speculative.py's draft-model target (how: bench/common/model_files.py).

The export of the default model is cached in bench/.models/ (ignored by git):

    python -m bench.engine.export_f16                        # bench/.models/gemma-3-270m-f16.gguf
    python -m bench.engine.export_f16 --dtype bf16 --source some.gguf --out some-bf16.gguf
"""

from __future__ import annotations

import argparse
import sys

from bench.common.model_files import FILE_TYPES, default_export, export


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=None, help="GGUF to export (default: the embedded Gemma 3 270M)")
    ap.add_argument("--out", default=None, help="where to write it (default: bench/.models/, cached)")
    ap.add_argument("--dtype", choices=tuple(FILE_TYPES), default="f16")
    args = ap.parse_args(argv)
    if args.source is None and args.out is None:
        path = default_export(args.dtype)
    else:
        if not (args.source and args.out):
            ap.error("--source and --out go together")
        path = export(args.source, args.out, args.dtype)
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
