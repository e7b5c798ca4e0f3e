// Quantized grouped matmul for the weight-read-bound MoE case, in CUDA (an experiment beside the Pallas
// kernels): out[rows of group g] = x[rows of group g] @ dequantize(W[g]), W block-quantized along k
// (int8 with one f16 scale per 32 k, or 4-bit codes with an f16 scale and offset per 32 k), bf16 in and out,
// f32 accumulation. Called from JAX through the XLA FFI (benchmarks/cuda_gmm/__init__.py).
//
// Why: the Pallas kernels (Triton and Mosaic GPU) run the weight-bound case (m = 4096, k = 2048, n = 1024,
// 256 experts) at 1.5-1.6x bf16 for both widths, bound by the dequantization at 2 programs of 4 warps per SM
// (docs/benchmarks_gmm.md). This kernel is the Marlin design (Frantar et al., "MARLIN: Mixed-Precision
// Auto-Regressive Parallel Inference on Large Language Models", 2024) cut down to what the MoE case needs:
//  - the codes are repacked once (`repack` in __init__.py) so that each thread's codes for a pipeline stage
//    are one (4-bit) or two (int8) 16-byte words, already in the order of the `mma.sync.m16n8k16` B fragment;
//  - codes, scales and the group's x rows stream through a cp.async pipeline in shared memory;
//  - each thread dequantizes its own fragments in registers (no shared-memory round trip for the float
//    weights) and the tensor cores take them straight from registers;
//  - the dequantization is exact by default: the weights are round_bf16(fma(q, s, m)) (4-bit) and
//    round_bf16(q * s) (int8) in f32, the values of `QuantizedWeights.dequantize(bf16)` bit for bit. The code
//    is turned into an exact float by placing it in the mantissa of a power of two (a LOP3 or a byte permute),
//    not by the quarter-rate integer conversion. ARITH (4-bit, opt-in) works in bf16 pairs instead.
//
// Work decomposition: one CTA of 8 warps per (128 output columns, group), looping over the group's rows in
// passes of MT * 16 rows; warp w owns columns [16 w, 16 w + 16) of the CTA's 128 and all the pass's rows, as
// m16 tiles (out = x W) or, SWAP, n8 tiles (out^T = W^T x^T). The k loop runs in stages of 64 KSUB.
// With swiglu (SWAP only) the weights are a gate_up whose columns `repack` interleaved, and the epilogue writes
// silu(gate) * up from the f32 accumulators. Measured on an H100 beside the Pallas kernel: docs/benchmarks_gmm.md,
// "2026-11-26 late night".

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int BN = 128;       // output columns per CTA
constexpr int BK = 64;        // k per pipeline stage (two quantization blocks)
constexpr int THREADS = 256;  // 8 warps

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 4-bit code at bit position P (P <= 16) of `word`, exact, as a float: (word & 0xF << P) | bits(2^(23-P)) is
// the float 2^(23-P) + q (one LOP3); subtracting 2^(23-P) leaves q.
template <int P>
__device__ __forceinline__ float nibble(uint32_t word) {
  constexpr uint32_t kBase = static_cast<uint32_t>(127 + 23 - P) << 23;
  constexpr float kBaseF = static_cast<float>(1u << (23 - P));
  uint32_t bits;  // one LOP3 ((a & b) | c); left to itself the compiler splits it in two
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(word), "n"(0xFu << P), "n"(kBase));
  return __uint_as_float(bits) - kBaseF;
}

// int8 code stored biased (u = q + 128) as byte B of `word`: the byte permute builds 2^15 + u, and
// fma(2^15 + u, s, -(2^15 + 128) s) = q s exactly for an f16 s (both products fit f32's 24 bits).
template <int B>
__device__ __forceinline__ float dequant_byte(uint32_t word, float s, float bias) {
  constexpr uint32_t kSel = (7u << 12) | (4u << 8) | (static_cast<uint32_t>(B) << 4) | 4u;
  return fmaf(__uint_as_float(__byte_perm(word, 0x47000000u, kSel)), s, bias);
}

// ARITH 1 (4-bit, not exact; the semantics of the Pallas kernel's opt-in "asm_bf16"): register r of a word
// holds the codes of one fragment register at bits 4 r and 16 + 4 r (`repack(arith="bf16")`); one LOP3 puts
// them into the mantissas of a bf16 pair of 128 (128 + q, exact), one bf16x2 fma takes q out exactly and one
// applies the scale and offset (stored rounded to bf16), rounding once to bf16.
__device__ __forceinline__ uint32_t bf16_pair_128(uint32_t x) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(bits) : "r"(x), "n"(0x000F000Fu), "n"(0x43004300u));
  return bits;
}
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// One pipeline stage: KSUB k-blocks of 64 (the repacked layout's unit) of x rows, codes and scales.
template <int BITS, int MT, int KSUB>
struct Stage {
  static constexpr int kXChunks = BK * 2 * KSUB / 16;       // 16-byte chunks per x row
  static constexpr int kXRowBytes = BK * 2 * KSUB + 16;      // padded: ldmatrix's 8 rows hit distinct banks
  static constexpr int kXBytes = MT * 16 * kXRowBytes;
  static constexpr int kXRowsPerIter = THREADS / kXChunks;   // rows one sweep of the CTA's threads copies
  static constexpr int kXIters = (MT * 16 + kXRowsPerIter - 1) / kXRowsPerIter;
  static constexpr int kCodeWords = BITS == 4 ? 1 : 2;       // 16-byte words per thread and k-block of 64
  static constexpr int kCodeBytes = KSUB * THREADS * 16 * kCodeWords;
  static constexpr int kScaleBlockBytes = 2 * BN * (BITS == 4 ? 4 : 2);  // [2 blocks, 128 cols] (s, m) or s
  static constexpr int kScaleBytes = KSUB * kScaleBlockBytes;
  static constexpr int kBytes = kXBytes + kCodeBytes + kScaleBytes;
};

struct Pass {  // one CTA's pass over its group's weights for rows [p0, p0 + rows)
  const __nv_bfloat16* x;
  const uint4* codes_g;
  const uint4* scales_g;
  __nv_bfloat16* out;
  uint8_t* smem;
  int k, n, col0, p0, rows;
  bool swiglu;  // SWAP only: columns (g, g + 8) of each warp are a gate and its up; out[row, n / 2] gets
                // silu(gate) * up (`repack(swiglu=True)` interleaves them)
};

// The k loop of one pass with TILES tiles of rows: a cp.async pipeline of STAGES stages, each thread
// dequantizing its weight fragments in registers. Not SWAP: out = x W per m16 tile of rows (TILES <= MT), the
// weights as the mma's B operand, 2 TILES mma per k16 step. SWAP: out^T = W^T x^T, the same registers as the
// A operand of one m16 tile of 16 columns, the rows as n8 tiles (TILES <= 2 MT), TILES mma per k16 step, so
// that a group's rows are padded to 8 instead of 16.
template <int BITS, int MT, int STAGES, int KSUB, bool SWAP, bool ARITH, int TILES>
__device__ __forceinline__ void run_pass(const Pass& p) {
  using S = Stage<BITS, MT, KSUB>;
  static_assert(!ARITH || BITS == 4, "bf16 arithmetic: 4-bit codes");
  constexpr int MTA = SWAP ? (TILES + 1) / 2 : TILES;  // m16 tiles of x rows read by ldmatrix.x4
  constexpr int NACC = SWAP ? 1 : 2;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int nk = p.k / (BK * KSUB);  // stages

  // each thread copies chunk x_ch of rows x_row + j * kXRowsPerIter
  const int x_row = tid / S::kXChunks, x_ch = tid % S::kXChunks;
  const __nv_bfloat16* x_src = p.x + static_cast<size_t>(p.p0 + x_row) * p.k + x_ch * 8;
  const uint32_t x_dst = x_row * S::kXRowBytes + x_ch * 16;
  const uint32_t smem0 = smem_addr(p.smem);

  auto load_stage = [&](int ks, int slot) {
    const uint32_t base = smem0 + slot * S::kBytes;
    const __nv_bfloat16* xsrc = x_src + ks * BK * KSUB;
#pragma unroll
    for (int j = 0; j < S::kXIters; ++j) {
      if (j * S::kXRowsPerIter < MTA * 16 && x_row + j * S::kXRowsPerIter < p.rows) {
        cp_async16(base + x_dst + j * S::kXRowsPerIter * S::kXRowBytes,
                   xsrc + static_cast<size_t>(j * S::kXRowsPerIter) * p.k);
      }
    }
    const uint4* csrc = p.codes_g + static_cast<size_t>(ks) * KSUB * THREADS * S::kCodeWords;
#pragma unroll
    for (int u = 0; u < KSUB; ++u)
#pragma unroll
      for (int w = 0; w < S::kCodeWords; ++w) {
        const int i = (u * THREADS + tid) * S::kCodeWords + w;
        cp_async16(base + S::kXBytes + i * 16, csrc + i);
      }
    if (tid < S::kScaleBytes / 16) {
      cp_async16(base + S::kXBytes + S::kCodeBytes + tid * 16,
                 p.scales_g + static_cast<size_t>(ks) * (S::kScaleBytes / 16) + tid);
    }
  };
  float acc[TILES][NACC][4];
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int j = 0; j < NACC; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }
  // ldmatrix.x4 of 16 rows x k16: lanes 8 q .. 8 q + 7 give the rows of matrix q. Not SWAP (the A fragment):
  // rows + 8 (q & 1), k + 8 (q >> 1). SWAP (the B fragments of two n8 tiles): rows + 8 (q >> 1), k + 8 (q & 1).
  const int q_rows = SWAP ? (lane >> 4) & 1 : (lane >> 3) & 1, q_k = SWAP ? (lane >> 3) & 1 : lane >> 4;
  const uint32_t a_off = (q_rows * 8 + (lane & 7)) * S::kXRowBytes + q_k * 16;
  const int sc_off = warp * 16 + (lane / 4) * 2;  // this thread's (nt = 0, 1) scale pair within a block

  for (int ks = 0; ks < nk; ++ks) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int pre = ks + STAGES - 1;
      if (pre < nk) load_stage(pre, pre % STAGES);
      cp_async_commit();
    }
    const int slot = ks % STAGES;
    const uint8_t* base = p.smem + slot * S::kBytes;
    const uint32_t xs = smem0 + slot * S::kBytes + a_off;
#pragma unroll
    for (int u = 0; u < KSUB; ++u) {
      const uint4* cw = reinterpret_cast<const uint4*>(base + S::kXBytes) + (u * THREADS + tid) * S::kCodeWords;
      const uint4 code0 = cw[0];
      uint4 code1 = code0;
      if constexpr (S::kCodeWords == 2) code1 = cw[1];
      const uint8_t* sc = base + S::kXBytes + S::kCodeBytes + u * S::kScaleBlockBytes;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        float s[2], o[2];
        [[maybe_unused]] uint32_t s2[2], o2[2];  // ARITH: (s, s) and (m, m) bf16 pairs
        if constexpr (ARITH) {  // [blk, 128] (scale, offset) bf16 pairs
          const uint2 so = *reinterpret_cast<const uint2*>(sc + (blk * BN + sc_off) * 4);
          s2[0] = __byte_perm(so.x, 0, 0x1010); o2[0] = __byte_perm(so.x, 0, 0x3232);
          s2[1] = __byte_perm(so.y, 0, 0x1010); o2[1] = __byte_perm(so.y, 0, 0x3232);
        } else if constexpr (BITS == 4) {  // [blk, 128] (scale, offset) half2, a thread's two columns adjacent
          const uint2 so = *reinterpret_cast<const uint2*>(sc + (blk * BN + sc_off) * 4);
          const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&so.x));
          const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&so.y));
          s[0] = f0.x; o[0] = f0.y; s[1] = f1.x; o[1] = f1.y;
        } else {  // [blk, 128] half scales
          const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(sc + (blk * BN + sc_off) * 2));
          s[0] = f0.x; s[1] = f0.y;
          o[0] = -32896.f * s[0];  // -(2^15 + 128) s, exact
          o[1] = -32896.f * s[1];
        }
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          const int i = blk * 2 + sub;  // k16 step within the k-block of 64
          uint32_t b[2][2];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if constexpr (BITS == 4) {
              // word (blk, nt) holds the 8 codes of this thread's column in quantization block blk, nibble
              // 4 sub + 2 j + e = k offset 16 sub + 8 j + 2 (lane % 4) + e (ARITH: at bits 4 (2 sub + j) + 16 e)
              const uint32_t w = (&code0.x)[blk * 2 + nt];
              if constexpr (ARITH) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  const int r = 2 * sub + j;
                  const uint32_t q = fma_bf16x2(bf16_pair_128(r ? w >> (4 * r) : w), 0x3F803F80u, 0xC300C300u);
                  b[nt][j] = fma_bf16x2(q, s2[nt], o2[nt]);
                }
              } else {
                const uint32_t wh = w >> 12;  // nibbles 5..7 to bit positions 8..16
                float v[4];
                if (sub == 0) {
                  v[0] = nibble<0>(w); v[1] = nibble<4>(w); v[2] = nibble<8>(w); v[3] = nibble<12>(w);
                } else {
                  v[0] = nibble<16>(w); v[1] = nibble<8>(wh); v[2] = nibble<12>(wh); v[3] = nibble<16>(wh);
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  b[nt][j] = pack_bf16(fmaf(v[2 * j], s[nt], o[nt]), fmaf(v[2 * j + 1], s[nt], o[nt]));
                }
              }
            } else {
              // word (i, nt): byte 2 j + e = k offset 16 i + 8 j + 2 (lane % 4) + e
              const int wi = i * 2 + nt;
              const uint32_t w = wi < 4 ? (&code0.x)[wi] : (&code1.x)[wi - 4];
              b[nt][0] = pack_bf16(dequant_byte<0>(w, s[nt], o[nt]), dequant_byte<1>(w, s[nt], o[nt]));
              b[nt][1] = pack_bf16(dequant_byte<2>(w, s[nt], o[nt]), dequant_byte<3>(w, s[nt], o[nt]));
            }
          }
#pragma unroll
          for (int mt = 0; mt < MTA; ++mt) {
            uint32_t a[4];
            ldmatrix_x4(a, xs + mt * 16 * S::kXRowBytes + (8 * u + 2 * i) * 16);
            if constexpr (SWAP) {
              // A = W^T [16 columns, k16]: (col g, k lo), (col g + 8, k lo), (col g, k hi), (col g + 8, k hi)
              const uint32_t w[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};
              mma_bf16(acc[2 * mt][0], w, a[0], a[1]);
              if (2 * mt + 1 < TILES) mma_bf16(acc[2 * mt + 1][0], w, a[2], a[3]);
            } else {
              mma_bf16(acc[mt][0], a, b[0][0], b[0][1]);
              mma_bf16(acc[mt][1], a, b[1][0], b[1][1]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the slots before the next pass refills them

  if constexpr (SWAP) {  // acc[t]: (col g, rows 8 t + 2 (lane % 4) + {0, 1}), then col g + 8
    if (p.swiglu) {
      const int col = p.col0 / 2 + warp * 8 + lane / 4;
#pragma unroll
      for (int t = 0; t < TILES; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 8 * t + 2 * (lane % 4) + e;
          const float gate = acc[t][0][e], up = acc[t][0][e + 2];
          if (r < p.rows) {
            p.out[static_cast<size_t>(p.p0 + r) * (p.n / 2) + col] =
                __float2bfloat16_rn(gate / (1.f + expf(-gate)) * up);
          }
        }
      }
      return;
    }
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
      const int col = p.col0 + warp * 16 + lane / 4;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 8 * t + 2 * (lane % 4) + (e & 1);
        if (r < p.rows) {
          p.out[static_cast<size_t>(p.p0 + r) * p.n + col + 8 * (e >> 1)] = __float2bfloat16_rn(acc[t][0][e]);
        }
      }
    }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < MTA; ++mt) {
#pragma unroll
    for (int nt = 0; nt < NACC; ++nt) {
      const int r = mt * 16 + lane / 4;
      const int col = p.col0 + warp * 16 + nt * 8 + 2 * (lane % 4);
      if (r < p.rows) {
        *reinterpret_cast<uint32_t*>(p.out + static_cast<size_t>(p.p0 + r) * p.n + col) =
            pack_bf16(acc[mt][nt][0], acc[mt][nt][1]);
      }
      if (r + 8 < p.rows) {
        *reinterpret_cast<uint32_t*>(p.out + static_cast<size_t>(p.p0 + r + 8) * p.n + col) =
            pack_bf16(acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
  }
}

// run_pass compiled for TILES, TILES + 1, ..., the most a pass can have: the one for `tiles`.
template <int BITS, int MT, int STAGES, int KSUB, bool SWAP, bool ARITH, int TILES>
__device__ __forceinline__ void dispatch_pass(const Pass& p, int tiles) {
  if constexpr (TILES < (SWAP ? 2 * MT : MT)) {
    if (tiles > TILES) {
      dispatch_pass<BITS, MT, STAGES, KSUB, SWAP, ARITH, TILES + 1>(p, tiles);
      return;
    }
  }
  run_pass<BITS, MT, STAGES, KSUB, SWAP, ARITH, TILES>(p);
}

// grid (n / BN, groups + 1); block y = groups zeroes the rows after the last group. Each pass runs the k loop
// compiled for its own number of row tiles, so that a group of few rows issues no idle mma.
template <int BITS, int MT, int STAGES, int KSUB, bool SWAP, bool ARITH>
__global__ void __launch_bounds__(THREADS, 2)
    gmm_dequant_kernel(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ codes,
                       const uint4* __restrict__ scales, const int32_t* __restrict__ offsets,
                       __nv_bfloat16* __restrict__ out, int m, int k, int n, int groups, bool swiglu) {
  using S = Stage<BITS, MT, KSUB>;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  const int g = blockIdx.y, nb = blockIdx.x;
  const int col0 = nb * BN;

  if (g == groups) {  // rows of no group: zeros (this CTA's BN columns, or BN / 2 with swiglu)
    const int w = swiglu ? BN / 2 : BN, n_out = swiglu ? n / 2 : n;
    for (int r = max(offsets[groups], 0) + tid / (w / 8); r < m; r += THREADS / (w / 8)) {
      *reinterpret_cast<uint4*>(out + static_cast<size_t>(r) * n_out + col0 / (BN / w) + (tid % (w / 8)) * 8) =
          make_uint4(0, 0, 0, 0);
    }
    return;
  }
  // clamped to [0, m]: group sizes that add up to more than m, or negative ones, must not make the kernel read
  // or write outside x / out
  const int r0 = max(0, min(offsets[g], m)), r1 = max(0, min(offsets[g + 1], m));
  if (r1 <= r0) return;
  const size_t cta = static_cast<size_t>(g) * (n / BN) + nb;
  Pass p{x, codes + cta * (k / BK) * (THREADS * S::kCodeWords), scales + cta * (k / BK) * (S::kScaleBlockBytes / 16),
         out, smem, k, n, col0, 0, 0, swiglu};
  for (int p0 = r0; p0 < r1; p0 += MT * 16) {
    p.p0 = p0;
    p.rows = min(r1 - p0, MT * 16);
    dispatch_pass<BITS, MT, STAGES, KSUB, SWAP, ARITH, 1>(p, SWAP ? (p.rows + 7) / 8 : (p.rows + 15) / 16);
  }
}

template <int BITS, int MT, int STAGES, int KSUB, bool SWAP, bool ARITH>
ffi::Error launch(cudaStream_t stream, const void* x, const void* codes, const void* scales, const int32_t* offsets,
                  void* out, int m, int k, int n, int groups, bool swiglu) {
  constexpr int smem = Stage<BITS, MT, KSUB>::kBytes * STAGES;
  auto kernel = gmm_dequant_kernel<BITS, MT, STAGES, KSUB, SWAP, ARITH>;
  static bool configured = false;
  if (!configured) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
      return ffi::Error::Internal("cudaFuncSetAttribute(MaxDynamicSharedMemorySize) failed");
    }
    configured = true;
  }
  dim3 grid(n / BN, groups + 1);
  kernel<<<grid, THREADS, smem, stream>>>(static_cast<const __nv_bfloat16*>(x), static_cast<const uint4*>(codes),
                                          static_cast<const uint4*>(scales), offsets,
                                          static_cast<__nv_bfloat16*>(out), m, k, n, groups, swiglu);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("gmm_dequant launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

template <int BITS>
ffi::Error dispatch(cudaStream_t stream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                    ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::BF16> out, int64_t m_tiles,
                    int64_t stages, int64_t k_sub, int64_t swap, int64_t arith, int64_t swiglu) {
  auto xd = x.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || od.size() != 2) return ffi::Error::InvalidArgument("x and out must be 2-D");
  // n: the weights' columns (out has n / 2 with swiglu)
  const int m = static_cast<int>(xd[0]), k = static_cast<int>(xd[1]), n = static_cast<int>(od[1]) * (swiglu ? 2 : 1);
  const int groups = static_cast<int>(offsets.element_count()) - 1;
  if (od[0] != m) return ffi::Error::InvalidArgument("out rows != x rows");
  if (k % (BK * k_sub) || n % BN) return ffi::Error::InvalidArgument("k must be a multiple of 64 k_sub and n of 128");
  const size_t want_codes = static_cast<size_t>(groups) * n * k * BITS / 8;
  if (codes.size_bytes() != want_codes) return ffi::Error::InvalidArgument("codes size does not match");
  if (arith && BITS != 4) return ffi::Error::InvalidArgument("arith=1 (bf16 arithmetic) is for 4-bit codes");
  if (swiglu && !swap) return ffi::Error::InvalidArgument("swiglu=1 needs swap=1");
  const void* xp = x.untyped_data();
  const void* cp = codes.untyped_data();
  const void* sp = scales.untyped_data();
  const int32_t* op = offsets.typed_data();
  void* outp = out->untyped_data();
#define HYBRIDLM_CASE(MT_, ST_, KS_, SW_)                                                     \
  if (m_tiles == MT_ && stages == ST_ && k_sub == KS_ && swap == SW_) {                        \
    if (arith) return launch<BITS, MT_, ST_, KS_, SW_ != 0, BITS == 4>(stream, xp, cp, sp, op, outp, m, k, n, \
                                                                    groups, swiglu != 0);                   \
    return launch<BITS, MT_, ST_, KS_, SW_ != 0, false>(stream, xp, cp, sp, op, outp, m, k, n, groups,      \
                                                        swiglu != 0);                                       \
  }
  HYBRIDLM_CASE(2, 3, 4, 0)
  HYBRIDLM_CASE(2, 3, 4, 1)
  HYBRIDLM_CASE(4, 4, 2, 0)
  HYBRIDLM_CASE(4, 4, 2, 1)
  HYBRIDLM_CASE(5, 3, 2, 1)
  HYBRIDLM_CASE(4, 4, 1, 0)
  HYBRIDLM_CASE(4, 4, 1, 1)
  HYBRIDLM_CASE(2, 4, 2, 1)
#undef HYBRIDLM_CASE
  return ffi::Error::InvalidArgument("unsupported (m_tiles, stages, k_sub, swap)");
}

// The two handlers' signature: x, codes, scales, offsets -> out, and the configuration's attributes.
auto binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::BF16>>()
      .Attr<int64_t>("m_tiles")
      .Attr<int64_t>("stages")
      .Attr<int64_t>("k_sub")
      .Attr<int64_t>("swap")
      .Attr<int64_t>("arith")
      .Attr<int64_t>("swiglu");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridlmGmmQ4, dispatch<4>, binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HybridlmGmmQ8, dispatch<8>, binding());
