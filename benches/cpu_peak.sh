#!/usr/bin/env bash
# What one core of this machine can do at most, to read the side-by-side ratios against:
# f32 fused multiply-adds per second from registers (12 independent AVX-512 chains where the
# CPU has AVX-512, and 12 AVX2 chains), bf16 pairs' multiply-adds (12 `vdpbf16ps` chains, two
# multiply-adds per f32 lane, where it has AVX-512 BF16: on AMD's Zen 4 and 5 twice the f32
# rate, on Intel's cores below it, which is why plans there leave bf16 products to the f32
# GEMM unless the core has AMX), and, when PYTHON has torch, `torch.mm` on square f32
# matrices on one thread (MKL's SGEMM). A training step cannot sustain more than the first;
# PyTorch's GEMMs reach the second.
#
#   bash benches/cpu_peak.sh [CPU]       (CPU to pin to, default 0)
#   PYTHON=/tmp/torchvenv/bin/python bash benches/cpu_peak.sh
#
# Needs gcc and taskset. Builds into a temporary directory.
set -euo pipefail
cpu="${1:-0}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat > "$dir/peak.c" <<'C'
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define CHAINS(T, set1) T a0 = set1(1), a1 = set1(1), a2 = set1(1), a3 = set1(1), a4 = set1(1), a5 = set1(1), \
  a6 = set1(1), a7 = set1(1), a8 = set1(1), a9 = set1(1), a10 = set1(1), a11 = set1(1)
#define STEP(f) a0 = f(a0, b, c); a1 = f(a1, b, c); a2 = f(a2, b, c); a3 = f(a3, b, c); a4 = f(a4, b, c); \
  a5 = f(a5, b, c); a6 = f(a6, b, c); a7 = f(a7, b, c); a8 = f(a8, b, c); a9 = f(a9, b, c); a10 = f(a10, b, c); a11 = f(a11, b, c); \
  __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11))
__attribute__((target("avx512f"))) static void avx512(long n) {
  CHAINS(__m512, _mm512_set1_ps); __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-8f);
  double t = now(); for (long k = 0; k < n; k++) { STEP(_mm512_fmadd_ps); } double dt = now() - t;
  a0 = _mm512_add_ps(_mm512_add_ps(a0, a5), a11);
  printf("AVX-512 FMA peak: %.1f GFLOP/s (%g)\n", n * 12.0 * 16 * 2 / dt / 1e9, _mm512_reduce_add_ps(a0));
}
__attribute__((target("avx512f,avx512bf16"))) static void pairs(long n) {
  CHAINS(__m512, _mm512_set1_ps); __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80), c = b;
  double t = now(); for (long k = 0; k < n; k++) { STEP(_mm512_dpbf16_ps); } double dt = now() - t;
  a0 = _mm512_add_ps(_mm512_add_ps(a0, a5), a11);
  printf("AVX-512 BF16 pairs peak: %.1f GFLOP/s (%g)\n", n * 12.0 * 32 * 2 / dt / 1e9, _mm512_reduce_add_ps(a0));
}
__attribute__((target("avx2,fma"))) static void avx2(long n) {
  CHAINS(__m256, _mm256_set1_ps); __m256 b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-8f);
  double t = now(); for (long k = 0; k < n; k++) { STEP(_mm256_fmadd_ps); } double dt = now() - t;
  float out[8]; _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(a0, a5), a11));
  printf("AVX2 FMA peak:    %.1f GFLOP/s (%g)\n", n * 12.0 * 8 * 2 / dt / 1e9, out[0]);
}
int main(void) {
  const long n = 200000000;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) avx512(n); else printf("AVX-512 FMA peak: this CPU has no AVX-512\n");
  if (__builtin_cpu_supports("avx512bf16")) pairs(n / 4); else printf("AVX-512 BF16 pairs peak: this CPU has no AVX-512 BF16\n");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) avx2(n); else printf("AVX2 FMA peak:    this CPU has no AVX2 with FMA\n");
  return 0;
}
C
gcc -O3 "$dir/peak.c" -o "$dir/peak"
taskset -c "$cpu" "$dir/peak"
if [ -n "${PYTHON:-}" ]; then
  taskset -c "$cpu" "$PYTHON" - <<'PY'
import time
import torch
torch.set_num_threads(1)
for n in (512, 1024, 2048):
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    dt = time.perf_counter() - t
    print(f"torch.mm {n}x{n}, 1 thread: {2 * n ** 3 * reps / dt / 1e9:.1f} GFLOP/s (torch {torch.__version__})")
PY
fi
