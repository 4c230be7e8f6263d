"""The codec's CPU time per call against message size: one encode and one decode cost a fixed time
beyond their bytes, which each process measures for itself (`bloombee.codec.calls`, at two sizes); this fits the
line over many sizes to check that two are enough.

    .venv/bin/python benchmarks/codec_calls.py      # writes results/codec_calls.json

bf16 Gaussian activations of 2 KiB - 1 MiB, encoded with layout "auto" and decoded on this thread;
the median CPU time of each size, then a least-squares line time = call + bytes / speed per side.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bloombee.codec.calls import call_costs, cpu_times  # noqa: E402

SIZES = (2048, 4096, 8192, 16384, 65536, 131072, 262144, 1048576)


def fit(sizes: list[int], seconds: list[float]) -> dict:
    """time = call + bytes / speed, least squares."""
    slope, intercept = np.polyfit(np.array(sizes, dtype=float), np.array(seconds), 1)
    return {"call_us": intercept * 1e6, "speed_mb_per_s": 1 / slope / 1e6}


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for num_bytes in SIZES:
        encode_s, decode_s = cpu_times(num_bytes, 200 if num_bytes < 200_000 else 40)
        rows.append({"bytes": num_bytes, "encode_us": encode_s * 1e6, "decode_us": decode_s * 1e6})
        print(f"{num_bytes:8d} B: encode {encode_s * 1e6:7.1f} us, decode {decode_s * 1e6:7.1f} us")
    sizes = [row["bytes"] for row in rows]
    result = {"sizes": rows, "encode": fit(sizes, [row["encode_us"] * 1e-6 for row in rows]),
              "decode": fit(sizes, [row["decode_us"] * 1e-6 for row in rows])}
    costs = call_costs()
    result["two_point"] = {"encode_call_us": costs.encode_s * 1e6, "decode_call_us": costs.decode_s * 1e6}
    for side in ("encode", "decode"):
        print(f"{side}: {result[side]['call_us']:.0f} us per call + bytes at {result[side]['speed_mb_per_s']:.0f} MB/s "
              f"(the processes' two-point measurement: {result['two_point'][side + '_call_us']:.0f} us)")
    out = ROOT / "benchmarks" / "results" / "codec_calls.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
