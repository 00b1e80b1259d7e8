"""Decoding speed side by side: `mars bench` with the report written under benchmarks/results/.

    python benchmarks/decode_speed.py --model ./out --threshold 0.9 --threshold 0.8
    python benchmarks/decode_speed.py --batch-sizes 1 --repeats 2 --max-tokens 32 --forward-k 1-8

Every `mars bench` option applies. Without --output the JSON goes to
benchmarks/results/decode_speed_<backend>_<UTC time>.json; the table is printed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mars.cli.bench import bench_command


def main(argv: list[str]) -> None:
    if not any(a == "--output" or a.startswith("--output=") for a in argv):
        backend = next((a.split("=", 1)[1] for a in argv if a.startswith("--backend=")), None)
        if backend is None and "--backend" in argv[:-1]:
            backend = argv[argv.index("--backend") + 1]
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = Path(__file__).resolve().parent / "results" / f"decode_speed_{backend or 'auto'}_{stamp}.json"
        argv = [*argv, "--output", str(out)]
    bench_command.main(args=argv, prog_name="decode_speed.py")


if __name__ == "__main__":
    main(sys.argv[1:])
