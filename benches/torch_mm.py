"""cuBLAS (through torch.matmul) at the products benches/matmul_probe.rs times: exact f32 (TF32
off), TF32, and bf16 operands with f32 sums. One markdown row per shape and mode.

    python3 benches/torch_mm.py [--shapes "256x784x512;784x256x512:ta"] [--reps 20]
"""
import argparse
import time

import torch

DEFAULT = ("256x784x512;256x512x512;256x512x10;256x10x512:tb;256x512x512:tb;784x256x512:ta;512x256x512:ta;512x256x10:ta;"
           "8192x128x384;8192x128x512;8192x512x128;8192x128x65:tb;8192x384x128:tb;128x8192x384:ta;512x8192x128:ta;"
           "256x128x32x128:tb;256x128x128x32")


def parse(s):
    dims, _, flags = s.partition(":")
    d = [int(v) for v in dims.split("x")]
    if len(d) == 3:
        d = [1] + d
    return d, flags in ("ta", "tab"), flags in ("tb", "tab")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=DEFAULT)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    print(f"| shape (batch x m x k x n) | operands | torch {torch.__version__} | us/product | TFLOP/s |")
    print("|---|---|---|---|---|")
    for s in filter(None, a.shapes.split(";")):
        (b, m, k, n), ta, tb = parse(s)
        for mode in ("f32", "tf32", "bf16"):
            torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
            dt = torch.bfloat16 if mode == "bf16" else torch.float32
            x = torch.rand(b, k, m, device=dev, dtype=dt).transpose(1, 2) if ta else torch.rand(b, m, k, device=dev, dtype=dt)
            y = torch.rand(b, n, k, device=dev, dtype=dt).transpose(1, 2) if tb else torch.rand(b, k, n, device=dev, dtype=dt)
            if b == 1:
                x, y = x[0], y[0]
            for _ in range(3):
                torch.matmul(x, y)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.reps):
                torch.matmul(x, y)
            torch.cuda.synchronize()
            secs = (time.perf_counter() - t) / a.reps
            label = f"{str(b) + ' x ' if b > 1 else ''}{m} x {k} x {n}{' (a^T)' if ta else ''}{' (b^T)' if tb else ''}"
            print(f"| {label} | {mode} | torch.matmul | {secs * 1e6:.1f} | {2 * b * m * k * n / secs / 1e12:.2f} |", flush=True)


if __name__ == "__main__":
    main()
